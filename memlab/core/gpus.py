"""The GPUs this course meets, in one table (`GPUS`): for each card its published figures (memory bandwidth,
dense peak FLOP/s per precision, the on-chip sizes - SMs, shared memory, L1, registers, L2 - and the host links,
PCIe and NVLink) and the memory the real card reports (`total_memory`). Every figure names its document.

Two views are derived from it: `GPU_SPECS` (the data sheets, read through `memlab.hardware.hierarchy`) and `PRESETS`
(the virtual GPU's capacities, read through `memlab.core.virtual_gpu`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "GPUDataSheet", "GPU_SPECS", "GPUSpec", "PRESETS", "gpu_spec", "match_gpu_spec",
           "pcie_bandwidth", "resolve_gpu", "local_gpu", "MAX_PLAUSIBLE_GIB"]

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


# Cards known by the memory they report only (no data sheet here): key -> (total_memory bytes, bf16 tensor cores,
# the record it comes from). torch prints total_memory in whole MiB ("total_memory=22587MB" is 22587 x 2**20 bytes,
# rounded down: up to 1 MiB more on the card); deviceQuery prints bytes. All have bf16 (Ampere sm_80/86 and newer,
# CDNA3).
_DQ = "github.com/thamada/nvidia-smi gls/{}_deviceQuery.py (deviceQuery, driver 12.4)"
_MORE = {
    "RTX3090-24GB": (25327697920, f"GeForce RTX 3090: '24154 MBytes (25327697920 bytes)', {_DQ.format('RTX3090')}"),
    "RTX4060Ti-16GB": (16857038848, f"GeForce RTX 4060 Ti 16GB: '16076 MBytes (16857038848 bytes)', "
                                    f"{_DQ.format('RTX4060Ti')}"),
    "RTX4080-16GB": (16049 * MiB, "GeForce RTX 4080: torch's _CudaDeviceProperties(... total_memory=16049MB ...), "
                                  "brainglobe cellfinder docs, 'Speeding up cellfinder' (github.com/brainglobe)"),
    "RTX5090-32GB": (33677180928, "GeForce RTX 5090, driver 570.133.04: deviceQuery '32117 MBytes (33677180928 "
                                  "bytes)' (github.com/aikitoria/open-gpu-kernel-modules issue 1)"),
    "A10G-24GB": (22587 * MiB, "NVIDIA A10G (AWS g5): torch 2.15 _CudaDeviceProperties(... total_memory=22587MB ...), "
                               "TorchCodec docs, 'Accelerated video decoding on GPUs with CUDA and NVDEC' "
                               "(github.com/meta-pytorch/torchcodec)"),
    "RTXA6000-48GB": (48676 * MiB, "NVIDIA RTX A6000: _CudaDeviceProperties(... total_memory=48676MB ...), "
                                   "github.com/pytorch/ao torchao/prototype/hqq/README.md"),
    "A40-48GB": (47608692736, f"NVIDIA A40: '45403 MBytes (47608692736 bytes)', {_DQ.format('A40x10')}"),
    "L40S-48GB": (47803596800, f"NVIDIA L40S: '45589 MBytes (47803596800 bytes)', {_DQ.format('L40S')}"),
    "RTX6000Ada-48GB": (51002867712, f"RTX 6000 Ada: '48640 MBytes (51002867712 bytes)', "
                                     f"{_DQ.format('RTX6000Ada_x8')}"),
    "H100NVL-94GB": (99861594112, f"H100 NVL: '95235 MBytes (99861594112 bytes)', {_DQ.format('H100NVLx2')}"),
    "H200-141GB": (143156 * MiB, "NVIDIA H200: _CudaDeviceProperties(... total_memory=143156MB ...), github.com/"
                                 "ai-bot-pro/achatbot deploy/modal/src/llm/vllm/vlm/skywork_r1v.py"),
    "B200-180GB": (182642 * MiB, "NVIDIA B200: _CudaDeviceProperties(... total_memory=182642MB ...), github.com/"
                                 "ai-bot-pro/achatbot deploy/modal/src/llm/vllm/vlm/skywork_r1v.py"),
    "MI300X-192GB": (196592 * MiB, "AMD Instinct MI300X (ROCm: torch.cuda reports it): hipDeviceProp "
                                   "'196592: Total Global Memory (MB)', github.com/thamada/nvidia-smi "
                                   "gls/MI300X_deviceQuery.py"),
}
GPUS.update({k: GPU(sheet=None, total_memory=b, bf16=True, memory_source=src) for k, (b, src) in _MORE.items()})

# the data sheets, by key (V100-32GB is a data sheet only, not a virtual-GPU preset)
GPU_SPECS: dict[str, GPUDataSheet] = {k: g.sheet for k, g in GPUS.items() if g.sheet is not None}
# the virtual GPU's presets, by key (RTX4090-24GB has no data sheet here)
PRESETS: dict[str, GPUSpec] = {k: GPUSpec(k, g.total_memory, g.bf16, g.memory_source)
                               for k, g in GPUS.items() if g.total_memory is not None}


# ----------------------------------------------------------------------------- the one resolver
# What people type for a card: "4090", "rtx4090", "RTX 4090", "GeForce RTX 4090", "h100-80gb", "A100 80GB", "t4".
# A name is folded (case, spaces, "-", "_" and vendor words dropped; a trailing memory size such as "80gb" split
# off), then matched against each preset's folded model name; the memory size picks between cards of one model.
_VENDOR = ("nvidia", "geforce", "tesla", "quadro", "amd", "instinct", "radeon", "rtx")
MAX_PLAUSIBLE_GIB = 1024      # a bare number above this is no card's capacity: 4090 is a card, not 4090 GiB


def _fold(name: str) -> tuple[str, int | None]:
    """("a100", 80) from "NVIDIA A100-80GB"; ("4090", None) from "RTX 4090"."""
    m = re.fullmatch(r"(.+?)[\s_\-(]+(\d+)\s*(gb|gib|g)\)?", name.strip().lower())
    mem = int(m.group(2)) if m else None
    s = re.sub(r"[\s_\-()]+", "", m.group(1) if m else name.lower())
    changed = True
    while changed:
        changed = False
        for v in _VENDOR:
            if s.startswith(v) and len(s) > len(v):
                s, changed = s[len(v):], True
    return s, mem


_BY_MODEL: dict[str, list[str]] = {}
for _k in PRESETS:
    _BY_MODEL.setdefault(_fold(_k)[0], []).append(_k)


def _plausible(v: float) -> bool:
    return 0 < v <= MAX_PLAUSIBLE_GIB


def resolve_gpu(gpu, arg: str = "gpu") -> GPUSpec:
    """The one GPU lookup of memlab (memlab.fit, memlab-fit, its search and memlab.VirtualGPU all use it): a
    `GPUSpec` (name, capacity in bytes as the card reports it, bf16 tensor cores) from
      a preset name in any spelling people type ("4090", "rtx4090", "RTX 4090", "h100-80gb", "t4-16gb": `PRESETS`),
      "local" (this machine's CUDA, ROCm or Apple MPS device as torch reports it: `local_gpu`),
      a capacity in GiB (a number, or a string of one, 0 < GiB <= MAX_PLAUSIBLE_GIB; such a card is taken to have
      bf16), or an object with a GPUSpec `.spec` (memlab.VirtualGPU).
    Anything else fails in one line that names the closest presets (and `arg`, the caller's argument)."""
    spec = getattr(gpu, "spec", None)
    if isinstance(spec, GPUSpec):
        return spec
    if isinstance(gpu, bool) or not isinstance(gpu, (str, int, float)):
        raise TypeError(f"{arg} must be a GPU name (e.g. '4090', 'A100-80GB'), a capacity in GiB or a "
                        f"memlab.VirtualGPU, got {type(gpu).__name__}")
    if isinstance(gpu, str):
        key = gpu.strip()
        if key in PRESETS:
            return PRESETS[key]
        if key.lower() == "local":
            return local_gpu()
        model, mem = _fold(key)
        cards = [k for k in _BY_MODEL.get(model, []) if mem is None or int(k.rsplit("-", 1)[1][:-2]) == mem]
        if len(cards) == 1:
            return PRESETS[cards[0]]
        if len(cards) > 1:
            raise ValueError(f"{arg} {gpu!r} names more than one card: {' or '.join(map(repr, cards))}; add the memory "
                             f"(e.g. {cards[-1]!r})")
        try:
            value = float(key)
        except ValueError:
            value = None
        if value is None or not _plausible(value):
            near = _near(key) or f" (cards: {', '.join(PRESETS)})"
            raise ValueError(f"{arg} {gpu!r} is no known card{near} and no capacity in GiB (a number in "
                             f"(0, {MAX_PLAUSIBLE_GIB}]); memlab-fit --list names every card")
        gpu = value
    if not math.isfinite(gpu) or not _plausible(gpu):
        near = _near(str(int(gpu))) if math.isfinite(gpu) and gpu > MAX_PLAUSIBLE_GIB else ""
        raise ValueError(f"{arg} as a number is the card's capacity in GiB, in (0, {MAX_PLAUSIBLE_GIB}]; got "
                         f"{gpu!r}" + (f"; a card{near}? give its name as a string" if near else ""))
    return GPUSpec(f"{gpu:g}GiB", int(gpu * 2**30), True, "a capacity given in GiB")


def local_gpu() -> GPUSpec:
    """This machine's accelerator as torch reports it (gpu="local"): a CUDA or ROCm device's total_memory and its
    bf16 support, or on Apple silicon torch.mps.recommended_max_memory() (the working set Metal recommends; PyTorch's
    MPS allocator raises its out-of-memory error at PYTORCH_MPS_HIGH_WATERMARK_RATIO, 1.7 by default, times it)."""
    import torch
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return GPUSpec(f"{props.name} (local)", int(props.total_memory), bool(torch.cuda.is_bf16_supported()),
                       "torch.cuda.get_device_properties(0).total_memory on this machine")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return GPUSpec("Apple MPS (local)", int(torch.mps.recommended_max_memory()), True,
                       "torch.mps.recommended_max_memory() on this machine")
    raise ValueError("gpu 'local' is this machine's GPU, and torch sees none here (no CUDA, ROCm or MPS device); "
                     "name a card or give a capacity in GiB")


def _near(key: str) -> str:
    """" (closest: 'A', 'B')" for a name that is no card, "" when nothing is close."""
    import difflib
    model, _ = _fold(key)
    names = {m: ks for m, ks in _BY_MODEL.items()}
    close = [k for m in difflib.get_close_matches(model, list(names), n=3, cutoff=0.6) for k in names[m]]
    close += [k for m, ks in names.items() if model and (m.startswith(model) or model.startswith(m))
              for k in ks if k not in close]
    return f" (closest: {', '.join(map(repr, close[:4]))})" if close else ""


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
