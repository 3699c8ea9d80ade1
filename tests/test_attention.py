"""memlab.attention: the naive reference, the tiled forward, the byte formulas
against the tracker, the KV cache, backend reports, and bad input."""

from __future__ import annotations

import math
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import memlab
from memlab.attention import (LLAMA_SHAPES, attention_bytes, attention_with_fallback, dtype_bytes,
                              flash_attn_status, kv_cache_bytes, llama_param_count, naive_attention,
                              sdpa_backend, sdpa_backends, tiled_attention)

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def _qkv(*shape_q, t_k=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    *lead, t_q, d = shape_q
    t_k = t_q if t_k is None else t_k
    q = torch.randn(*lead, t_q, d, generator=g, dtype=dtype)
    k = torch.randn(*lead, t_k, d, generator=g, dtype=dtype)
    v = torch.randn(*lead, t_k, d, generator=g, dtype=dtype)
    return q, k, v


# ----------------------------------------------------------------------------- the reference
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape_q,t_k", [((2, 3, 37, 16), None), ((2, 3, 20, 16), 45), ((2, 3, 45, 8), 20),
                                         ((5, 17, 8), None), ((2, 2, 2, 33, 8), None)])
def test_naive_matches_sdpa(shape_q, t_k, causal):
    q, k, v = _qkv(*shape_q, t_k=t_k)
    got = naive_attention(q, k, v, is_causal=causal)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-12, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("causal", [False, True])
def test_naive_logsumexp_is_the_row_normaliser(causal):
    q, k, v = _qkv(2, 3, 30, 8, t_k=50)
    out, lse = naive_attention(q, k, v, is_causal=causal, return_lse=True)
    assert lse.shape == (2, 3, 30)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    if causal:          # top-left aligned: query i sees keys 0..i
        s = s.masked_fill(torch.ones(30, 50, dtype=torch.bool).tril().logical_not(), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-12)
    assert torch.allclose(out, torch.exp(s - lse.unsqueeze(-1)) @ v, atol=1e-12)
    assert torch.isfinite(lse).all()


def test_naive_scale_and_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 12, 4))
    naive_attention(q, k, v, scale=0.3).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v, scale=0.3).square().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        assert torch.allclose(g, t.grad, atol=1e-10)


# ----------------------------------------------------------------------------- the tiled forward
@pytest.mark.parametrize("shape_q,t_k,bq,bk", [((2, 3, 64, 16), None, 16, 16), ((1, 2, 100, 8), None, 32, 24),
                                               ((2, 2, 10, 8), 77, 64, 16), ((3, 50, 8), None, 7, 200)])
def test_tiled_matches_sdpa(shape_q, t_k, bq, bk):
    q, k, v = _qkv(*shape_q, t_k=t_k)
    got = tiled_attention(q, k, v, bq, bk)
    assert torch.allclose(got, F.scaled_dot_product_attention(q, k, v), atol=1e-12)


def test_tiled_forward_memory_does_not_grow_with_t_squared():
    def peak(T):
        q, k, v = _qkv(1, 2, T, 16, dtype=torch.float32)
        tr = memlab.MemoryTracker(timeline=False)
        with torch.no_grad(), tr:
            tiled_attention(q, k, v, 64, 64)
        return tr.peak
    small, large = peak(128), peak(512)
    assert large < 4 * small, (small, large)           # naive would be about 16x
    assert large < attention_bytes(1, 2, 512, 16)["scores"]


def test_lesson_cell_defines_the_same_tiled_attention():
    """The lesson shows the loop in a cell; memlab's copy (used by the benchmark) must compute the same."""
    nb = nbformat.read(ROOT / "lessons" / "05_efficient_attention.ipynb", as_version=4)
    src = [c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("def tiled_attention(")]
    assert len(src) == 1, "the lesson must define tiled_attention in exactly one cell"
    ns = {"torch": torch}
    exec(src[0], ns)
    for shape_q, t_k in (((2, 3, 100, 8), None), ((1, 2, 30, 4), 70)):
        q, k, v = _qkv(*shape_q, t_k=t_k)
        assert torch.equal(ns["tiled_attention"](q, k, v, 16, 24), tiled_attention(q, k, v, 16, 24))


