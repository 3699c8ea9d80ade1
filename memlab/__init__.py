"""memlab: the GPU Memory Lab measuring kit.

Importing memlab allocates nothing and touches no GPU.
"""
from .device import DeviceInfo, describe, on_colab, pick_device
from .track import CATEGORIES, MemoryTracker, format_bytes, phase, watch
from .virtual_gpu import PRESETS, VirtualGPU, VirtualRun
from .models import MLP, GPT, GPTConfig, train_step
from .attention import naive_attention, attention_bytes, kv_cache_bytes, sdpa_backend, flash_attn_status
from .hierarchy import GPU_SPECS, GPUDataSheet, MeasuredRoof, roofline
from .timing import copy_bandwidth, time_fn
# submodules by lesson: estimate and plot (all), recorded (numbers recorded on a real GPU),
# hierarchy and timing (00), attention (05), quant, qlora and llama (07)
from . import estimate, plot, recorded, hierarchy, timing, attention  # noqa: E402
from . import llama, qlora, quant  # noqa: E402  (07: torch only at import)
# will it fit: transformers and peft load inside the functions (memlab.fit names the function below;
# the module is memlab.fit in sys.modules: `from memlab.fit import load_config` works)
from .fit import FitResult, fit, fit_presets  # noqa: E402
from .fit_search import fit_search  # noqa: E402

__all__ = ["DeviceInfo", "describe", "on_colab", "pick_device", "CATEGORIES", "MemoryTracker", "format_bytes",
           "phase", "watch", "PRESETS", "VirtualGPU", "VirtualRun", "MLP", "GPT", "GPTConfig", "train_step",
           "naive_attention", "attention_bytes", "kv_cache_bytes", "sdpa_backend", "flash_attn_status",
           "GPU_SPECS", "GPUDataSheet", "MeasuredRoof", "roofline", "copy_bandwidth", "time_fn",
           "fit", "fit_search", "FitResult", "fit_presets"]
__version__ = "0.1.0"

# The one place the course's GitHub repository is named: Colab badges and the
# Colab setup cell are built from it (tests/test_notebooks.py checks they agree).
REPO_SLUG = "gpu-memory-lab/gpu-memory-lab"


def colab_badge(path: str) -> str:
    """Markdown for an "Open in Colab" badge of a notebook at `path` in the repo."""
    if not isinstance(path, str) or not path.endswith(".ipynb"):
        raise ValueError(f"path must be a repository path ending in .ipynb, got {path!r}")
    url = f"https://colab.research.google.com/github/{REPO_SLUG}/blob/main/{path}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"
