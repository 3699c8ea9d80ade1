"""Exercise 06's runs, in the learner's process: the learner's optimizer on N forked ranks (memlab.kit.ex06's
harness and per-rank driver), the estimator called on plain lists, and the calls the learner may not make."""

from __future__ import annotations

import os

from memlab.kit.ex06 import RanksFailed, rank_fn, run_ranks

from ..common import no_calls


# ----------------------------------------------------------------------------- what the learner may not call
OFF_LIMITS = ("torch.distributed.optim.ZeroRedundancyOptimizer, DeepSpeed, memlab.sharding.zero* and "
              "memlab.core.estimate.zero_model_state_bytes")


def _forbidden(filename: str, name: str) -> bool:
    f = filename.replace(os.sep, "/")
    return (f.endswith("/zero_redundancy_optimizer.py") or "/deepspeed/" in f
            or f.endswith(tuple(f"/memlab/sharding/{m}.py" for m in ("zero", "zero_train", "zero_scale")))
            or (f.endswith("/memlab/core/estimate.py") and name == "zero_model_state_bytes"))


def no_shortcuts(task: str):
    """While the learner's code runs, no call into the off-limits libraries (common.no_calls)."""
    return no_calls(task, _forbidden, f"{OFF_LIMITS} are off limits here; write the sharding yourself")


# ----------------------------------------------------------------------------- tasks 6.1 and 6.2
def _rank_fn(case, cls, task):
    return rank_fn(case, cls, lambda: no_shortcuts(task))


def dp_run(task, name):
    def run(case, **names):
        cls = names[name]
        if not isinstance(cls, type):
            raise TypeError(f"{name} must be a class (a torch.optim.Optimizer subclass), got {type(cls).__name__}")
        try:
            return run_ranks(case["world"], _rank_fn(case, cls, task), timeout=60)
        except RanksFailed as e:
            text = str(e)
            if "NoneType" in text:
                text = ("a parameter without a gradient (frozen, or unused by this forward: .grad is None) reached a "
                        "collective or the optimizer: skip it, on every rank alike. " + text)
            raise RanksFailed(text) from None
    return run


# ----------------------------------------------------------------------------- task 6.3
def mem_run(case, rank_memory):
    with no_shortcuts("task6_3_rank_memory"):
        out = rank_memory(list(case["numels"]), case["stage"], case["world"], case["layout"])
    if not isinstance(out, dict):
        raise TypeError(f"rank_memory must return a dict, got {type(out).__name__}")
    return {str(k): (v if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)[:60])
            for k, v in out.items()}
