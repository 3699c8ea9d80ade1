"""Exercise 00's inputs, the learner side rebuilt on both sides from a case's plain data: run.py uses them in the
sandbox to call the learner's code, the trusted refs.py and judge.py in the grader for their references. The GPU a
roofline case runs on, the keys of a roofline result, and the op sequences of task 0.4 with the tensors they start
from."""

from __future__ import annotations

import torch

from memlab.kit.ex00 import GPUS


# ----------------------------------------------------------------------------- task 0.2: the roofline
def gpu_spec(case) -> dict:
    """The GPU a roofline case runs on: a preset of memlab.kit.ex00.GPUS, or the case's own made-up spec."""
    return case["spec"] if "spec" in case else GPUS[case["gpu"]]


KEYS = ("intensity", "peak", "ridge", "attainable", "bound", "time_s")


# ----------------------------------------------------------------------------- task 0.4: new storage
# Each op maps a tensor to a tensor (or a tuple, or a list); a case lists the ops, and fn applies them in order.
def _chunk2(x):
    return x.chunk(2, dim=0)


def _split_list(x):
    return list(x.clone().split(2, dim=0))                                # a list of views of one new storage


OPS = {
    "t": lambda x: x.transpose(-1, -2),                                   # view
    "contiguous": lambda x: x.contiguous(),                               # copy only if not contiguous
    "flatten": lambda x: x.reshape(-1),                                   # view if it can, copy if it must
    "reshape_rows": lambda x: x.reshape(x.shape[0], -1),
    "mul_": lambda x: x.mul_(2),                                          # in place
    "add": lambda x: x + 1,                                               # a new tensor
    "rows": lambda x: x[1:-1],                                            # basic slicing: view
    "cols": lambda x: x[..., ::2],
    "index": lambda x: x[[0, -1]],                                        # advanced indexing: copy
    "expand": lambda x: x.unsqueeze(0).expand(3, *x.shape),               # view, stride 0
    "clone": lambda x: x.clone(),
    "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "to_self_dtype": lambda x: x.to(x.dtype),                             # no-op: returns x itself
    "half": lambda x: x.half(),                                           # a dtype change is a copy
    "detach": lambda x: x.detach(),
    "chunk2": _chunk2,                                                    # a tuple of views
    "clone_split_list": _split_list,                                      # a list
}
PAIR_OPS = {
    "cat": lambda x, y: torch.cat([x, y]),
    "add_": lambda x, y: x.add_(y),
    "pair": lambda x, y: (x, y.t().contiguous()),
    "pair_list": lambda x, y: [y, x.t().contiguous(), x],                 # a list: inputs and one new storage
}


def _storage_inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    xs = [torch.randn(*case["shape"], generator=g).to(dtype) for _ in range(case.get("inputs", 1))]
    return xs


def _storage_fn(case):
    ops = case["ops"]
    if case.get("inputs", 1) == 2:
        def fn(x, y):
            return PAIR_OPS[ops[0]](x, y)
        return fn

    def fn(x):
        for name in ops:
            x = OPS[name](x)
        return x
    return fn
