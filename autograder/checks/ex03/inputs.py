"""Exercise 03's inputs, the learner side rebuilt on both sides from a case's plain data: run.py uses them in the
sandbox, the trusted refs.py in the grader. The model, optimizer, GradScaler and micro-batches of task3_2 and
the training step of task3_3 (task3_1's plans are built with memlab.kit.ex03.make_plan and driven by its
drive_scaler)."""

from __future__ import annotations

import torch

import memlab

DTYPES = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MLP_DIMS = (24, 48, 2, 6)         # task3_2's MLP (d_in, width, depth, d_out) unless a case gives its own "dims"


# ----------------------------------------------------------------------------- task3_2 as if on CUDA
CUDA = torch.device("cuda", 0)


class OnCudaTensor(torch.Tensor):
    """A CPU tensor that reports the device cuda:0: what a step reads to choose autocast's device type. Its ops run
    as a plain tensor's (on the CPU) and return plain tensors."""
    __torch_function__ = torch._C._disabled_torch_function_impl
    device = property(lambda self: CUDA)
    is_cuda = property(lambda self: True)


class OnCudaParameter(torch.nn.Parameter):
    """A parameter that reports the device cuda:0 (see OnCudaTensor)."""
    device = property(lambda self: CUDA)
    is_cuda = property(lambda self: True)


def _report_cuda(model: torch.nn.Module, batches):
    """The model's parameters (tied ones stay tied) and the batches, reporting the device cuda."""
    new = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = new.setdefault(id(p), OnCudaParameter(p.detach(), p.requires_grad))
    return [[(x.as_subclass(OnCudaTensor), y.as_subclass(OnCudaTensor)) for x, y in micro] for micro in batches]


# ----------------------------------------------------------------------------- task3_2
def amp_setup(case, on_cuda: bool = False):
    """(model, optimizer, GradScaler, [[(x, y) per micro-batch] per step]) of a case. on_cuda: the model's
    parameters and the batches report the device cuda (their arithmetic stays on the CPU)."""
    torch.manual_seed(case["seed"])
    g = torch.Generator().manual_seed(case["seed"])
    n, b = case["micro"], case["batch"]
    if case["kind"] == "gpt":
        model = memlab.GPT(memlab.GPTConfig.tiny(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16))
        batches = [[(torch.randint(0, 64, (b, 16), generator=g), torch.randint(0, 64, (b, 16), generator=g))
                    for _ in range(n)] for _ in range(case["steps"])]
    else:
        d_in, width, depth, d_out = case.get("dims", MLP_DIMS)
        model = memlab.MLP(d_in, width, depth, d_out)
        batches = [[(torch.randn(b, d_in, generator=g), torch.randint(0, d_out, (b,), generator=g))
                    for _ in range(n)] for _ in range(case["steps"])]
    if on_cuda:
        batches = _report_cuda(model, batches)
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