# ----------------------------------------------------------------------------- formulas vs the tracker
def _kept(fn, B, H, T, d, dtype=torch.float32):
    q, k, v = (torch.randn(B, H, T, d, dtype=dtype, requires_grad=True) for _ in range(3))
    tr = memlab.MemoryTracker(timeline=False)
    with tr:
        out = fn(q, k, v)
        kept = tr.current
    del out
    return kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_bytes_match_the_tracker(dtype):
    B, H, T, d = 2, 3, 64, 16
    pred = attention_bytes(B, H, T, d, dtype=dtype)
    e = dtype_bytes(dtype)
    assert pred["probs"] == pred["scores"] == B * H * T * T * e
    assert _kept(naive_attention, B, H, T, d, dtype) == pred["saved_naive"] + pred["out"]
    assert _kept(lambda q, k, v: naive_attention(q, k, v, is_causal=True), B, H, T, d, dtype) == \
        pred["saved_naive"] + pred["out"] + T * T                       # the bool mask masked_fill keeps
    # PyTorch's CPU flash kernel keeps out + an fp32 logsumexp per row
    assert _kept(F.scaled_dot_product_attention, B, H, T, d, dtype) == pred["saved_fused"]


def test_attention_bytes_with_dropout_on_cpu():
    B, H, T, d = 1, 2, 48, 8
    def with_dropout(q, k, v):
        p = F.dropout(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1), 0.1, training=True)
        return p @ v
    pred = attention_bytes(B, H, T, d, dropout=True, mask_bytes=4)    # CPU: fp32 noise tensor as the mask
    assert _kept(with_dropout, B, H, T, d) == pred["saved_naive"] + pred["out"]
    assert attention_bytes(B, H, T, d, dropout=True)["dropout_mask"] == B * H * T * T   # CUDA: bool mask


def test_attention_bytes_seq_k_and_the_2gb_claim():
    d = attention_bytes(8, 16, 4096, 64, dtype="fp16")
    assert d["scores"] == 2 * 2**31                                       # 2^31 elements, 2 bytes each
    assert attention_bytes(8, 16, 4096, 64, dtype=torch.float32)["probs"] == 8 * 2**30
    r = attention_bytes(1, 1, 10, 4, seq_k=30)
    assert r["scores"] == 10 * 30 * 4 and r["qkv"] == (10 + 60) * 4 * 4 and r["lse"] == 40
    assert attention_bytes(1, 1, 10, 4, dropout=True, dtype="bf16")["saved_naive"] == 100 * (2 + 1 + 2)


# ----------------------------------------------------------------------------- KV cache
def test_kv_cache_formula_vs_hand_count_and_tensors():
    s = LLAMA_SHAPES["Llama-2-7B"]
    assert kv_cache_bytes(s["n_layer"], s["n_kv_head"], s["head_dim"], seq=1) == 2 * 32 * 4096 * 2  # 512 KiB
    g = LLAMA_SHAPES["Llama-3-8B"]
    assert kv_cache_bytes(g["n_layer"], g["n_kv_head"], g["head_dim"], seq=1) * 4 == 2 * 32 * 4096 * 2
    L, Hkv, hd, T, B = 3, 2, 8, 50, 4
    cache = [torch.empty(2, B, Hkv, T, hd, dtype=torch.float16, device="meta") for _ in range(L)]
    assert kv_cache_bytes(L, Hkv, hd, T, batch=B, dtype="fp16") == sum(c.numel() * c.element_size() for c in cache)


def test_llama_param_counts():
    assert llama_param_count(**LLAMA_SHAPES["Llama-2-7B"]) == 6_738_415_616
    assert llama_param_count(**LLAMA_SHAPES["Llama-3-8B"]) == 8_030_261_248
    assert 68.9e9 < llama_param_count(**LLAMA_SHAPES["Llama-2-70B"]) < 69.1e9


