"""Exercise 03's inputs, the learner side rebuilt on both sides from a case's plain data: run.py uses them in the
sandbox, the trusted refs.py in the grader. The model, optimizer, GradScaler and micro-batches of task3_2 and
the training step of task3_3 (task3_1's plans are built with memlab.kit.ex03.make_plan and driven by its
drive_scaler)."""

from __future__ import annotations

import torch

import memlab

DTYPES = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# ----------------------------------------------------------------------------- task3_2
def amp_setup(case):
    """(model, optimizer, GradScaler, [[(x, y) per micro-batch] per step]) of a case."""
    torch.manual_seed(case["seed"])
    g = torch.Generator().manual_seed(case["seed"])
    n, b = case["micro"], case["batch"]
    if case["kind"] == "gpt":
        model = memlab.GPT(memlab.GPTConfig.tiny(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16))
        batches = [[(torch.randint(0, 64, (b, 16), generator=g), torch.randint(0, 64, (b, 16), generator=g))
                    for _ in range(n)] for _ in range(case["steps"])]
    else:
        model = memlab.MLP(24, 48, 2, 6)
        batches = [[(torch.randn(b, 24, generator=g), torch.randint(0, 6, (b,), generator=g)) for _ in range(n)]
                   for _ in range(case["steps"])]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=case["init_scale"], growth_interval=2,
                                  enabled=case["dtype"] == "float16")
    return model, opt, scaler, batches


# ----------------------------------------------------------------------------- task3_3
def build_report_case(case):
    torch.manual_seed(case["seed"])
    g = torch.Generator().manual_seed(case["seed"])
    mdt = DTYPES[case["model_dtype"]]
    if case["kind"] == "gpt":
        model = memlab.GPT(memlab.GPTConfig.tiny(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16))
        x = torch.randint(0, 64, (case["batch"], 16), generator=g)
        y = torch.randint(0, 64, (case["batch"], 16), generator=g)
    else:
        model = memlab.MLP(*case["dims"])
        x = torch.randn(case["batch"], case["dims"][0], generator=g).to(mdt)
        y = torch.randint(0, case["dims"][3], (case["batch"],), generator=g)
    model = model.to(mdt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if case["optimizer"] == "adam" else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, x, y
