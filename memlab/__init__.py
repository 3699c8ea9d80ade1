"""memlab: the GPU Memory Lab measuring kit, grouped by technique (the folders read like the syllabus):

    core/         device, tracker, virtual GPU, estimators, models, GPU data sheets   (every lesson)
    hardware/     memory hierarchy, timing, numbers recorded on a real GPU           (lesson 00)
    profiling     torch.profiler's memory timeline, read into named categories       (lesson 01)
    checkpointing activation checkpointing                                            (lesson 02)
    clinic        the OOM clinic's patients                                           (lesson 04)
    attention     naive, tiled and library attention, the KV cache                    (lesson 05)
    attention_io  the HBM bytes attention moves: IO complexity, counted                (lesson 05)
    sharding/     ranks, collectives, ZeRO, DeepSpeed and FSDP2                       (lesson 06)
    quant/        NF4, double quantization, QLoRA, 8-bit optimizers                   (lesson 07)
    fitting/      will it fit: memlab.fit, memlab.fit_max, memlab.fit_search, memlab-fit (lesson 08)
    parallel/     tensor, sequence, pipeline and context parallelism                  (lesson 09)
    planning/     lifetimes, static memory planning, layout, memory-aware design      (lesson 10)
    kit/          what the graded exercises' notebooks call (no grading code)
    plot, widgets figures and the calculator

Importing memlab allocates nothing and touches no GPU.
"""
import importlib as _importlib
import sys as _sys

from .core.device import DeviceInfo, describe, on_colab, pick_device
from .core.track import CATEGORIES, MemoryTracker, format_bytes, phase, watch
from .core.virtual_gpu import PRESETS, VirtualGPU, VirtualRun
from .core.models import MLP, GPT, GPTConfig, train_step
from .attention import naive_attention, attention_bytes, kv_cache_bytes, sdpa_backend, flash_attn_status
from .core.gpus import HEADROOM, usable_bytes
from .hardware.hierarchy import GPU_SPECS, GPUDataSheet, MeasuredRoof, roofline
from .hardware.timing import copy_bandwidth, time_fn
from . import attention, checkpointing, clinic, parallel, planning, plot, quant, sharding, widgets  # noqa: E402
# will it fit: transformers and peft load inside the functions; memlab.fit and memlab.fit_search are functions
from .fitting import FitMax, FitResult, fit, fit_max, fit_presets, fit_search  # noqa: E402

__all__ = ["DeviceInfo", "describe", "on_colab", "pick_device", "CATEGORIES", "MemoryTracker", "format_bytes",
           "phase", "watch", "PRESETS", "VirtualGPU", "VirtualRun", "MLP", "GPT", "GPTConfig", "train_step",
           "naive_attention", "attention_bytes", "kv_cache_bytes", "sdpa_backend", "flash_attn_status",
           "HEADROOM", "usable_bytes", "GPU_SPECS", "GPUDataSheet", "MeasuredRoof", "roofline", "copy_bandwidth",
           "time_fn",
           "fit", "fit_search", "FitResult", "fit_presets", "fit_max", "FitMax",
           "attention", "checkpointing", "clinic", "parallel", "planning", "plot", "quant", "sharding", "widgets"]
__version__ = "0.1.0"

# Module paths from before memlab was grouped by technique (and memlab.dist, now memlab.sharding), kept only so that a
# learner's older copy of a notebook still imports: `from memlab.models import GPT` is `from memlab.core.models
# import GPT`. Each warns once, naming the path to use; the course itself uses the grouped paths (tests/test_repo.py).
LEGACY_MODULES = {
    "device": "core.device", "track": "core.track", "virtual_gpu": "core.virtual_gpu", "estimate": "core.estimate",
    "models": "core.models", "gpu_specs": "core.gpus", "hierarchy": "hardware.hierarchy",
    "timing": "hardware.timing", "recorded": "hardware.recorded", "dist": "sharding", "comm": "sharding.comm",
    "zero": "sharding.zero", "zero_scale": "sharding.zero_scale", "zero_train": "sharding.zero_train",
    "qlora": "quant.qlora", "llama": "quant.llama", "fit_model": "fitting.model", "fit_run": "fitting.run",
}
_WARNED: set = set()


def _grouped(fullname: str) -> str | None:
    """memlab.<old>[.rest] -> memlab.<new>[.rest] for a legacy path, else None."""
    head, _, rest = fullname.partition(".")
    old, _, tail = rest.partition(".")
    if head != __name__ or old not in LEGACY_MODULES:
        return None
    if old not in _WARNED:
        _WARNED.add(old)
        import warnings
        warnings.warn(f"memlab.{old} is now memlab.{LEGACY_MODULES[old]}: the old path still works, for older "
                      f"notebooks", FutureWarning, stacklevel=4)
    return f"{__name__}.{LEGACY_MODULES[old]}" + (f".{tail}" if tail else "")


def __getattr__(name: str):
    """memlab.<old>: the grouped module, with a warning the first time."""
    new = _grouped(f"{__name__}.{name}")
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _importlib.import_module(new)


class _LegacyPaths:
    """`import memlab.<old>` and `from memlab.<old> import x`: the grouped module itself (one module object under
    both names, so a patch or an isinstance check sees the same thing)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        new = _grouped(fullname)
        if new is None:
            return None
        import importlib.util
        module = _importlib.import_module(new)
        return importlib.util.spec_from_loader(fullname, cls._Loader(module), is_package=hasattr(module, "__path__"))

    class _Loader:
        def __init__(self, module):
            self.module, self.spec = module, module.__spec__

        def create_module(self, spec):
            return self.module

        def exec_module(self, module):
            module.__spec__ = self.spec          # the grouped module keeps its own spec


_sys.meta_path.insert(0, _LegacyPaths)      # before the path finder, which would load a second copy

# The one place the course's GitHub repository is named: Colab badges and the
# Colab setup cell are built from it (tests/test_notebooks.py checks they agree).
REPO_SLUG = "gpu-memory-lab/gpu-memory-lab"


def colab_badge(path: str) -> str:
    """Markdown for an "Open in Colab" badge of a notebook at `path` in the repo."""
    if not isinstance(path, str) or not path.endswith(".ipynb"):
        raise ValueError(f"path must be a repository path ending in .ipynb, got {path!r}")
    url = f"https://colab.research.google.com/github/{REPO_SLUG}/blob/main/{path}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"