# ----------------------------------------------------------------------------- which kernel runs
def test_sdpa_backend_reports_the_cpu_kernel_and_a_forced_math():
    q, k, v = _qkv(1, 2, 32, 8, dtype=torch.float32)
    assert sdpa_backend(q, k, v).backend == "flash_attention"
    assert "flash" in sdpa_backend(q, k, v).op
    with sdpa_kernel(SDPBackend.MATH):
        assert sdpa_backend(q, k, v).backend == "math"
    status = sdpa_backends(q, k, v)
    assert set(status) == {"math", "flash_attention", "efficient_attention", "cudnn_attention"}
    assert status["math"] == "runs" and status["efficient_attention"] != "runs"


def test_flash_attn_fallback_on_cpu():
    ok, why = flash_attn_status("cpu")
    assert not ok and "cpu" in why
    q, k, v = _qkv(1, 2, 16, 8, dtype=torch.float32)
    out, path = attention_with_fallback(q, k, v, is_causal=True)
    assert path.startswith("SDPA fallback")
    assert torch.allclose(out, naive_attention(q, k, v, is_causal=True), atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fallback_on_cuda_matches_the_reference():
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out, path = attention_with_fallback(q, k, v, is_causal=True)
    ok, _ = flash_attn_status("cuda")
    assert path.startswith("flash-attn") == ok
    ref = naive_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (out.float() - ref).abs().max() < 1e-2


# ----------------------------------------------------------------------------- bad input
def test_bad_input():
    q, k, v = _qkv(1, 2, 8, 4)
    with pytest.raises(ValueError, match="last dimension"):
        naive_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="T_k"):
        naive_attention(q, k, v[..., :5, :])
    with pytest.raises(ValueError, match="broadcast"):
        naive_attention(q, torch.randn(3, 3, 8, 4, dtype=q.dtype), torch.randn(3, 3, 8, 4, dtype=q.dtype))
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        naive_attention([1.0], k, v)
    with pytest.raises(TypeError, match="floating"):
        naive_attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="share dtype"):
        naive_attention(q.float(), k, v)
    with pytest.raises(ValueError, match="shape"):
        naive_attention(q[0, 0, 0], k, v)
    with pytest.raises(TypeError, match="is_causal"):
        naive_attention(q, k, v, is_causal=1)
    with pytest.raises(ValueError, match="scale"):
        naive_attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="block_q"):
        tiled_attention(q, k, v, block_q=0)
    with pytest.raises(ValueError, match="seq"):
        attention_bytes(1, 1, 0, 4)
    with pytest.raises(ValueError, match="batch"):
        attention_bytes(True, 1, 4, 4)
    with pytest.raises(ValueError, match="dtype"):
        attention_bytes(1, 1, 4, 4, dtype="fp8")
    with pytest.raises(TypeError, match="dtype"):
        dtype_bytes(torch.int8)
    with pytest.raises(TypeError, match="dropout"):
        attention_bytes(1, 1, 4, 4, dropout="yes")
    with pytest.raises(ValueError, match="mask_bytes"):
        attention_bytes(1, 1, 4, 4, dropout=True, mask_bytes=0)
    with pytest.raises(ValueError, match="n_kv_head"):
        kv_cache_bytes(32, 0, 128, 100)
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        llama_param_count(**dict(LLAMA_SHAPES["Llama-3-8B"], n_kv_head=5))
    with pytest.raises(TypeError, match="device"):
        flash_attn_status(3)
    with pytest.raises(ValueError, match=r"\(B, H, T, d\)"):
        attention_with_fallback(q[0], k[0], v[0])


# ----------------------------------------------------------------------------- HBM traffic (lesson 05, section 6)
def test_attention_io_counts_by_hand():
    from memlab.attention_io import attention_io
    from memlab.hardware.hierarchy import attention_cost
    N, d, sram, e = 4096, 64, 192 * 1024, 2                       # the A100's SRAM per SM, bf16
    std = attention_io(N, d, algorithm="standard")
    assert std["total"] == (4 * N * d + 4 * N * N) * e == attention_cost(1, 1, N, d, "bf16").bytes
    M = sram // e
    b_c, b_r = math.ceil(M / (4 * d)), min(math.ceil(M / (4 * d)), d)
    assert (b_c, b_r) == (384, 64)
    f1 = attention_io(N, d, sram, algorithm="flash1")
    t_c = math.ceil(N / b_c)
    # init O, l, m; K and V once; per key block read Q, O, l, m and write O, l, m (l, m in fp32)
    assert f1["total"] == (N * d + 2 * N * d + t_c * 3 * N * d) * e + (2 * N + t_c * 4 * N) * 4
    f2 = attention_io(N, d, sram, algorithm="flash2")
    assert f2["total"] == (2 * N * d + 2 * t_c * N * d) * e
    assert f2["block_c"] == b_c and f2["block_r"] == b_r and f2["sram_elements"] == M
    # Theta(N^2 d^2 / M): doubling M about halves the flash traffic, the standard count does not move
    big = attention_io(N, d, 2 * sram, algorithm="flash2")
    assert 0.45 < big["total"] / f2["total"] < 0.6
    assert attention_io(N, d, 2 * sram, algorithm="standard") == std


