"""Bytes per element: the one table of dtype sizes (`memlab.attention.dtype_bytes` and
`memlab.hardware.hierarchy.dtype_bytes` are this function).

    dtype_bytes(torch.bfloat16) == dtype_bytes("bf16") == 2
    dtype_bytes("fp32") == dtype_bytes("float32") == dtype_bytes("tf32") == 4   # TF32 is stored as fp32
    dtype_bytes("fp8") == dtype_bytes("int8") == 1                              # 8-bit tensor-core formats
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE_NAMES", "dtype_bytes"]

# name -> bytes per element; the short names are the course's, the long ones torch's
DTYPE_NAMES = {"fp64": 8, "float64": 8, "fp32": 4, "float32": 4, "tf32": 4, "fp16": 2, "float16": 2, "bf16": 2,
               "bfloat16": 2, "fp8": 1, "int8": 1}


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of a floating torch.dtype or a name in DTYPE_NAMES ('fp32', 'bf16', 'fp8' ...).

    ValueError for an unknown name; TypeError for a non-floating torch.dtype (torch.int8 holds codes, not
    activations: name the format "int8" to price an int8 matmul) or anything else."""
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)} or a torch floating dtype, got {dtype!r}")
        return DTYPE_NAMES[dtype]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a torch floating dtype or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    return dtype.itemsize
