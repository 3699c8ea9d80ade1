"""The GPUs this course meets, in one table (`GPUS`): for each card its published figures (memory bandwidth,
dense peak FLOP/s per precision, the on-chip sizes - SMs, shared memory, L1, registers, L2 - and the host links,
PCIe and NVLink) and the memory the real card reports (`total_memory`). Every figure names its document.

Two views are derived from it: `GPU_SPECS` (the data sheets, read through `memlab.hierarchy`) and `PRESETS`
(the virtual GPU's capacities, read through `memlab.virtual_gpu`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "GPUDataSheet", "GPU_SPECS", "GPUSpec", "PRESETS", "gpu_spec", "match_gpu_spec",
           "pcie_bandwidth"]

KiB, MiB = 2**10, 2**20
GBps, TFLOPS = 1e9, 1e12          # data sheets use decimal units for bandwidth and FLOP/s


@dataclass(frozen=True)
class GPUDataSheet:
    """Published figures of one GPU. FLOP/s are *dense* peaks (data sheets print
    tensor-core figures "with sparsity", i.e. 2:4 structured sparsity, which are
    twice the dense ones; here they are halved). Bandwidths in bytes/s."""
    name: str
    memory: str                 # capacity and type, as printed
    dram_bandwidth: float       # HBM / GDDR peak, bytes/s
    fp32: float                 # FP32 on the CUDA cores (non-tensor), FLOP/s
    tf32_tensor: float | None   # TF32 on tensor cores, dense; None: the GPU has no TF32
    fp16_tensor: float          # FP16 on tensor cores (FP32 accumulate), dense
    bf16_tensor: float | None   # BF16 on tensor cores, dense; None: no BF16 tensor cores
    sms: int                    # streaming multiprocessors
    smem_per_sm: int            # bytes: the most shared memory one SM can give its blocks
    l1_smem_per_sm: int         # bytes: L1 data cache + shared memory, one SRAM per SM
    registers_per_sm: int       # bytes: 64K 32-bit registers per SM on all of these
    l2_bytes: int
    pcie: str                   # PCIe generation and width
    pcie_bandwidth: float       # bytes/s as the data sheet prints it: both directions added
    nvlink_bandwidth: float | None  # bytes/s per GPU, both directions added; None: no NVLink
    sources: str

    @property
    def ridge_fp32(self) -> float:
        """FLOP/byte where FP32 CUDA-core work stops being memory-bound."""
        return self.fp32 / self.dram_bandwidth


@dataclass(frozen=True)
class GPUSpec:
    """A virtual GPU's card: its name, capacity and whether it has bf16 tensor cores."""
    name: str
    capacity: int     # bytes: total_memory as the real card reports it (minus any reserve)
    bf16: bool        # native bf16 tensor cores (Ampere sm_80 and newer)
    note: str         # where the numbers come from


@dataclass(frozen=True)
class GPU:
    """One card of the table: its data sheet and the memory the real card reports."""
    sheet: GPUDataSheet | None     # published figures; None: not in the data-sheet view (GPU_SPECS)
    total_memory: int | None       # bytes, torch.cuda.get_device_properties(0).total_memory (= deviceQuery's
                                   # totalGlobalMem) from a named public record; None: not a virtual-GPU preset
    bf16: bool                     # native bf16 tensor cores (Ampere sm_80 and newer)
    memory_source: str | None      # the record total_memory comes from


_REGS = 64 * 1024 * 4   # CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": 64K regs/SM

