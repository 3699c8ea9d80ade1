"""An interactive memory calculator (ipywidgets): pick a model size, a
precision and an optimizer, and see model-state bytes against each GPU preset.

The numbers come from `memlab.estimate.model_state_bytes` (weights, gradients,
optimizer state), plus the optimizer-step scratch of a foreach (CUDA-default)
Adam step; activations depend on the model's shape, so they are left to the
lessons that measure them.
"""

from __future__ import annotations

from .estimate import model_state_bytes
from .track import format_bytes
from .virtual_gpu import PRESETS

__all__ = ["memory_calculator", "calculator_rows"]


def calculator_rows(billions: float, precision: str, optimizer: str, foreach_step: bool = True) -> list[str]:
    """The calculator's output as text lines (also used without widgets)."""
    if isinstance(billions, bool) or not isinstance(billions, (int, float)) or billions <= 0:
        raise ValueError(f"billions must be a positive number of parameters in billions, got {billions!r}")
    n = int(billions * 1e9)
    st = model_state_bytes(n, precision, optimizer)
    scratch = 4 * n if (foreach_step and optimizer == "adam" and precision != "bf16") else 0
    total = sum(st.values()) + scratch
    rows = [f"{k:<11} {format_bytes(v):>12}  ({v / n:.0f} B/param)" for k, v in st.items()]
    states = sum(st.values())
    rows.append(f"{'states':<11} {format_bytes(states):>12}  ({states / n:.0f} B/param): weights + grads + optimizer")
    if scratch:
        rows.append(f"{'step temp':<11} {format_bytes(scratch):>12}  (4 B/param: foreach Adam's sqrt buffer)")
    rows.append(f"{'total':<11} {format_bytes(total):>12}  ({total / n:.0f} B/param), before activations")
    for name, spec in PRESETS.items():
        verdict = "fits" if total <= spec.capacity else "does NOT fit"
        rows.append(f"  {name:<13} {format_bytes(spec.capacity):>10}: {verdict}")
    return rows


def memory_calculator():
    """Show the calculator in a notebook (needs ipywidgets)."""
    import ipywidgets as W
    from IPython.display import display

    size = W.FloatLogSlider(value=7, base=10, min=-1, max=2.5, step=0.05, description="params (B)")
    prec = W.Dropdown(options=["fp32", "amp", "bf16"], value="fp32", description="precision")
    opt = W.Dropdown(options=["adam", "momentum", "sgd"], value="adam", description="optimizer")
    out = W.Output()

    def update(*_):
        out.clear_output()
        with out:
            print("\n".join(calculator_rows(size.value, prec.value, opt.value)))

    for w in (size, prec, opt):
        w.observe(update, names="value")
    update()
    display(W.VBox([W.HBox([size, prec, opt]), out]))
