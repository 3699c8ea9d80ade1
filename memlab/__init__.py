"""memlab: the GPU Memory Lab measuring kit.

Importing memlab allocates nothing and touches no GPU.
"""
from .device import DeviceInfo, describe, on_colab, pick_device
from .track import CATEGORIES, MemoryTracker, format_bytes, phase, watch
from .virtual_gpu import PRESETS, VirtualGPU, VirtualRun
from .models import MLP, GPT, GPTConfig, train_step

__all__ = ["DeviceInfo", "describe", "on_colab", "pick_device", "CATEGORIES", "MemoryTracker", "format_bytes",
           "phase", "watch", "PRESETS", "VirtualGPU", "VirtualRun", "MLP", "GPT", "GPTConfig", "train_step"]
__version__ = "0.1.0"