# Every figure's document is named in `sources` (data sheet) and `memory_source` (total_memory). Max shared memory
# per SM (smem_per_sm) for all entries: CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability": 96 KB sm_70, 64 KB sm_75, 164 KB sm_80, 100 KB sm_89, 228 KB sm_90. total_memory is what the real
# card reports, not the vendor's nominal "16 GB" read as GiB: a T4 holds 14.74 GiB; the figure moves a little
# with the driver.
GPUS: dict[str, GPU] = {
    # NVIDIA T4 Tensor Core GPU datasheet; Turing architecture whitepaper (TU104)
    "T4-16GB": GPU(
        sheet=GPUDataSheet(
            name="NVIDIA T4 (PCIe, Turing sm_75)", memory="16 GB GDDR6",
            dram_bandwidth=320 * GBps, fp32=8.1 * TFLOPS, tf32_tensor=None, fp16_tensor=65 * TFLOPS, bf16_tensor=None,
            sms=40, smem_per_sm=64 * KiB, l1_smem_per_sm=96 * KiB, registers_per_sm=_REGS, l2_bytes=4 * MiB,
            pcie="Gen3 x16", pcie_bandwidth=32 * GBps, nvlink_bandwidth=None,
            sources="NVIDIA T4 datasheet: 8.1 TFLOPS FP32, 65 TFLOPS mixed FP16/FP32, 320+ GB/s GDDR6, PCIe Gen3 "
                    "x16 32 GB/s; Turing architecture whitepaper: 4 MB L2 (TU104), 96 KB L1/shared per SM; "
                    "40 SMs = 2,560 CUDA cores / 64 per Turing SM."),
        total_memory=15095 * MiB, bf16=False,
        memory_source="Tesla T4 on Colab, driver 12.4: deviceQuery 'Global Memory 15095 MBytes' (github.com/"
                      "sylvia-ymlin/cuda-kernels-from-scratch README.md); Colab OOM messages print 'total capacity "
                      "of 14.74 GiB'. Other hosts' drivers report 14.56 GiB (github.com/Zheng-Chong/CatVTON "
                      "issue 133). Turing sm_75: no bf16 tensor cores."),
    # NVIDIA L4 Tensor Core GPU datasheet (tensor figures printed with sparsity: halved); Ada whitepaper
    "L4-24GB": GPU(
        sheet=GPUDataSheet(
            name="NVIDIA L4 (PCIe, Ada sm_89)", memory="24 GB GDDR6",
            dram_bandwidth=300 * GBps, fp32=30.3 * TFLOPS, tf32_tensor=60 * TFLOPS, fp16_tensor=121 * TFLOPS,
            bf16_tensor=121 * TFLOPS,
            sms=58, smem_per_sm=100 * KiB, l1_smem_per_sm=128 * KiB, registers_per_sm=_REGS, l2_bytes=48 * MiB,
            pcie="Gen4 x16", pcie_bandwidth=64 * GBps, nvlink_bandwidth=None,
            sources="NVIDIA L4 datasheet: 30.3 TFLOPS FP32, TF32 120 / FP16 and BF16 242 TFLOPS with sparsity, "
                    "300 GB/s, PCIe Gen4 x16 64 GB/s; Ada Lovelace architecture whitepaper: 128 KB L1/shared per SM; "
                    "58 SMs = 7,424 CUDA cores / 128 per Ada SM; 48 MB L2 is the AD104 chip's (TechPowerUp GPU "
                    "database: the data sheet does not list it)."),
        total_memory=23570219008, bf16=True,
        memory_source="NVIDIA L4: torch.cuda.get_device_properties(0).total_memory = 23570219008 bytes with torch "
                      "2.4.0+cu121, as public GPU benchmark reports print it (nvidia-smi lists 23034 MiB); other "
                      "drivers print 'total capacity of 22.03 GiB' (github.com/ArcInstitute/evo2 issue 190). "
                      "Ada sm_89."),
    "RTX4090-24GB": GPU(
        sheet=None,
        total_memory=25386352640, bf16=True,
        memory_source="GeForce RTX 4090, driver 12.4: deviceQuery '24210 MBytes (25386352640 bytes)' "
                      "(github.com/thamada/nvidia-smi gls/RTX4090_deviceQuery.py). Ada sm_89."),
    # NVIDIA Tesla V100 datasheet (SXM2); Volta architecture whitepaper (GV100)
    "V100-32GB": GPU(
        sheet=GPUDataSheet(
            name="NVIDIA V100 SXM2 32GB (Volta sm_70)", memory="32 GB HBM2",
            dram_bandwidth=900 * GBps, fp32=15.7 * TFLOPS, tf32_tensor=None, fp16_tensor=125 * TFLOPS, bf16_tensor=None,
            sms=80, smem_per_sm=96 * KiB, l1_smem_per_sm=128 * KiB, registers_per_sm=_REGS, l2_bytes=6 * MiB,
            pcie="Gen3 x16", pcie_bandwidth=32 * GBps, nvlink_bandwidth=300 * GBps,
            sources="NVIDIA Tesla V100 datasheet (SXM2): 15.7 TFLOPS FP32, 125 TFLOPS tensor, 900 GB/s, NVLink "
                    "300 GB/s; Volta architecture whitepaper: 80 SMs, 6 MB L2, 128 KB L1/shared per SM."),
        total_memory=None, bf16=False,
        memory_source=None),
    # NVIDIA A100 Tensor Core GPU datasheet (dense figures; sparsity doubles them); A100 architecture whitepaper
    "A100-40GB": GPU(
        sheet=GPUDataSheet(
            name="NVIDIA A100 SXM4 40GB (Ampere sm_80)", memory="40 GB HBM2",
            dram_bandwidth=1555 * GBps, fp32=19.5 * TFLOPS, tf32_tensor=156 * TFLOPS, fp16_tensor=312 * TFLOPS,
            bf16_tensor=312 * TFLOPS,
            sms=108, smem_per_sm=164 * KiB, l1_smem_per_sm=192 * KiB, registers_per_sm=_REGS, l2_bytes=40 * MiB,
            pcie="Gen4 x16", pcie_bandwidth=64 * GBps, nvlink_bandwidth=600 * GBps,
            sources="NVIDIA A100 datasheet: 19.5 TFLOPS FP32, TF32 156 / FP16 and BF16 312 TFLOPS (312 / 624 with "
                    "sparsity), 40GB SXM 1,555 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s; NVIDIA A100 Tensor Core GPU "
                    "architecture whitepaper: 108 SMs, 40 MB L2, 192 KB L1/shared per SM."),
        total_memory=42298834944, bf16=True,
        memory_source="A100-SXM4-40GB, driver 12.2: deviceQuery '40339 MBytes (42298834944 bytes)' "
                      "(github.com/bottlerocket-os/bottlerocket pull request 3873). Ampere sm_80."),
    "A100-80GB": GPU(
        sheet=GPUDataSheet(
            name="NVIDIA A100 SXM4 80GB (Ampere sm_80)", memory="80 GB HBM2e",
            dram_bandwidth=2039 * GBps, fp32=19.5 * TFLOPS, tf32_tensor=156 * TFLOPS, fp16_tensor=312 * TFLOPS,
            bf16_tensor=312 * TFLOPS,
            sms=108, smem_per_sm=164 * KiB, l1_smem_per_sm=192 * KiB, registers_per_sm=_REGS, l2_bytes=40 * MiB,
            pcie="Gen4 x16", pcie_bandwidth=64 * GBps, nvlink_bandwidth=600 * GBps,
            sources="NVIDIA A100 datasheet: 19.5 TFLOPS FP32, TF32 156 / FP16 and BF16 312 TFLOPS (312 / 624 with "
                    "sparsity), 80GB SXM 2,039 GB/s (80GB PCIe: 1,935 GB/s), NVLink 600 GB/s, PCIe Gen4 64 GB/s; "
                    "NVIDIA A100 Tensor Core GPU architecture whitepaper: 108 SMs, 40 MB L2, 192 KB L1/shared per SM."),
        total_memory=85100068864, bf16=True,
        memory_source="A100-SXM4-80GB, driver 12.5: deviceQuery '81158 MBytes (85100068864 bytes)' "
                      "(github.com/thamada/nvidia-smi gls/A100SXMx4_deviceQuery.py). Ampere sm_80."),
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column (tensor figures printed with sparsity: halved);
    # NVIDIA H100 Tensor Core GPU architecture whitepaper
    "H100-80GB": GPU(
        sheet=GPUDataSheet(
            name="NVIDIA H100 SXM5 80GB (Hopper sm_90)", memory="80 GB HBM3",
            dram_bandwidth=3350 * GBps, fp32=67 * TFLOPS, tf32_tensor=494.5 * TFLOPS, fp16_tensor=989.5 * TFLOPS,
            bf16_tensor=989.5 * TFLOPS,
            sms=132, smem_per_sm=228 * KiB, l1_smem_per_sm=256 * KiB, registers_per_sm=_REGS, l2_bytes=50 * MiB,
            pcie="Gen5 x16", pcie_bandwidth=128 * GBps, nvlink_bandwidth=900 * GBps,
            sources="NVIDIA H100 datasheet (SXM): 67 TFLOPS FP32, TF32 989 / BF16 and FP16 1,979 TFLOPS with "
                    "sparsity, 3.35 TB/s HBM3, NVLink 900 GB/s, PCIe Gen5 128 GB/s; NVIDIA H100 Tensor Core GPU "
                    "architecture whitepaper: 132 SMs, 50 MB L2, 256 KB L1/shared per SM."),
        total_memory=85045477376, bf16=True,
        memory_source="H100 80GB HBM3 (SXM), driver 12.7: deviceQuery '81106 MBytes (85045477376 bytes)' "
                      "(github.com/thamada/nvidia-smi nvsim/H100SXMx8_deviceQuery.py). Hopper sm_90."),
}

