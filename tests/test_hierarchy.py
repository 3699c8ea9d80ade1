"""memlab.hardware.hierarchy: FLOPs/bytes formulas by hand and against PyTorch's FLOP counter,
the roofline, the data-sheet table, timing and bandwidth helpers, and bad input."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from memlab.hardware import hierarchy as H
from memlab.hardware import timing

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------- formulas by hand
def test_matmul_cost_by_hand():
    c = H.matmul_cost((64, 128), (128, 32))                     # fp32
    assert c.flops == 2 * 64 * 32 * 128
    assert c.bytes == 4 * (64 * 128 + 128 * 32 + 64 * 32)
    assert c.intensity == pytest.approx(524288 / 57344)
    assert H.matmul_cost((64, 128), (128, 32), torch.float16).bytes == c.bytes // 2


def test_matmul_cost_leading_dims_and_broadcast():
    # a batch of 8 against one shared weight: the weight is read once
    c = H.matmul_cost((8, 64, 128), (128, 32), "bf16")
    assert c.flops == 8 * 2 * 64 * 32 * 128
    assert c.bytes == 2 * (8 * 64 * 128 + 128 * 32 + 8 * 64 * 32)
    # (2, 1) and (3,) broadcast to a batch of (2, 3)
    c = H.matmul_cost((2, 1, 4, 8), (3, 8, 5))
    assert c.flops == 2 * 6 * 4 * 5 * 8
    assert c.bytes == 4 * (2 * 4 * 8 + 3 * 8 * 5 + 6 * 4 * 5)


@pytest.mark.parametrize("a,b", [((7, 5), (5, 3)), ((4, 6, 5), (5, 9)), ((2, 3, 4, 5), (2, 3, 5, 6)),
                                 ((3, 1, 8, 16), (4, 16, 2))])
def test_matmul_flops_match_pytorchs_flop_counter(a, b):
    with FlopCounterMode(display=False) as fc:
        torch.randn(a) @ torch.randn(b)
    assert H.matmul_cost(a, b).flops == fc.get_total_flops()


def test_elementwise_softmax_layernorm_by_hand():
    c = H.elementwise_cost((1000,), "fp32", n_inputs=2)          # a + b
    assert (c.flops, c.bytes) == (1000, 3 * 1000 * 4)
    c = H.elementwise_cost((10, 10), torch.float16, flops_per_element=3)
    assert (c.flops, c.bytes) == (300, 2 * 100 * 2)
    c = H.softmax_cost((4, 10), "fp16")
    assert (c.flops, c.bytes) == (5 * 40, 2 * 40 * 2)
    c = H.layer_norm_cost((2, 3, 8))
    assert (c.flops, c.bytes) == (7 * 48, 4 * (2 * 48 + 2 * 8))
    c = H.layer_norm_cost((2, 3, 8), affine=False)
    assert (c.flops, c.bytes) == (5 * 48, 4 * 2 * 48)


def test_attention_cost_by_hand_and_fused():
    b, h, t, d = 2, 3, 16, 8
    c = H.attention_cost(b, h, t, d, "fp16")
    assert c.flops == 4 * b * h * t * t * d + 5 * b * h * t * t
    assert c.bytes == 2 * (4 * b * h * t * d + 4 * b * h * t * t)
    f = H.attention_cost(b, h, t, d, "fp16", fused=True)
    assert f.flops == c.flops and f.bytes == 2 * 4 * b * h * t * d
    assert f.intensity > c.intensity


def test_attention_matmul_flops_match_the_flop_counter():
    b, h, t, d = 2, 2, 32, 16
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    with FlopCounterMode(display=False) as fc:                 # naive attention, three kernels
        p = F.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-1)
        p @ v
    # PyTorch counts the two matmuls, not the softmax
    assert H.attention_cost(b, h, t, d).flops - 5 * b * h * t * t == fc.get_total_flops()


# ----------------------------------------------------------------------------- roofline
def test_roofline_memory_and_compute_bound():
    spec = H.GPU_SPECS["A100-80GB"]
    ridge = H.ridge_point("A100-80GB", tensor_cores=True, dtype=torch.bfloat16)
    assert ridge == pytest.approx(312e12 / 2039e9)
    low = H.roofline(1e9, 1e9, "A100-80GB", tensor_cores=True, dtype="bf16")       # 1 FLOP/byte
    assert low.bound == "memory-bound" and low.attainable == pytest.approx(spec.dram_bandwidth)
    assert low.time_s == pytest.approx(1e9 / 2039e9)
    high = H.roofline(1e12, 1e9, "A100-80GB", tensor_cores=True, dtype="bf16")      # 1000 FLOP/byte
    assert high.bound == "compute-bound" and high.attainable == pytest.approx(312e12)
    at = H.roofline(ridge * 1e6, 1e6, spec, tensor_cores=True, dtype="fp16")
    assert at.bound == "compute-bound"
    # the same op on CUDA cores has a ridge near 10: an intensity of 50 is compute-bound there
    mid = H.roofline(50e9, 1e9, "A100-80GB")
    assert mid.bound == "compute-bound" and mid.peak_flops == 19.5e12
    assert H.roofline(50e9, 1e9, "A100-80GB", tensor_cores=True, dtype="fp16").bound == "memory-bound"


def test_roofline_places_real_ops():
    # a square bf16 matmul has intensity n/3: n = 4096 is compute-bound on an H100, a batch-1
    # matrix-vector product (decoding one token) is memory-bound everywhere
    big = H.matmul_cost((4096, 4096), (4096, 4096), "bf16")
    assert big.intensity == pytest.approx(4096 / 3)
    assert H.roofline(big.flops, big.bytes, "H100-80GB", True, "bf16").bound == "compute-bound"
    gemv = H.matmul_cost((1, 4096), (4096, 4096), "bf16")
    for k in H.GPU_SPECS:
        assert H.roofline(gemv.flops, gemv.bytes, k).bound == "memory-bound"
    sm = H.softmax_cost((8, 12, 1024, 1024), "bf16")
    assert H.roofline(sm.flops, sm.bytes, "T4-16GB").bound == "memory-bound"


def test_common_ridge_claim_is_the_cuda_core_one():
    # "A100 ~10, V100 ~17, H100 ~20 FLOP/byte" holds for FP32 on CUDA cores, not for tensor cores
    assert H.ridge_point("A100-80GB") == pytest.approx(9.56, abs=0.01)
    assert H.ridge_point("V100-32GB") == pytest.approx(17.4, abs=0.1)
    assert H.ridge_point("H100-80GB") == pytest.approx(20.0, abs=0.1)
    for k in ("A100-80GB", "H100-80GB"):
        assert H.ridge_point(k, True, "bf16") > 7 * H.ridge_point(k)


def test_measured_roof():
    roof = H.MeasuredRoof("cpu", 100e9, 20e9)
    r = H.roofline(1e6, 1e6, roof, tensor_cores=True, dtype="bf16")      # its own roofs, the flags ignored
    assert r.ridge == 5 and r.bound == "memory-bound" and r.attainable == 20e9
    assert H.ridge_point(roof) == 5
    with pytest.raises(ValueError, match="bandwidth"):
        H.MeasuredRoof("cpu", 1e9, 0)


def test_peak_flops_choices():
    assert H.peak_flops("H100-80GB") == 67e12
    assert H.peak_flops("H100-80GB", False, torch.float16) == 67e12          # no tensor cores: CUDA-core peak
    assert H.peak_flops("H100-80GB", True, "fp32") == 494.5e12               # fp32 matmul on tensor cores = TF32
    assert H.peak_flops("H100-80GB", True, torch.bfloat16) == 989.5e12
    assert H.peak_flops("T4-16GB", True, "fp16") == 65e12
    with pytest.raises(ValueError, match="TF32"):
        H.peak_flops("T4-16GB", True, "fp32")
    with pytest.raises(ValueError, match="BF16"):
        H.peak_flops("T4-16GB", True, torch.bfloat16)


# ----------------------------------------------------------------------------- the data-sheet table
def test_gpu_specs_are_consistent():
    for key, s in H.GPU_SPECS.items():
        assert "datasheet" in s.sources, key
        assert s.fp16_tensor > s.fp32 and s.dram_bandwidth > s.pcie_bandwidth, key
        assert s.smem_per_sm < s.l1_smem_per_sm and s.l2_bytes > s.l1_smem_per_sm, key
        if s.tf32_tensor is not None:
            assert s.fp32 < s.tf32_tensor < s.fp16_tensor, key
    assert H.GPU_SPECS["A100-80GB"].dram_bandwidth > H.GPU_SPECS["A100-40GB"].dram_bandwidth


@pytest.mark.parametrize("name,total,key", [
    ("Tesla T4", None, "T4-16GB"), ("NVIDIA L4", None, "L4-24GB"), ("NVIDIA L40S", None, None),
    ("NVIDIA A100-SXM4-80GB", None, "A100-80GB"), ("NVIDIA A100-SXM4-40GB", 40 * 2**30, "A100-40GB"),
    ("NVIDIA A100-PCIE-40GB", None, None), ("NVIDIA H100 80GB HBM3", None, "H100-80GB"),
    ("NVIDIA H100 PCIe", None, None), ("Tesla V100-SXM2-32GB", None, "V100-32GB"), ("AMD Radeon", None, None)])
def test_match_gpu_spec(name, total, key):
    assert H.match_gpu_spec(name, total) == key


def test_pcie_bandwidth():
    assert H.pcie_bandwidth(3) == pytest.approx(15.7538e9, rel=1e-4)
    assert H.pcie_bandwidth(4) == 2 * H.pcie_bandwidth(3) == 4 * H.pcie_bandwidth(3, lanes=8)
    assert 2 * H.pcie_bandwidth(5) < H.GPU_SPECS["H100-80GB"].pcie_bandwidth   # data sheets ignore encoding


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call,exc,match", [
    (lambda: H.matmul_cost((4, 5), (6, 3)), ValueError, "inner dimensions"),
    (lambda: H.matmul_cost((5,), (5, 3)), ValueError, "a_shape"),
    (lambda: H.matmul_cost((2, 4, 5), (3, 5, 3)), ValueError, "broadcast"),
    (lambda: H.matmul_cost((4, 0), (0, 3)), ValueError, "a_shape"),
    (lambda: H.elementwise_cost((4, 4), n_inputs=0), ValueError, "n_inputs"),
    (lambda: H.elementwise_cost((4, 4), "fp13"), ValueError, "dtype"),
    (lambda: H.softmax_cost("4x4"), ValueError, "shape"),
    (lambda: H.layer_norm_cost((4, 4), affine="yes"), TypeError, "affine"),
    (lambda: H.attention_cost(1, 1, 0, 8), ValueError, "seq"),
    (lambda: H.roofline(-1, 10, "A100-80GB"), ValueError, "flops"),
    (lambda: H.roofline(10, 0, "A100-80GB"), ValueError, "nbytes"),
    (lambda: H.roofline("10", 10, "A100-80GB"), TypeError, "flops"),
    (lambda: H.roofline(float("nan"), 10, "A100-80GB"), ValueError, "flops"),
    (lambda: H.roofline(10, 10, "A100"), ValueError, "unknown GPU"),
    (lambda: H.roofline(10, 10, 100), TypeError, "spec"),
    (lambda: H.roofline(10, 10, "A100-80GB", tensor_cores="yes"), TypeError, "tensor_cores"),
    (lambda: H.peak_flops("A100-80GB", True, torch.int8), ValueError, "dtype"),
    (lambda: H.pcie_bandwidth(6), ValueError, "gen"),
    (lambda: H.match_gpu_spec(None), TypeError, "device_name"),
    (lambda: H.time_fn(42), TypeError, "fn"),
    (lambda: H.time_fn(lambda: None, repeats=0), ValueError, "repeats"),
    (lambda: H.time_fn(lambda: None, device="tpu"), ValueError, "device"),
    (lambda: H.time_fn(lambda: None, device="meta"), ValueError, "device"),
    (lambda: H.copy_bandwidth(3), ValueError, "nbytes"),
    (lambda: H.copy_bandwidth(4096, stat="mean"), ValueError, "stat"),
    (lambda: H.matmul_throughput(0), ValueError, "n"),
    (lambda: H.transfer_bandwidth(4096, direction="up"), ValueError, "direction"),
])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_only_helpers_say_so_without_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        H.transfer_bandwidth(4096)
    with pytest.raises(ValueError, match="cuda"):
        H.time_fn(lambda: None, device="cuda")


# ----------------------------------------------------------------------------- timing and bandwidth
def test_time_fn_keeps_the_cold_call_apart():
    calls = []

    def slow_first():
        time.sleep(0.03 if not calls else 0.001)
        calls.append(1)

    t = H.time_fn(slow_first, warmup=1, repeats=3, min_sample_s=0.002)
    assert t.first >= 0.03 and len(t.times) == 3
    assert 0.001 <= t.median < 0.02 < t.first          # the warm median is not the cold call
    assert "median" in str(t)


def test_time_fn_lengthens_samples_of_fast_functions():
    t = H.time_fn(lambda: None, repeats=3, min_sample_s=0.02)
    assert t.inner >= 16                                 # a no-op is run many times per sample
    assert t.median < 1e-3


def test_bandwidth_and_flops_conventions(monkeypatch):
    # the byte and FLOP counts and the statistic, with the timer replaced by fixed samples
    fake = H.Timing(first=1.0, times=[2e-3, 1e-3, 4e-3], inner=1, device="cpu")
    monkeypatch.setattr(timing, "time_fn", lambda *a, **k: fake)
    assert H.copy_bandwidth(1 << 20) == pytest.approx(2 * 2**20 / 2e-3 / 1e9)       # read + write, median, GB/s
    assert H.copy_bandwidth(1 << 20, stat="min") == pytest.approx(2 * 2**20 / 1e-3 / 1e9)
    passes = (64 << 20) // (1 << 16)
    assert H.read_bandwidth(1 << 16) == pytest.approx(passes * 2**16 / 2e-3 / 1e9)  # every pass counted
    assert H.matmul_throughput(64) == pytest.approx(2 * 64**3 / 2e-3)                 # FLOP/s


def test_measurements_are_plausible_on_cpu():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # one core: a busy machine cannot stall a second OpenMP thread
    try:
        assert 1e-3 < H.copy_bandwidth(1 << 20, stat="min") < 1e4        # GB/s
        assert 1e-3 < H.read_bandwidth(1 << 16, total_bytes=1 << 22, stat="min") < 1e4
        assert 1e6 < H.matmul_throughput(64, repeats=3, stat="min") < 1e14  # FLOP/s
    finally:
        torch.set_num_threads(threads)
    caches = H.cpu_cache_sizes()
    assert all(isinstance(v, int) and v > 0 for v in caches.values())
    if {"L1d", "L2"} <= caches.keys():
        assert caches["L1d"] <= caches["L2"]


@pytest.mark.gpu
@needs_cuda
def test_cuda_measurements_are_plausible():
    assert H.copy_bandwidth(256 << 20, "cuda") > 100                  # GB/s: any GPU's DRAM
    assert H.transfer_bandwidth(64 << 20, "h2d", pinned=True) > 1
    t = H.time_fn(lambda: torch.ones(1 << 20, device="cuda").sum(), "cuda")
    assert 0 < t.median < t.first
    key = H.match_gpu_spec(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
    if key is not None:
        assert H.copy_bandwidth(256 << 20, "cuda", stat="min") < 1.05 * H.GPU_SPECS[key].dram_bandwidth / 1e9
