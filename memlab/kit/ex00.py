"""What exercise 00's notebook ("read the roofline") takes from memlab: `GPUS`, the three GPUs its roofline
task is asked about, as the plain dicts `roofline(..., gpu)` receives. The figures are memlab's data sheets
(memlab.core.gpus.GPU_SPECS), not copies."""

from __future__ import annotations

from memlab.core.gpus import GPU_SPECS, GPUDataSheet

__all__ = ["GPUS"]


def _gpu(spec: GPUDataSheet, extra_tensor: dict[str, float] | None = None, extra_source: str = "") -> dict:
    """One data sheet as the exercise's plain dict. "tensor_flops" holds the dense tensor-core peaks by dtype
    name; "vector_flops" is the FP32 peak without tensor cores. TF32 is left out on purpose: PyTorch keeps TF32
    off for float32 matmuls by default (torch.backends.cuda.matmul.allow_tf32 = False)."""
    tensor = {"float16": spec.fp16_tensor}
    if spec.bf16_tensor is not None:                          # None: no BF16 tensor cores (Turing, Volta)
        tensor["bfloat16"] = spec.bf16_tensor
    tensor.update(extra_tensor or {})
    return {"name": spec.name.split(" (")[0],                 # "NVIDIA T4 (PCIe, Turing sm_75)" -> "NVIDIA T4"
            "bandwidth": spec.dram_bandwidth, "vector_flops": spec.fp32, "tensor_flops": tensor,
            "source": spec.sources + extra_source}


_H100 = GPU_SPECS["H100-80GB"]

# Dense (no sparsity) peaks in FLOP/s, memory bandwidth in bytes/s.
GPUS: dict[str, dict] = {
    "T4": _gpu(GPU_SPECS["T4-16GB"]),                         # Turing: FP16 tensor cores, no BF16
    "A100": _gpu(GPU_SPECS["A100-80GB"]),
    # GPU_SPECS has no FP8 column: Hopper's FP8 tensor cores run at twice its BF16 rate
    "H100": _gpu(_H100, {"float8_e4m3fn": 2 * _H100.bf16_tensor},
                 " FP8 Tensor Core 3,958 TFLOPS with sparsity (1,979 dense), same data sheet."),
}
