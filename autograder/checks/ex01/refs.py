"""Exercise 01's references: memlab's tracker on a twin model (1.2, 1.4) and on a real training step (1.5),
and the per-op saving rules of autograd (1.3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import memlab
from memlab.core.estimate import mlp_activation_bytes

from .cases import PHASES
from .inputs import _breakdown_setup

# ----------------------------------------------------------------------------- task1_2
def reference_phase_peaks(model, optimizer, x, y) -> dict[str, int]:
    """The peak of bytes allocated by the step in each phase (memlab's tracker,
    no model/optimizer watched: only storages the step creates count)."""
    tracker = memlab.MemoryTracker(device=x.device)
    with tracker:
        with memlab.phase("forward"):
            loss = F.cross_entropy(model(x), y)
        with memlab.phase("backward"):
            loss.backward()
        with memlab.phase("step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del loss
    return {p: tracker.phase_peaks[p]["total"] for p in PHASES}


# ----------------------------------------------------------------------------- task1_3
def reference_saved_per_layer(mlp: memlab.MLP, batch: int, itemsize: int = 4) -> dict[str, int]:
    """Bytes each leaf module of memlab.MLP saves for backward, a storage
    attributed to the first module that saves it, parameters excluded.

    Linear saves its input (only if its weight needs a gradient); ReLU and tanh
    save their output; GELU saves its input. So layers.0 owns the input batch,
    ReLU/tanh own their outputs (the next Linear saves them again), and with
    GELU both GELU (its input) and the next Linear (GELU's output) own one."""
    out = {}
    mods = list(mlp.layers)
    for i, m in enumerate(mods):
        name = f"layers.{i}"
        if isinstance(m, torch.nn.Linear):
            if i == 0:
                out[name] = batch * m.in_features * itemsize
            else:
                prev = mods[i - 1]
                out[name] = batch * m.in_features * itemsize if isinstance(prev, torch.nn.GELU) else 0
        else:
            out[name] = batch * mlp.width * itemsize
    return out


# ----------------------------------------------------------------------------- task1_4
def reference_breakdown(case) -> dict[str, int]:
    """memlab's tracker, watching the model and optimizer, read after backward and after the step."""
    model, opt, x, y = _breakdown_setup(case)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    tracker = memlab.MemoryTracker(model, opt)
    with tracker:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = tracker.breakdown()["gradients"]
        opt.step()
        state = tracker.breakdown()["optimizer"]
        opt.zero_grad(set_to_none=True)
    d_in, width, depth, d_out = case["dims"]
    return {"parameters": params, "gradients": grads, "optimizer": state,
            "activations": mlp_activation_bytes(case["B"], d_in, width, depth, d_out, act=case["act"])}


# ----------------------------------------------------------------------------- task1_5
def measure_mlp_peak(batch, d_in, width, depth, d_out, optimizer, first_step, seed=0) -> int:
    """Peak bytes of one memlab.train_step of memlab.MLP (ReLU, cross-entropy,
    torch.optim with foreach=False), counting the input batch made for it."""
    return measure_mlp_step(batch, d_in, width, depth, d_out, optimizer, first_step, seed)[0]


def measure_mlp_step(batch, d_in, width, depth, d_out, optimizer, first_step, seed=0) -> tuple[int, str]:
    """(peak bytes, the phase of memlab.train_step the peak falls in: "forward", "backward" or "step") of the step
    `measure_mlp_peak` measures."""
    torch.manual_seed(seed)
    model = memlab.MLP(d_in, width, depth, d_out)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False) if optimizer == "adam" else \
        torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)

    def batch_():
        return torch.randn(batch, d_in), torch.randint(0, d_out, (batch,))

    if not first_step:
        memlab.train_step(model, opt, *batch_())
    tracker = memlab.MemoryTracker(model, opt)
    with tracker:
        x, y = batch_()
        memlab.train_step(model, opt, x, y)
        del x, y
    return tracker.peak, tracker.peak_phase