# the data sheets, by key (V100-32GB is a data sheet only, not a virtual-GPU preset)
GPU_SPECS: dict[str, GPUDataSheet] = {k: g.sheet for k, g in GPUS.items() if g.sheet is not None}
# the virtual GPU's presets, by key (RTX4090-24GB has no data sheet here)
PRESETS: dict[str, GPUSpec] = {k: GPUSpec(k, g.total_memory, g.bf16, g.memory_source)
                               for k, g in GPUS.items() if g.total_memory is not None}


# The course's one criterion for "it fits": what the step needs stays below the capacity minus this fraction. Where
# only a byte count of tensors is known (lesson 07), the fraction stands for what that count leaves out (the CUDA
# context and cuBLAS workspaces, fragmentation); `memlab fit` models those (the caching allocator's reserved bytes,
# the context: memlab/fitting/plan.py), so there it keeps room only for a longer batch than planned, other
# processes on the card and the error of those models. Lessons 07 and 08 and `memlab fit` all use it.
HEADROOM = 0.05


def usable_bytes(capacity: int, headroom: float = HEADROOM) -> int:
    """The bytes a plan may use on a GPU of `capacity` bytes: capacity x (1 - headroom)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"capacity must be a positive int of bytes, got {capacity!r}")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a number in [0, 1), got {headroom!r}")
    return int(capacity * (1 - headroom))


def gpu_spec(spec: str | GPUDataSheet) -> GPUDataSheet:
    """A `GPUDataSheet` from its key in GPU_SPECS (or itself)."""
    if isinstance(spec, GPUDataSheet):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a key of GPU_SPECS or a GPUDataSheet, got {type(spec).__name__}")
    if spec not in GPU_SPECS:
        raise ValueError(f"unknown GPU {spec!r}; choose one of {sorted(GPU_SPECS)}")
    return GPU_SPECS[spec]


def match_gpu_spec(device_name: str, total_bytes: int | None = None) -> str | None:
    """The GPU_SPECS key for a CUDA device name (torch.cuda.get_device_name()), or
    None if the table has no entry for that exact part (PCIe A100/H100/V100 differ)."""
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str, got {type(device_name).__name__}")
    name = device_name.upper()
    if re.search(r"\bT4\b", name):
        return "T4-16GB"
    if re.search(r"\bL4\b", name):
        return "L4-24GB"
    if "PCIE" in name:
        return None
    if "A100" in name:
        return "A100-80GB" if ("80GB" in name or (total_bytes or 0) > 50 * 2**30) else "A100-40GB"
    if "H100" in name and ("HBM3" in name or "SXM" in name):
        return "H100-80GB"
    if "V100" in name and "SXM2" in name and "32GB" in name:
        return "V100-32GB"
    return None


def pcie_bandwidth(gen: int, lanes: int = 16) -> float:
    """Theoretical PCIe bandwidth, bytes/s, ONE direction.

    PCI Express Base Specification (PCI-SIG): 8, 16, 32 GT/s per lane for
    Gen3, 4, 5, with 128b/130b encoding. Gen3 x16: 8e9 * 16 * 128/130 / 8 = 15.75 GB/s.
    Data sheets print about twice this (both directions added, encoding ignored).
    """
    rates = {3: 8e9, 4: 16e9, 5: 32e9}
    if gen not in rates:
        raise ValueError(f"gen must be 3, 4 or 5, got {gen!r}")
    if lanes not in (1, 2, 4, 8, 16):
        raise ValueError(f"lanes must be 1, 2, 4, 8 or 16, got {lanes!r}")
    return rates[gen] * lanes * 128 / 130 / 8
