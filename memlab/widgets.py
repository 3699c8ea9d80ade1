"""An interactive memory calculator (ipywidgets): pick a model size, a
training layout and an optimizer, and see model-state bytes against each GPU
preset's real capacity.

The numbers come from `memlab.core.estimate.model_state_bytes` (weights, gradients,
optimizer state in a layout of `memlab.core.estimate.LAYOUTS`), plus, optionally,
the scratch of a foreach (CUDA-default) Adam step, a transient of step() that
fused=True does not have. Activations depend on the model's shape, so they are
left to the lessons that measure them.
"""

from __future__ import annotations

from .core.gpus import HEADROOM, usable_bytes
from .core.estimate import LAYOUTS, model_state_bytes, optimizer_step_temp_bytes
from .core.track import format_bytes
from .core.validate import is_number
from .core.virtual_gpu import PRESETS

__all__ = ["memory_calculator", "calculator_rows"]


def calculator_rows(billions: float, precision: str, optimizer: str, foreach_step: bool = True) -> list[str]:
    """The calculator's table as text lines, with a title line that says what it shows."""
    if not is_number(billions) or not 0 < billions < 1e6:
        raise ValueError(f"billions must be a positive number of parameters in billions, got {billions!r}")
    n = round(billions * 1e9)
    st = model_state_bytes(n, precision, optimizer)          # checks precision and optimizer
    # the optimizer updates fp32 values (the weights or the master copy) except in pure bf16
    scratch = optimizer_step_temp_bytes([n], optimizer, foreach=True,
                                        bytes_per_element=2 if precision == "bf16" else 4) if foreach_step else 0
    states = sum(st.values())
    total = states + scratch
    rows = [f"Model states of a {n / 1e9:,.2f}B-parameter model, layout '{precision}' "
            f"({LAYOUTS[precision].what}), optimizer {optimizer}:"]
    rows += [f"  {k:<12} {format_bytes(v):>12}  ({v / n:.0f} B/param)" for k, v in st.items()]
    rows.append(f"  {'states':<12} {format_bytes(states):>12}  ({states / n:.0f} B/param): weights + grads + optimizer")
    if scratch:
        rows.append(f"  {'step scratch':<12} {format_bytes(scratch):>12}  ({scratch / n:.0f} B/param: foreach Adam's "
                    f"sqrt buffer, only during step(); 0 with fused=True)")
    rows.append(f"  {'total':<12} {format_bytes(total):>12}  ({total / n:.0f} B/param), before activations")
    rows.append(f"Does that fit? (usable = the capacity the card reports less {HEADROOM:.0%} for the CUDA context, "
                "workspaces and fragmentation; activations come on top)")
    for name, spec in PRESETS.items():
        verdict = "fits" if total <= usable_bytes(spec.capacity) else "does NOT fit"
        rows.append(f"  {name:<13} {format_bytes(usable_bytes(spec.capacity)):>10} usable: {verdict}")
    return rows


def memory_calculator(billions: float = 7.0, precision: str = "fp32", optimizer: str = "adamw"):
    """Show the calculator in a notebook: one labelled table that follows the controls (needs ipywidgets;
    without it, the table for the given arguments is printed)."""
    calculator_rows(billions, precision, optimizer)          # check the arguments first
    try:
        import ipywidgets as W
        from IPython.display import display
    except ImportError:
        print("\n".join(calculator_rows(billions, precision, optimizer)))
        return None

    size = W.BoundedFloatText(value=billions, min=0.01, max=2000, step=0.5, description="params (B)")
    prec = W.Dropdown(options=list(LAYOUTS), value=precision, description="layout")
    opt = W.Dropdown(options=["adamw", "adam", "momentum", "sgd"], value=optimizer, description="optimizer")
    step = W.Checkbox(value=True, description="foreach step scratch (CUDA default)")
    out = W.Output()

    def update(*_):
        out.clear_output()
        with out:
            print("\n".join(calculator_rows(size.value, prec.value, opt.value, step.value)))

    for w in (size, prec, opt, step):
        w.observe(update, names="value")
    update()
    display(W.VBox([W.HBox([size, prec, opt]), step, out]))
