"""Which device are we on, and what can it do?

`pick_device()` prefers cuda > mps > cpu. `describe()` returns a `DeviceInfo`
that every notebook prints in its setup cell, so a learner (and whoever reads
their output) knows which numbers are live and which are a fallback.

Importing this module touches no GPU: CUDA is queried only when a function is
called. It also keeps libraries' start-up chatter out of learners' outputs and the course's website
(`quiet_library_noise`, run once at import), without importing them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import sys
import warnings
from dataclasses import dataclass

import torch

__all__ = ["DeviceInfo", "pick_device", "describe", "on_colab", "quiet_library_noise"]

# Messages that libraries print on import or first use and that say nothing to a learner, by the logger that
# emits them. Only these exact messages are dropped: every other warning of these libraries still shows.
NOISE = {
    # deepspeed/accelerator/real_accelerator.py, get_accelerator(): on any machine without CUDA
    "DeepSpeed": ("Setting accelerator to CPU",),
    # bitsandbytes/cextension.py (releases before 0.46 log it on import on a machine without CUDA)
    "bitsandbytes.cextension": ("compiled without GPU support",),
    # bitsandbytes/backends/cpu/ops.py, on import on a CPU with AVX512-BF16: optional kernels from the Hugging Face
    # Hub that the course does not use ("Please make sure you already `pip install kernels`")
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}
# Python warnings of the same kind, by message: one library calling another's deprecated name (peft's PeftModel
# reads transformers' `is_gradient_checkpointing`), nothing a learner's code did or can change.
NOISY_WARNINGS = ((r"The installed version of bitsandbytes was compiled without GPU", UserWarning),
                  (r"`is_gradient_checkpointing` is deprecated", FutureWarning))


class _DropMessages(logging.Filter):
    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.needles)


def quiet_library_noise() -> None:
    """Drop the messages listed in `NOISE` and `NOISY_WARNINGS` (idempotent). It attaches filters to those
    libraries' loggers, which `logging.getLogger` creates ahead of the libraries (they keep the filter when they
    configure the logger), so nothing is imported. PyTorch's profiler (kineto) writes a line with the date, the
    process id and a C++ file name to stderr each time a profile starts and stops; KINETO_LOG_LEVEL=6 (read when
    the first profile starts, so setting it after importing torch works) keeps it quiet unless the user set it."""
    for name, needles in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(needles))
    for message, category in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


quiet_library_noise()


def on_colab() -> bool:
    """True inside Google Colab (the `google.colab` module is importable there)."""
    if "google.colab" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("google.colab") is not None
    except ModuleNotFoundError:  # no `google` package at all
        return False


def pick_device(prefer: str | None = None) -> torch.device:
    """Return the best available device: cuda > mps > cpu.

    `prefer` forces one of "cuda", "mps", "cpu" (raises if it is not available).
    The environment variable MEMLAB_DEVICE does the same for a whole session,
    so a learner with a GPU can still run a notebook the CPU way.
    """
    prefer = prefer or os.environ.get("MEMLAB_DEVICE") or None
    if prefer is not None:
        if prefer not in ("cuda", "mps", "cpu"):
            raise ValueError(f"prefer must be one of 'cuda', 'mps', 'cpu' (or None), got {prefer!r}")
        if prefer == "cuda" and not torch.cuda.is_available():
            raise ValueError("prefer='cuda' but torch.cuda.is_available() is False on this machine")
        if prefer == "mps" and not torch.backends.mps.is_available():
            raise ValueError("prefer='mps' but torch.backends.mps.is_available() is False on this machine")
        return torch.device(prefer)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@dataclass(frozen=True)
class DeviceInfo:
    type: str                      # "cuda", "mps" or "cpu"
    name: str                      # marketing name of the GPU, or the CPU's
    total_bytes: int | None        # device memory (CUDA: from the driver; CPU/MPS: None)
    bf16: bool                     # bf16 tensors supported (on CUDA: natively, sm_80+)
    compute_capability: tuple[int, int] | None  # CUDA (major, minor), else None
    flash_attn_eligible: bool      # FlashAttention-2 kernels need CUDA sm_80+ (Ampere or newer)
    flash_attn_installed: bool     # the optional `flash_attn` package is importable
    colab: bool                    # running inside Google Colab
    torch_version: str

    def summary(self) -> str:
        gib = f"{self.total_bytes / 2**30:.1f} GiB" if self.total_bytes else "n/a (host RAM)"
        cc = f"sm_{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else "n/a"
        lines = [
            f"device        : {self.type} ({self.name})",
            f"memory        : {gib}",
            f"compute cap.  : {cc}",
            f"bf16          : {'yes' if self.bf16 else 'no'}",
            f"flash-attn    : {'eligible' if self.flash_attn_eligible else 'not eligible'}"
            f"{' and installed' if self.flash_attn_installed else ', package not installed'}",
            f"Colab         : {'yes' if self.colab else 'no'}",
            f"torch         : {self.torch_version}",
        ]
        if self.type != "cuda":
            lines.append("note          : no CUDA here: memory is measured exactly by memlab's tracker; "
                         "GPU-only cells use the virtual GPU or labelled recorded numbers")
        return "\n".join(lines)

    def __str__(self) -> str:  # print(describe()) shows the summary
        return self.summary()


def describe(device: torch.device | str | None = None) -> DeviceInfo:
    """Describe `device` (default: `pick_device()`)."""
    if device is None:
        device = pick_device()
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    device = torch.device(device)
    flash_installed = importlib.util.find_spec("flash_attn") is not None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device is 'cuda' but CUDA is not available on this machine")
        idx = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        cc = (props.major, props.minor)
        try:    # native bf16 only: a T4 (sm_75) "supports" bf16 by emulation, without tensor cores
            bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:
            bf16 = cc >= (8, 0)
        return DeviceInfo("cuda", props.name, int(props.total_memory), bf16,
                          cc, cc >= (8, 0), flash_installed, on_colab(), torch.__version__)
    if device.type == "mps":
        return DeviceInfo("mps", "Apple GPU (MPS)", None, True, None, False, flash_installed, on_colab(),
                          torch.__version__)
    if device.type == "cpu":
        name = platform.processor() or platform.machine() or "CPU"
        return DeviceInfo("cpu", f"{name}, {os.cpu_count()} logical cores", None, True, None, False,
                          flash_installed, on_colab(), torch.__version__)
    raise ValueError(f"device type must be 'cuda', 'mps' or 'cpu', got {device.type!r}")
