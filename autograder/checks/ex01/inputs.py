"""Exercise 01's inputs, the learner side rebuilt on both sides from a case's plain data (its seed and sizes):
run.py uses them in the sandbox, the trusted refs.py and judge.py in the grader. The models, optimizers and
batches, and the parameter fingerprint that shows two training runs agree."""

from __future__ import annotations

import torch

import memlab

DTYPES = {"float32": torch.float32, "float16": torch.float16, "float64": torch.float64, "int64": torch.int64,
          "int8": torch.int8}


# ----------------------------------------------------------------------------- what both sides rebuild from a case
def _fingerprint(tensors) -> list:
    """Per tensor: [sum, sum of |x|, sum of x * w] in float64, w a fixed random vector."""
    out = []
    for i, t in enumerate(tensors):
        t = t.detach().double().flatten()
        w = torch.randn(t.numel(), generator=torch.Generator().manual_seed(1000 + i), dtype=torch.float64)
        out.append([float(t.sum()), float(t.abs().sum()), float((t * w).sum())])
    return out


class _Flat(torch.nn.Module):
    """A GPT whose model(x) returns logits flattened for cross_entropy."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, idx):
        return self.m(idx).flatten(0, 1)


def _make_opt(name, model):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    if name == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _phase_setup(case):
    """(model, optimizer, x, y, description) rebuilt from the case, the same on both sides."""
    torch.manual_seed(case["seed"])
    g = torch.Generator().manual_seed(case["seed"])
    if case["kind"] == "gpt":
        n_layer, n_embd, vocab, B, T = case["dims"]
        cfg = memlab.GPTConfig.tiny(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab, block_size=64)
        model = _Flat(memlab.GPT(cfg))
        x = torch.randint(0, vocab, (B, T), generator=g)
        y = torch.randint(0, vocab, (B, T), generator=g).flatten()
        desc = f"GPT(n_layer={n_layer}, n_embd={n_embd}), batch {B}x{T}"
    else:
        dims, B = case["dims"], case["B"]
        model = memlab.MLP(*dims)
        x = torch.randn(B, dims[0], generator=g)
        y = torch.randint(0, dims[3], (B,), generator=g)
        desc = f"MLP{tuple(dims)}, batch {B}"
    return model, _make_opt(case["opt"], model), x, y, f"{desc}, {case['opt']}"


def _saved_setup(case):
    torch.manual_seed(case["seed"])
    model = memlab.MLP(*case["dims"], act=case["act"])
    x = torch.randn(case["B"], case["dims"][0], generator=torch.Generator().manual_seed(case["seed"]))
    return model, x


def _breakdown_setup(case):
    torch.manual_seed(case["seed"])
    model = memlab.MLP(*case["dims"], act=case["act"])
    opt = _make_opt(case["opt"], model)
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["B"], case["dims"][0], generator=g)
    y = torch.randint(0, case["dims"][3], (case["B"],), generator=g)
    return model, opt, x, y