@pytest.mark.parametrize("N,d,sram,dtype", [(1000, 64, 192 * 1024, torch.bfloat16), (777, 32, 96 * 1024, torch.float32),
                                            (300, 16, 4 * 1024, torch.float32)])
def test_hbm_counter_measures_the_flash2_count_on_tiled_attention(N, d, sram, dtype):
    from memlab.attention_io import HBMCounter, attention_io
    pred = attention_io(N, d, sram, algorithm="flash2", dtype=dtype)
    nb = nbformat.read(ROOT / "lessons" / "05_efficient_attention.ipynb", as_version=4)
    ns = {"torch": torch}
    exec(next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("def tiled_attention(")), ns)
    for fn in (tiled_attention, ns["tiled_attention"]):             # memlab's copy and the lesson's cell
        q, k, v = _qkv(1, 2, N, d, dtype=dtype)
        with HBMCounter() as io, torch.no_grad():
            out = fn(q, k, v, pred["block_c"], pred["block_r"])
        got = {"q": io.bytes_read(q), "k": io.bytes_read(k), "v": io.bytes_read(v), "o": io.bytes_written(out)}
        assert got == {t: 2 * pred[t] for t in got}, (got, pred)   # 2 heads
        assert io.bytes_written(q) == 0 and io.bytes_read(out) == 0


def test_hbm_counter_on_naive_attention_and_basic_ops():
    from memlab.attention_io import HBMCounter, attention_io
    q, k, v = _qkv(1, 1, 100, 8, dtype=torch.float32)
    with HBMCounter() as io:
        out = naive_attention(q, k, v)
    std = attention_io(100, 8, algorithm="standard", dtype=torch.float32)["total"]
    assert io.total_read + io.total_written == std + 2 * 100 * 100 * 4      # + the separate `* scale` pass
    assert io.bytes_read(q) == io.bytes_read(k) == io.bytes_read(v) == io.bytes_written(out) == 100 * 8 * 4
    x = torch.randn(10, 4)
    with HBMCounter() as io:
        y = x[:5] * 2                       # reads 5 rows of x, writes y
        z = torch.empty(3, 4)               # allocates, writes nothing
        z.copy_(x[:3])                      # writes z, reads 3 rows of x
        w = x[:1].expand(10, 4) + 1         # a broadcast row is read once
        t = x.t()                           # a view moves nothing
    assert io.bytes_read(x) == (5 + 3 + 1) * 16
    assert (io.bytes_written(y), io.bytes_written(z), io.bytes_read(z), io.bytes_written(w)) == (80, 48, 0, 160)
    assert io.bytes_read(t) == io.bytes_read(x)                     # counts are per storage
    with pytest.raises(TypeError, match="tensor"):
        io.bytes_read([1.0])


def test_attention_io_bad_input():
    from memlab.attention_io import attention_io
    with pytest.raises(ValueError, match="seq"):
        attention_io(0, 64, 1024)
    with pytest.raises(ValueError, match="head_dim"):
        attention_io(10, True, 1024)
    with pytest.raises(ValueError, match="algorithm"):
        attention_io(10, 64, 1024, algorithm="flash3")
    with pytest.raises(ValueError, match="sram"):
        attention_io(10, 64, algorithm="flash1")
    with pytest.raises(ValueError, match="sram"):
        attention_io(10, 64, 100, algorithm="flash2")
    with pytest.raises(ValueError, match="dtype"):
        attention_io(10, 64, 1024, dtype="fp8")
