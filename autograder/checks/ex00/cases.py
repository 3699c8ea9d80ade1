"""Exercise 00's cases (trusted side): what each task's inputs are drawn from, and the sizes and descriptions the
judge shares with them. The op sequences of task 0.4 that both sides rebuild from a case are in inputs.py."""

from __future__ import annotations

import math

import torch

from memlab.kit.ex00 import GPUS

from .inputs import OPS
# re-exported: moved to inputs.py, the tests still read them as cases.<name>
from .inputs import _storage_fn, _storage_inputs, gpu_spec  # noqa: F401

DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn")
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


# ----------------------------------------------------------------------------- task 0.1: FLOPs and bytes
def _numel(shape) -> int:
    return math.prod(shape)


def _cost_cases(hidden, r):
    if not hidden:
        return [{"op": "matmul", "shapes": [[8, 128, 64], [64, 96]], "dtype": "bfloat16"},
                {"op": "matmul", "shapes": [[2, 3, 5, 7], [2, 3, 7, 11]], "dtype": "float32"},
                {"op": "add", "shapes": [[4, 10, 6], [6]], "dtype": "float16"},
                {"op": "relu", "shapes": [[3, 5]], "dtype": "float32"},
                {"op": "softmax", "shapes": [[2, 4, 9, 9]], "dtype": "float32"},
                {"op": "layer_norm", "shapes": [[4, 10, 48]], "dtype": "bfloat16"}]

    def d():
        return r.randint(3, 97) | 1                              # odd: never a power of two past 1

    dtypes = list(DTYPES) + [r.choice(DTYPES) for _ in range(11 - len(DTYPES))]
    r.shuffle(dtypes)                                            # every dtype in every run, on a different op

    def dt():
        return dtypes.pop()

    b, h, t, c = d(), d(), d(), d()
    m, k, n = d(), d(), d()
    return [
        {"op": "matmul", "shapes": [[b, t, k], [k, n]], "dtype": dt()},                  # weights: 2-D b
        {"op": "matmul", "shapes": [[b, h, m, k], [b, h, k, n]], "dtype": dt()},         # batched heads
        {"op": "matmul", "shapes": [[b, 1, m, k], [h, k, n]], "dtype": dt()},            # broadcast leading dims
        {"op": "matmul", "shapes": [[m, k], [k, n]], "dtype": dt()},                     # plain 2-D
        {"op": "add", "shapes": [[b, t, c], [b, t, c]], "dtype": dt()},
        {"op": "add", "shapes": [[b, t, c], [c]], "dtype": dt()},                        # bias broadcast
        {"op": "mul", "shapes": [[b, 1, c], [b, t, 1]], "dtype": dt()},                  # both broadcast
        {"op": "relu", "shapes": [[b, t, c]], "dtype": dt()},
        {"op": "softmax", "shapes": [[b, h, t, t]], "dtype": dt()},
        {"op": "layer_norm", "shapes": [[b, t, c]], "dtype": dt()},
        {"op": "layer_norm", "shapes": [[t, c]], "dtype": dt()},
    ]


# ----------------------------------------------------------------------------- task 0.2: the roofline
def _made_up_gpu(r) -> dict:
    """A GPU that is no preset (so no table of presets, no number copied from one, can stand in for reading the
    dict): its own bandwidth and peaks, and tensor-core peaks for a random part of the half dtypes, with fp16 and
    bf16 peaks that differ."""
    bandwidth = r.uniform(0.2e12, 5e12)
    vector = bandwidth * r.uniform(8, 40)
    half = ["float16", "bfloat16", "float8_e4m3fn"]
    r.shuffle(half)
    tensor = {dt: vector * r.uniform(4, 30) for dt in half[:r.choice([1, 2])]}
    return {"name": f"Test GPU {r.randrange(100, 1000)}", "bandwidth": bandwidth, "vector_flops": vector,
            "tensor_flops": tensor, "source": "made up for this check"}


