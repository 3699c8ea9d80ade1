"""The zoo of training steps on which memlab's estimator is checked against the
tracker: MLPs and GPTs, several batch sizes and sequence lengths, fp32 and AMP
(CPU autocast to bf16), SGD, SGD+momentum and Adam. Used by tests/test_memlab.py
and benchmarks/bench_estimator.py."""

from __future__ import annotations

import torch

import memlab
from memlab.core import estimate as E

ZOO = [
    ("mlp", dict(batch=64, d_in=256, width=512, depth=4, d_out=10), "adam", "fp32"),
    ("mlp", dict(batch=2048, d_in=256, width=512, depth=4, d_out=10), "adam", "fp32"),
    ("mlp", dict(batch=1024, d_in=784, width=1024, depth=3, d_out=10, act="gelu"), "sgd", "fp32"),
    ("mlp", dict(batch=1024, d_in=256, width=512, depth=4, d_out=10), "momentum", "fp32"),
    ("mlp", dict(batch=512, d_in=256, width=512, depth=4, d_out=10), "adam", "amp"),
    ("mlp", dict(batch=4096, d_in=256, width=512, depth=4, d_out=10), "sgd", "amp"),
    ("gpt", dict(cfg=memlab.GPTConfig.tiny(), batch=8, seq=128), "adam", "fp32"),
    ("gpt", dict(cfg=memlab.GPTConfig.tiny(), batch=2, seq=32), "adam", "fp32"),
    ("gpt", dict(cfg=memlab.GPTConfig.tiny(n_layer=2, vocab_size=64), batch=16, seq=64), "sgd", "fp32"),
    ("gpt", dict(cfg=memlab.GPTConfig.tiny(n_embd=256, n_head=8), batch=4, seq=128), "momentum", "fp32"),
]


def label(entry) -> str:
    kind, kw, opt, prec = entry
    if kind == "mlp":
        act = " gelu" if kw.get("act") == "gelu" else ""
        shape = f"MLP {kw['d_in']}-{kw['width']}x{kw['depth']}-{kw['d_out']}{act}, B={kw['batch']}"
    else:
        c = kw["cfg"]
        shape = f"GPT L={c.n_layer} C={c.n_embd} V={c.vocab_size}, B={kw['batch']} T={kw['seq']}"
    return f"{shape}, {opt}, {prec}"


def optimizer(name, params):
    if name == "adam":
        return torch.optim.Adam(params, foreach=False)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9 if name == "momentum" else 0, foreach=False)


def build(entry, seed=0):
    """(model, make_batch, estimate) for a zoo entry; first_step is chosen by the caller."""
    kind, kw, opt_name, precision = entry
    torch.manual_seed(seed)
    if kind == "mlp":
        k = dict(kw)
        B = k.pop("batch")
        model = memlab.MLP(k["d_in"], k["width"], k["depth"], k["d_out"], act=k.get("act", "relu"))
        make = lambda: (torch.randn(B, k["d_in"]), torch.randint(0, k["d_out"], (B,)))  # noqa: E731
        est = lambda first: E.mlp_peak_bytes(**kw, optimizer=opt_name, precision=precision, first_step=first)  # noqa: E731
    else:
        cfg, B, T = kw["cfg"], kw["batch"], kw["seq"]
        model = memlab.GPT(cfg)
        make = lambda: (torch.randint(0, cfg.vocab_size, (B, T)), torch.randint(0, cfg.vocab_size, (B, T)))  # noqa: E731
        est = lambda first: E.gpt_peak_bytes(cfg, B, T, optimizer=opt_name, first_step=first)  # noqa: E731
    return model, make, est


def measure(entry, first_step: bool):
    """(measured peak bytes from the tracker, memlab.core.estimate's Estimate, the model)."""
    model, make, est = build(entry)
    opt = optimizer(entry[2], model.parameters())
    amp = torch.bfloat16 if entry[3] == "amp" else None
    if not first_step:
        memlab.train_step(model, opt, *make(), autocast_dtype=amp)
    tracker = memlab.MemoryTracker(model, opt)
    with tracker:
        x, y = make()
        memlab.train_step(model, opt, x, y, autocast_dtype=amp)
        del x, y
    return tracker.peak, est(first_step), model
