"""What exercise 07's notebook takes from the kit: the Llama shapes task 7.4 asks about (`LLAMA_7B`,
`LLAMA_13B`, in the plain-dict form `qlora_memory(cfg, ...)` receives) and the 8-bit code of task 7.2
(`dynamic_code()`). The checks of exercise 07 draw their full-size cases from the same two configs."""

from __future__ import annotations

import torch

# hidden C, intermediate F, layers L, attention heads, key/value heads, vocabulary V (Touvron et al. 2023)
LLAMA_7B = {"hidden": 4096, "intermediate": 11008, "layers": 32, "heads": 32, "kv_heads": 32, "vocab": 32000}
LLAMA_13B = {"hidden": 5120, "intermediate": 13824, "layers": 40, "heads": 40, "kv_heads": 40, "vocab": 32000}


def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code (256 float32 levels in [-1, 1]): the code of task 7.2."""
    import bitsandbytes.functional as bf
    return bf.create_dynamic_map(signed=True).float()