def _roof_case(r, gpu, op, dtype, where):
    """`where` places the intensity: 'below' the vector ridge, 'between' the two ridges, 'above' the
    tensor ridge (or the vector ridge when no tensor peak applies). `gpu` is a preset's name or a made-up spec."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    vec = g["vector_flops"] / g["bandwidth"]
    ten = max(g["tensor_flops"].values()) / g["bandwidth"]
    lo, hi = {"below": (0.1, 0.6 * vec), "between": (1.5 * vec, 0.6 * ten), "above": (1.6 * ten, 5 * ten)}[where]
    intensity = r.uniform(lo, hi)
    nbytes = r.randrange(10**6, 10**9)
    case = {"gpu": g["name"] if isinstance(gpu, dict) else gpu, "op": op, "dtype": dtype,
            "flops": int(nbytes * intensity), "nbytes": nbytes}
    return dict(case, spec=gpu) if isinstance(gpu, dict) else case


def _roof_cases(hidden, r):
    if not hidden:
        return [{"gpu": "A100", "op": "matmul", "dtype": "bfloat16", "flops": 2 * 4096**3, "nbytes": 3 * 2 * 4096**2},
                {"gpu": "A100", "op": "matmul", "dtype": "bfloat16", "flops": 2 * 64 * 4096 * 4096,
                 "nbytes": 2 * (64 * 4096 * 2 + 4096 * 4096)},
                {"gpu": "T4", "op": "softmax", "dtype": "float16", "flops": 5 * 2**24, "nbytes": 4 * 2**24}]
    custom = _made_up_gpu(r)
    with_tc, without_tc = next(iter(custom["tensor_flops"])), next(
        dt for dt in ("float16", "bfloat16", "float8_e4m3fn") if dt not in custom["tensor_flops"])
    return [
        _roof_case(r, "A100", "matmul", "bfloat16", "between"),      # memory-bound on tensor cores only
        _roof_case(r, "H100", "matmul", "float16", "above"),
        _roof_case(r, custom, "matmul", with_tc, r.choice(["between", "above"])),
        _roof_case(r, custom, "matmul", without_tc, "between"),      # no tensor peak for it: the vector peak
        _roof_case(r, "T4", "matmul", "float16", "between"),
        _roof_case(r, "T4", "matmul", "bfloat16", "between"),         # no BF16 tensor cores: the vector peak
        _roof_case(r, "H100", "matmul", "float8_e4m3fn", "between"),
        _roof_case(r, r.choice(list(GPUS)), "matmul", "float32", "between"),  # fp32: vector peak, compute-bound
        _roof_case(r, r.choice(list(GPUS)), r.choice(["add", "softmax", "layer_norm"]),
                   r.choice(["bfloat16", "float16"]), "below"),
        _roof_case(r, r.choice(["A100", "H100"]), "layer_norm", "bfloat16", "between"),  # not a matmul: vector
    ]


# ----------------------------------------------------------------------------- task 0.3: copy bandwidth
def _bw_cases(hidden, r):
    if not hidden:
        return [{"n_bytes": 8_000_003, "n_bytes_cuda": 256_000_003, "warmup": 2, "repeats": 7}]
    repeats = [r.choice([5, 7, 9, 11]), r.choice([6, 8, 10]), r.randint(5, 11)]    # an odd and an even count
    return [{"n_bytes": r.randrange(4_000_000, 12_000_000), "n_bytes_cuda": r.randrange(200_000_000, 400_000_000),
             "warmup": w, "repeats": k} for w, k in zip((1, 2, 3), repeats)]


# ----------------------------------------------------------------------------- task 0.4: new storage
# A case lists ops of OPS (inputs.py), each mapping a tensor to a tensor (or a tuple, or a list), applied in order.
CHAIN_OPS = ("t", "contiguous", "flatten", "mul_", "add", "rows", "cols", "expand", "clone", "to_self_dtype",
             "detach", "reshape_rows")


def _describe(case):
    ops = case["ops"]
    if case.get("inputs", 1) == 2:
        return f"fn(x, y) = {ops[0]}(x, y) with x, y of shape {tuple(case['shape'])} {case['dtype']}"
    return f"fn(x) = x -> {' -> '.join(ops)} with x of shape {tuple(case['shape'])} {case['dtype']}"


def _scase(r, ops, shape, dtype=None, inputs=1):
    return {"seed": r.randrange(2**31), "ops": ops, "shape": shape, "dtype": dtype or r.choice(
        ["float32", "float16", "bfloat16", "float64"]), "inputs": inputs}


def _chain(r, shape) -> list[str]:
    """3 to 5 ops drawn at random, each one kept only if it applies to what the previous ones made."""
    x, ops, want = torch.zeros(shape), [], r.randint(3, 5)
    while len(ops) < want:
        name = r.choice(CHAIN_OPS)
        try:
            y = OPS[name](x)
        except (RuntimeError, IndexError, ValueError):
            continue
        if y.numel() and y.dim():
            x, ops = y, ops + [name]
    return ops


def _storage_cases(hidden, r):
    if not hidden:
        return [_scase(r, ["t", "contiguous"], [5, 7], "float32"),
                _scase(r, ["flatten"], [3, 5, 7], "float32"),
                _scase(r, ["t", "flatten"], [5, 7], "float32"),
                _scase(r, ["rows"], [6, 7], "float16"),
                _scase(r, ["mul_"], [6, 7], "float32"),
                _scase(r, ["pair_list"], [6, 7], "float32", inputs=2)]

    def d():
        return r.randint(3, 31) | 1

    b, c, h, w = d(), d(), d(), d()
    cases = [
        _scase(r, ["t", "contiguous"], [b, c]),
        _scase(r, ["flatten"], [b, c, h]),                                 # reshape of contiguous: free
        _scase(r, ["t", "flatten"], [b, c]),                               # reshape of non-contiguous: a copy
        _scase(r, ["t", "reshape_rows"], [b, c, h]),
        _scase(r, ["mul_"], [b, c]),
        _scase(r, ["rows"], [b, c]),
        _scase(r, ["cols", "clone"], [b, c]),                              # copy of the slice only
        _scase(r, ["expand"], [b, c]),
        _scase(r, ["expand", "contiguous"], [b, c]),                       # 3x the input
        _scase(r, ["channels_last"], [2, c, h, w]),
        _scase(r, ["channels_last", "channels_last"], [2, c, h, w]),       # the second is free
        _scase(r, ["clone", "chunk2"], [2 * b, c]),                        # two views of one new storage
        _scase(r, ["t", "contiguous", "rows"], [b, c]),                    # a slice of a new storage
        _scase(r, ["t", "contiguous", "t", "contiguous"], [b, c]),         # a temporary freed inside fn
        _scase(r, ["to_self_dtype", "detach", "contiguous"], [b, c]),      # all free
        _scase(r, ["index"], [b, c]),
        _scase(r, ["half"], [b, c], "float32"),
        _scase(r, ["cat"], [b, c], inputs=2),
        _scase(r, ["add_"], [b, c], inputs=2),
        _scase(r, ["pair"], [b, c], inputs=2),
        _scase(r, ["pair_list"], [b, c], inputs=2),                       # a list result, in every run
        _scase(r, ["clone_split_list"], [2 * b, c]),                       # a list of views of one new storage
    ]
    for _ in range(2):                                                     # random chains
        cases.append(_scase(r, _chain(r, [b + 2, c, h]), [b + 2, c, h]))
    return cases
