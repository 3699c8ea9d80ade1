"""Lesson 07, quantization: absmax, zero-point and NF4 codes and their bytes (`nf4`, the idea), QLoRA's
bytes by formula (`qlora`) and real Llama models quantized and fine-tuned (`llama`, the plumbing).

`memlab.quant.<name>` is `memlab.quant.nf4.<name>` for the names below (what lesson 07 calls)."""
from .nf4 import (BLOCKSIZE, DQ_BLOCKSIZE, Linear4bitStandIn, Roundtrip, absmax_roundtrip, adam8bit_state_bytes,
                  bits_per_param, bnb_roundtrip, nf4_bytes, quant_state_bytes, relative_error, zeropoint_roundtrip)

__all__ = ["BLOCKSIZE", "DQ_BLOCKSIZE", "bits_per_param", "nf4_bytes", "quant_state_bytes", "adam8bit_state_bytes",
           "Roundtrip", "absmax_roundtrip", "zeropoint_roundtrip", "bnb_roundtrip", "relative_error",
           "Linear4bitStandIn"]
