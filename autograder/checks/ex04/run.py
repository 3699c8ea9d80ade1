"""Exercise 04: what runs in the learner's process. The recorder is bound here, at import, before any
learner code runs; `run` builds each case's inputs, calls the learner's fix, search or detector and returns
plain data; it decides nothing."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

import memlab
from memlab.clinic import StepRecorder
from memlab.core.models import GPT, GPTConfig

from .inputs import CASES, Case, case_gpu, case_step, leak_scenario, tiny_data

K_PROJ = 32                      # random directions the gradients are projected on


class _Recorder(StepRecorder):
    """Global hooks that watch every GPT forward and every optimizer step while active.

    clone=False (full size, fake tensors): count only. clone=True (tiny): keep the
    initial weights, and at each step the gradients and hyperparameters, by name.
    Inside a memlab tracker (the virtual GPU) it also notes, as memlab.clinic's
    StepRecorder does, the peak reached before each step and the bytes of optimizer
    state after it: from the second step on, that state is alive during forward and
    backward too."""

    def __init__(self, clone: bool):
        super().__init__()
        self.clone = clone
        self.rows = 0
        self.configs: list[GPTConfig] = []
        self.model: GPT | None = None
        self.initial: list[tuple[str, torch.Tensor]] = []
        self.steps: list[dict] = []
        self.optimizers: list = []           # every optimizer that stepped, once, in order
        self.counting = True                 # False during the grader's own second step

    def _register(self) -> list:
        return [register_module_forward_pre_hook(self._forward)] + super()._register()

    def _forward(self, module, args):
        if not isinstance(module, GPT):
            return None
        in_backward = torch._C._current_graph_task_id() != -1     # a checkpoint recomputing its forward
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1 and not in_backward and self.counting:
            self.rows += int(args[0].shape[0])
        if module.cfg not in self.configs:
            self.configs.append(module.cfg)
        if self.model is None:
            self.model = module
            if self.clone:
                self.initial = [(n, p.detach().clone()) for n, p in module.named_parameters()]
        return None

    def _step(self, opt, args, kwargs):
        if not self.counting:
            return None
        if not any(o is opt for o in self.optimizers):
            self.optimizers.append(opt)
        # parameters are matched by their position in model.named_parameters(), which wrapping blocks (e.g. for
        # checkpointing) keeps, while it changes their names; the reference's names are used in messages
        index = {}
        if self.model is not None:
            index = {id(p): (i, n) for i, (n, p) in enumerate(self.model.named_parameters())}
        rec = {"optimizer": type(opt).__name__, "missing": [], "grads": {}, "hyper": {}, "params": []}
        for group in opt.param_groups:
            hyper = {k: group.get(k) for k in ("lr", "betas", "eps", "weight_decay", "momentum", "amsgrad",
                                               "maximize", "nesterov", "dampening")}
            for p in group["params"]:
                key = index.get(id(p), (f"?{len(rec['hyper'])}", "a parameter outside the model"))
                rec["hyper"][key[0]] = hyper
                rec["params"].append(key[0])
                if p.grad is None:
                    rec["missing"].append(key[1])
                elif self.clone:
                    rec["grads"][key[0]] = p.grad.detach().clone()
        self.steps.append(rec)
        return super()._step(opt, args, kwargs)

    def _after_step(self, opt, args, kwargs):
        return super()._after_step(opt, args, kwargs) if self.counting else None

    def n_params(self) -> int:
        return len(list(self.model.parameters())) if self.model is not None else 0


def merged(rec: _Recorder) -> dict:
    """The optimizer steps of one training step taken together (one step, or one per parameter when the step
    runs in backward): per parameter its hyperparameters and gradient, and how often each was updated."""
    hyper_, grads, count = {}, {}, {}
    for s in rec.steps:
        for i in s["params"]:
            count[str(i)] = count.get(str(i), 0) + 1
        hyper_.update({str(i): {k: hyper(v) for k, v in h.items()} for i, h in s["hyper"].items()})
        grads.update(s["grads"])
    keys = sorted(grads, key=str)
    return {"optimizers": sorted({s["optimizer"] for s in rec.steps}),
            "missing": [m for s in rec.steps for m in map(str, s["missing"])],
            "updates": count, "hyper": hyper_, "grad_keys": sorted(map(str, keys)),
            "grad_norm": math.sqrt(sum(grads[i].double().pow(2).sum().item() for i in keys)),
            "grad_proj": project([grads[i] for i in keys], 1)}


def second_step(rec: _Recorder, c: Case, model):
    """The grader's own second training step on the model the learner's fix returned, with whatever the fix left
    alive (gradients zeroed in place, the optimizers' state): steady state measured, not extrapolated. Every
    optimizer that stepped in step 1 steps again if its parameters have gradients (none when the fix steps in
    backward, from hooks that free each gradient)."""
    from memlab.clinic import random_tokens
    rec.counting = False
    x, y = random_tokens(c.model, "full", c.rows)
    loss = model(x, y)
    loss.backward()
    del loss
    for o in rec.optimizers:
        if any(p.grad is not None for g in o.param_groups for p in g["params"]):
            o.step()


def hyper(v):
    """An optimizer hyperparameter as plain data."""
    if isinstance(v, torch.Tensor):
        return float(v)
    if isinstance(v, (tuple, list)):
        return [hyper(x) for x in v]
    if v is None or type(v) in (bool, int, float, str):
        return v
    return repr(v)[:60]


def project(tensors, seed: int) -> list[float]:
    """K_PROJ projections of the concatenation of `tensors` on fixed random directions (float64)."""
    out = torch.zeros(K_PROJ, dtype=torch.float64)
    for i, t in enumerate(tensors):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        out += torch.randn(K_PROJ, t.numel(), generator=g, dtype=torch.float64) @ t.detach().double().flatten()
    return out.tolist()


def run_tiny(fn, case, c: Case):
    x, y = tiny_data(case, c)
    rec = _Recorder(clone=True)
    torch.manual_seed(case["seed"])
    with rec:
        out = fn("tiny", data=(x.clone(), y.clone()))
    return rec, out


def script_run(task):
    c = CASES[task]

    def run(case, **names):
        fn = names[c.fixed_name]
        if not callable(fn):
            return {"raised": f"{c.fixed_name} is a {type(fn).__name__}, not a function taking (size, data)"}
        if case["part"] == "full":
            rec = _Recorder(clone=False)
            second = {"started": False}

            def two_steps(size):
                out = fn(size)
                if c.two_steps and isinstance(out, torch.nn.Module) and rec.steps:
                    second["started"] = True
                    second_step(rec, c, out)
                return out
            try:
                with rec:
                    run_ = memlab.VirtualGPU(c.gpu).run(two_steps, "full", catch_oom=True)
            except Exception as e:  # noqa: BLE001 - the judge teaches
                return {"raised": f"{type(e).__name__}: {str(e)[:400]}"}
            m = merged(rec)
            return {"fits": bool(run_.fits), "oom": None if run_.fits else str(run_.oom_message)[:3000],
                    "peak": int(run_.peak), "pre_step_peak": [int(p) for p in rec.pre_step_peak],
                    "state_bytes": [int(s) for s in rec.state_bytes], "rows": int(rec.rows),
                    "configs": [dataclasses.asdict(k) for k in rec.configs],
                    "steps": [{"optimizer": s["optimizer"], "missing": list(map(str, s["missing"]))}
                              for s in rec.steps],
                    "n_params": rec.n_params(), "updates": m["updates"], "optimizers": m["optimizers"],
                    "second_step": second["started"]}
        try:
            rec, out = run_tiny(fn, case, c)
        except Exception as e:  # noqa: BLE001
            return {"raised_tiny": f"{type(e).__name__}: {str(e)[:400]}"}
        got = {"configs": [dataclasses.asdict(k) for k in rec.configs],
               "initial": [[list(p.shape), p.double().sum().item(), project([p], i)[0]]
                           for i, (_, p) in enumerate(rec.initial)],
               "steps": [{"optimizer": s["optimizer"], "missing": list(map(str, s["missing"])),
                          "hyper": {str(i): {k: hyper(v) for k, v in h.items()} for i, h in s["hyper"].items()},
                          "grad_keys": sorted(map(str, s["grads"])),
                          "grad_norm": math.sqrt(sum(g.double().pow(2).sum().item() for g in s["grads"].values())),
                          "grad_proj": project([s["grads"][i] for i in sorted(s["grads"], key=str)], 1)}
                         for s in rec.steps],
               "n_params": rec.n_params(), "merged": merged(rec)}
        if isinstance(out, torch.nn.Module):
            got["out"] = {"module": [[list(p.shape), p.detach().float().flatten().tolist()]
                                     for p in out.parameters()]}
        elif isinstance(out, torch.Tensor):
            got["out"] = {"tensor": out.detach().double().tolist(), "shape": list(out.shape)}
        else:
            got["out"] = {"other": type(out).__name__}
        return got
    return run


# ----------------------------------------------------------------------------- task4_5
def max_batch_run(case, find_max_batch_size):
    gpu, step, calls = case_gpu(case), case_step(case), []

    def counted(batch, *args, **kwargs):
        calls.append(batch if type(batch) is int else repr(batch)[:40])
        return step(batch, *args, **kwargs)

    try:
        got = find_max_batch_size(counted, gpu, limit=case["limit"])
    except torch.OutOfMemoryError as e:
        return {"oom_escaped": str(e).splitlines()[0][:300], "calls": calls[:200]}
    return {"got": got if type(got) is int else f"a {type(got).__name__}: {str(got)[:40]}", "calls": calls[:200],
            "n_calls": len(calls)}


# ----------------------------------------------------------------------------- task4_6
def leak_run(case, detect_leak):
    got = detect_leak(*leak_scenario(case), n_steps=case["n_steps"])
    if got is None:
        return {"none": True}
    if type(got) is not tuple or len(got) != 2:
        return {"shape": f"{type(got).__name__}: {str(got)[:60]}"}
    cat, per = got
    return {"category": cat if type(cat) is str else f"a {type(cat).__name__}",
            "per_step": float(per) if type(per) in (int, float) else f"a {type(per).__name__}"}

