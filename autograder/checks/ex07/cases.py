"""Exercise 07's cases (trusted side): what each task's inputs are drawn from, and the Llama configs of task 7.4;
the seeded tensors, absmax values and Linear layers both sides rebuild from a case are in inputs.py."""

from __future__ import annotations

import threading

from memlab.kit.ex07 import LLAMA_7B, LLAMA_13B

# re-exported: moved to inputs.py, the tests still read them as cases.<name>
from .inputs import DQ_BLOCK, absmax_input  # noqa: F401

# The grader judges several learners at once in threads: peft's dropout draws from torch's global RNG and
# transformers patches torch.nn.init while it builds a model, so the judges that use them hold this lock.
GLOBAL_STATE = threading.RLock()

TINY = {"hidden": 40, "intermediate": 88, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 97}


# ----------------------------------------------------------------------------- task 7.1: NF4 quantize/dequantize
def _nf4_case(r, kind, bs=64, dtype="float32", shape=None):
    if shape is None:
        n = bs * r.randint(2, 9) + r.randint(1, bs - 1)
        rows = r.choice([d for d in (3, 5, 7, 9, 11) if n % d == 0] or [1])
        shape = [rows, n // rows] if rows > 1 else [n]
    return {"seed": r.randrange(2**31), "shape": shape, "blocksize": bs, "dtype": dtype, "kind": kind}


def nf4_cases(hidden, r):
    if not hidden:
        return [{"seed": 0, "shape": [10, 13], "blocksize": 64, "dtype": "float32", "kind": "normal"},
                {"seed": 1, "shape": [5, 15], "blocksize": 64, "dtype": "float32", "kind": "ties"}]
    odd = 2 * r.randint(20, 300) + 1
    return [_nf4_case(r, "normal"), _nf4_case(r, "scales"), _nf4_case(r, "zeros"), _nf4_case(r, "ties"),
            _nf4_case(r, "normal", bs=32), _nf4_case(r, "scales", bs=128), _nf4_case(r, "normal", dtype="bfloat16"),
            _nf4_case(r, "normal", shape=[odd]),                                     # an odd length
            _nf4_case(r, "normal", shape=[r.randint(3, 40)]),                        # shorter than one block
            _nf4_case(r, "normal", shape=[r.randint(2, 5), 64])]                     # whole blocks only


# ----------------------------------------------------------------------------- task 7.2: double quantization
def _bpp_cases(hidden, r):
    if not hidden:
        return [{"n": 4096 * 4096, "blocksize": 64, "double_quant": True}]
    return [{"n": 4096 * 11008, "blocksize": 64, "double_quant": True},
            {"n": r.randint(10_000, 200_000), "blocksize": 64, "double_quant": True},
            {"n": r.randint(10_000, 200_000), "blocksize": 64, "double_quant": False},
            {"n": 2 * r.randint(50, 5000) + 1, "blocksize": r.choice([32, 128]), "double_quant": True},
            {"n": r.randint(3, 63), "blocksize": 64, "double_quant": True},
            {"n": r.randint(1000, 100_000), "blocksize": r.choice([32, 128, 256]), "double_quant": False}]


def _dq_cases(hidden, r):
    if not hidden:
        return {"dq": [{"seed": 0, "blocks": 600, "spread": False}], "bpp": _bpp_cases(False, r)}
    def dq(blocks, spread, skew):
        return {"seed": r.randrange(2**31), "blocks": blocks, "spread": spread, "skew": skew}
    return {"dq": [dq(256 * r.randint(1, 4) + r.randint(1, 255), False, "right"),
                   dq(256 * r.randint(1, 4) + r.randint(1, 255), True, "right"),
                   dq(r.randint(2, 200), True, "right"),                                     # one partial block
                   dq(512, False, "right"),                                                  # whole blocks only
                   dq(256 * r.randint(1, 4) + r.randint(1, 255), r.random() < 0.5, "left"),  # max|y| below the mean
                   dq(r.randint(20, 200), False, "left"),
                   dq(256 * r.randint(1, 4) + r.randint(1, 255), False, "symmetric")],
            "bpp": _bpp_cases(True, r)}


def dq_cases_list(hidden, r):
    c = _dq_cases(hidden, r)
    return [{"what": "dq", **d} for d in c["dq"]] + [{"what": "bpp", **b} for b in c["bpp"]]


# ----------------------------------------------------------------------------- task 7.3: LoRA linear
def lora_cases(hidden, r):
    if not hidden:
        return [{"seed": 0, "d_in": 12, "d_out": 10, "r": 4, "alpha": 8.0, "dropout": 0.0, "bias": True,
                 "lead": [2, 3]},
                {"seed": 1, "d_in": 9, "d_out": 7, "r": 2, "alpha": 16.0, "dropout": 0.25, "bias": False, "lead": [5]}]
    cases = []
    for dropout, bias, wide in ((0.0, True, False), (0.0, False, False), (r.choice([0.1, 0.3, 0.5]), True, False),
                                (0.2, False, False), (r.choice([0.0, 0.1]), r.random() < 0.5, True)):
        rank = r.randint(1, 6)
        alpha = float(r.choice([a for a in (1, 2, 3, 8, 16, 32) if a != rank]))
        cases.append({"seed": r.randrange(2**31), "d_in": r.randint(2048, 4096) if wide else r.randint(5, 40),
                      "d_out": r.randint(3, 8) if wide else r.randint(3, 40), "r": rank, "alpha": alpha,
                      "dropout": dropout, "bias": bias,
                      "lead": r.choice([[r.randint(1, 6)], [2, r.randint(2, 5)]])})
    return cases       # the wide case: A's initial scale (its bound 1/sqrt(d_in)) is measured on many entries, and
                       # float32 sums over thousands of inputs test the tolerances (few outputs: a small result)


# ----------------------------------------------------------------------------- task 7.4: QLoRA memory
def _qlora_case(cfg, r, batch, seq, checkpointing, virtual):
    return {"cfg": cfg, "r": r, "batch": batch, "seq": seq, "checkpointing": checkpointing, "virtual": virtual}


_FULL_SIZE: list = []      # the hidden full-size cases of this grader process: drawn once, shared by a class run


def qlora_cases(hidden, r):
    """Tiny configs are measured on the CPU (states and activations), with and without checkpointing, fresh
    for every learner. Full-size ones run on the virtual GPU: one 7B- and one 13B-shaped case, one of them
    checkpointed, drawn once per grader process so that a class run measures them once (the judge caches
    every measurement by its case)."""
    if not hidden:
        return [_qlora_case(TINY, 3, 2, 9, False, False), _qlora_case(TINY, 3, 2, 9, True, False)]
    heads = r.choice([2, 3, 4, 6])
    C = heads * 2 * r.randint(3, 7)                                  # head size even (RoPE), C no power of two
    # grouped-query attention (H_kv < H) in every tiny case: the full-size configs below have H_kv == H
    tiny = {"hidden": C, "intermediate": r.randint(2 * C, 3 * C) | 1, "layers": r.randint(1, 3), "heads": heads,
            "kv_heads": r.choice([k for k in (1, 2, 3) if heads % k == 0 and k < heads]), "vocab": r.randint(300, 700)}
    rank = r.randint(1, 5)                                           # one rank: one model-state measurement
    with GLOBAL_STATE:
        if not _FULL_SIZE:
            ckpt_7b = r.random() < 0.5
            _FULL_SIZE.extend([
                _qlora_case(LLAMA_7B, r.choice([8, 16, 64]), r.randint(1, 3), r.choice([512, 1000, 2048]), ckpt_7b,
                            True),
                _qlora_case(LLAMA_13B, r.randint(2, 40), r.randint(1, 3), r.randint(100, 999), not ckpt_7b, True)])
        full = [dict(c) for c in _FULL_SIZE]
    # batch * seq >= 8: every term of the text (the smallest: the logsumexp, 4 H bytes per token and layer, and the
    # RoPE tables, 4 seq d bytes) is larger than the tiny cases' tolerance (judge.TINY_TOL) plus its slack
    return [_qlora_case(tiny, rank, r.randint(1, 3), r.randint(8, 20), True, False),
            _qlora_case(tiny, rank, r.randint(1, 3), r.randint(8, 20), False, False), *full]
