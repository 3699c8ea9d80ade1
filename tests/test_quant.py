"""memlab.quant and memlab.quant.qlora: byte formulas against real bitsandbytes tensors,
the 4-bit stand-in against the real Linear4bit, LoRA counts against peft, the QLoRA
estimator against measured steps, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

import memlab
from memlab.quant import llama as LL
from memlab.quant import qlora as QL
from memlab import quant as Q
from memlab.core.models import tiny_llama_config

bnb = pytest.importorskip("bitsandbytes")
bnbF = pytest.importorskip("bitsandbytes.functional")
LL.silence_libraries()


# ----------------------------------------------------------------------------- formulas vs bitsandbytes
def test_bits_per_param_are_the_papers():
    assert Q.bits_per_param() == 4.5                                   # 4 + 32/64
    assert Q.bits_per_param(double_quant=True) == 4 + 8 / 64 + 32 / (64 * 256)
    assert round(Q.bits_per_param(double_quant=True), 3) == 4.127      # QLoRA section 3


@pytest.mark.parametrize("shape", [(64, 64), (344, 128), (7, 100), (1, 1), (3, 257), (1000, 333)])
@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_nf4_bytes_equal_real_quant_state(shape, dq, quant_type):
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=torch.bfloat16)
    packed, qs = bnbF.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=dq)
    measured = Q.quant_state_bytes(packed, qs)
    assert measured == Q.nf4_bytes(w.numel(), 64, dq), (shape, dq, measured)


def test_measured_bits_per_param_approach_the_formula():
    w = torch.randn(256, 4096) * 0.02
    for dq in (False, True):
        rt = Q.bnb_roundtrip(w, "nf4", double_quant=dq)
        assert abs(rt.bits_per_param - Q.bits_per_param(double_quant=dq)) < 1e-3, (dq, rt.bits_per_param)


def test_adam8bit_state_bytes_equal_bitsandbytes():
    for shape in [(1024, 1024), (300, 70), (8, 128), (5000,)]:
        p = torch.nn.Parameter(torch.randn(shape))
        opt = bnb.optim.AdamW8bit([p], lr=1e-3)
        p.grad = torch.randn(shape)
        opt.step()
        st = opt.state[p]
        got = sum(v.numel() * v.element_size() for k, v in st.items()
                  if isinstance(v, torch.Tensor) and not k.startswith("qmap"))
        assert got == Q.adam8bit_state_bytes(p.numel()), (shape, got)


# ----------------------------------------------------------------------------- quantization error
def test_roundtrips_error_and_cost():
    torch.manual_seed(0)
    w = torch.randn(512, 512) * 0.02
    per_tensor = Q.absmax_roundtrip(w, 8)
    blocked = Q.absmax_roundtrip(w, 8, blocksize=64)
    assert blocked.x_hat.shape == w.shape and blocked.x_hat.dtype == w.dtype
    assert Q.relative_error(w, blocked.x_hat) < Q.relative_error(w, per_tensor.x_hat) < 0.02
    assert blocked.bits_per_param == 8 + 32 / 64
    w_out = w.clone()
    w_out[0, 0] = 1.0                                                  # one outlier, 50 sigma
    assert Q.relative_error(w_out, Q.absmax_roundtrip(w_out, 8).x_hat) > 0.1
    assert Q.relative_error(w_out, Q.absmax_roundtrip(w_out, 8, blocksize=64).x_hat) < 0.02
    shifted = torch.rand(1000) + 5.0                                   # all positive: absmax wastes half the grid
    assert Q.relative_error(shifted, Q.zeropoint_roundtrip(shifted, 4).x_hat) < \
        Q.relative_error(shifted, Q.absmax_roundtrip(shifted, 4).x_hat)
    odd = torch.randn(100)                                             # a last, partial block
    assert Q.absmax_roundtrip(odd, 4, blocksize=64).x_hat.shape == (100,)


def test_nf4_beats_int4_and_fp4_on_normal_weights():
    torch.manual_seed(0)
    w = torch.randn(256, 1024) * 0.02
    err = {k: Q.relative_error(w, rt.x_hat) for k, rt in {
        "int4": Q.absmax_roundtrip(w, 4, blocksize=64), "fp4": Q.bnb_roundtrip(w, "fp4"),
        "nf4": Q.bnb_roundtrip(w, "nf4")}.items()}
    assert err["nf4"] < err["fp4"] and err["nf4"] < err["int4"], err


# ----------------------------------------------------------------------------- the stand-in
def _real_linear4bit(n_in, n_out, dq):
    w = torch.randn(n_out, n_in, dtype=torch.bfloat16)
    layer = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=dq)
    layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=dq)
    return layer.to("cpu")


def _fwd_bwd(layer, n_in):
    x = torch.randn(2, 16, n_in, requires_grad=True)
    tr = memlab.MemoryTracker(layer, timeline=True)
    with tr:
        memlab.watch(tensors=LL.quant_tensors(layer), category="parameters")
        start = tr.current
        with memlab.phase("forward"):
            y = layer(x * 1.0)
        kept = tr.current - start
        with memlab.phase("backward"):
            y.sum().backward()
    backward_events = [delta for _, ph, _, delta in tr._events if ph == "backward"]
    return (start, kept, backward_events, y.dtype, x.grad.shape), tr.phase_peaks["forward"]["total"]


@pytest.mark.parametrize("n_in,n_out", [(128, 344), (344, 128), (100, 7)])
@pytest.mark.parametrize("dq", [True, False])
def test_standin_bytes_equal_real_linear4bit(n_in, n_out, dq):
    """Stored bytes, what the forward keeps, and every allocation of the backward are equal. In
    the forward, bitsandbytes' CPU kernel dequantizes inside one registered op, out of the
    tracker's sight; the stand-in makes those temporaries visibly, as CUDA's fallback path does."""
    torch.manual_seed(0)
    real, stand = _real_linear4bit(n_in, n_out, dq), Q.Linear4bitStandIn(n_in, n_out, double_quant=dq)
    assert LL.stored_bytes(real) == LL.stored_bytes(stand)
    assert LL.stored_bytes(stand)["quantized"] + LL.stored_bytes(stand)["constants"] == \
        sum(Q.nf4_bytes(n_in * n_out, double_quant=dq).values())
    (same_real, fwd_real), (same_stand, fwd_stand) = _fwd_bwd(real, n_in), _fwd_bwd(stand, n_in)
    assert same_real == same_stand
    hidden = n_in * n_out * 2 + (2 * 4 * -(-n_in * n_out // 64) if dq else 0)
    assert 0 <= fwd_stand - fwd_real <= hidden


# ----------------------------------------------------------------------------- models and LoRA counts
@pytest.fixture(scope="module")
def nf4_model():
    return LL.tiny_llama("nf4", dtype=torch.bfloat16)


def test_tiny_nf4_model_bytes(nf4_model):
    sb = LL.stored_bytes(nf4_model)
    cfg = nf4_model.config
    want = cfg.num_hidden_layers * sum(sum(Q.nf4_bytes(i * o).values()) for i, o in QL.projection_shapes(cfg).values())
    assert sb["quantized"] + sb["constants"] == want
    counts = QL.llama_param_count(cfg)
    assert sb["trainable"] + sb["frozen"] == 2 * (counts["embed"] + counts["lm_head"] + counts["norms"])   # bf16
    tr = memlab.MemoryTracker(nf4_model)
    with tr:
        memlab.watch(tensors=LL.quant_tensors(nf4_model), category="parameters")
        assert tr.current == sb["total"]
    assert nf4_model.get_memory_footprint() < sb["total"]              # transformers leaves out the QuantStates


def test_llama_param_count_matches_models():
    from transformers import LlamaForCausalLM
    for cfg in (tiny_llama_config(), tiny_llama_config(num_key_value_heads=2, tie_word_embeddings=True),
                QL.llama_7b_config()):
        with torch.device("meta"):
            m = LlamaForCausalLM(cfg)
        assert QL.llama_param_count(cfg)["total"] == sum(p.numel() for p in m.parameters())
    assert QL.llama_param_count(QL.llama_7b_config())["total"] == 6_738_415_616


def test_one_llama_counter_matches_transformers_on_meta():
    # memlab.core.estimate.llama_param_groups is the one Llama counter: memlab.attention's (by shapes) and
    # memlab.quant.qlora's (by config) are it, and all three equal a real LlamaForCausalLM built on meta
    from transformers import LlamaForCausalLM
    from memlab.core import estimate as E
    from memlab.attention import llama_param_count
    for kw in ({}, dict(num_key_value_heads=2), dict(num_key_value_heads=1, tie_word_embeddings=True),
               dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=200)):
        cfg = tiny_llama_config(**kw)
        with torch.device("meta"):
            m = LlamaForCausalLM(cfg)
        real = sum(p.numel() for p in m.parameters())                # tied: the shared weight counts once
        C, H, kvh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        shape = dict(n_layer=cfg.num_hidden_layers, n_head=H, n_kv_head=kvh, head_dim=C // H, hidden=C,
                     ffn=cfg.intermediate_size, vocab=cfg.vocab_size)
        groups = E.llama_param_groups(**shape, tied=cfg.tie_word_embeddings)
        assert groups["total"] == real, kw
        assert groups["norms"] == sum(p.numel() for n, p in m.named_parameters() if "norm" in n)
        assert QL.llama_param_count(cfg) == groups
        if not cfg.tie_word_embeddings:
            assert llama_param_count(**shape) == real
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        E.llama_param_groups(1, 4, 3, 8, 32, 64, 10)
    with pytest.raises(TypeError, match="tied"):
        E.llama_param_groups(1, 4, 2, 8, 32, 64, 10, tied=1)


@pytest.mark.parametrize("r,targets", [(8, QL.ATTENTION), (4, QL.PROJECTIONS), (3, ("q_proj", "down_proj"))])
def test_lora_param_count_matches_peft(r, targets):
    from peft import LoraConfig, get_peft_model
    cfg = tiny_llama_config(num_key_value_heads=2)
    model = LL.tiny_llama(num_key_value_heads=2)
    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    trainable, total = pm.get_nb_trainable_parameters()
    assert trainable == QL.lora_param_count(cfg, r, targets)
    assert total == QL.llama_param_count(cfg)["total"] + trainable


def test_peft_counts_4bit_weights_as_unpacked():
    from peft import LoraConfig, get_peft_model
    model = LL.tiny_llama("nf4", dtype=torch.bfloat16)
    cfg, counts = model.config, QL.llama_param_count(model.config)
    packed = sum(p.numel() for p in model.parameters())          # Params4bit.numel() counts bytes: 2 weights each
    assert packed == counts["total"] - counts["projections"] // 2
    pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(QL.ATTENTION)))
    trainable, total = pm.get_nb_trainable_parameters()
    assert trainable == QL.lora_param_count(cfg, 8, QL.ATTENTION)
    assert total == counts["total"] + trainable                   # peft doubles the packed count back


# ----------------------------------------------------------------------------- QLoRA step: real, stand-in, estimator
def _qlora_step(model):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tr = memlab.MemoryTracker(model, opt)
    with tr:
        memlab.watch(tensors=LL.quant_tensors(model), category="parameters")
        ids = torch.randint(0, 256, (2, 32))
        with memlab.phase("forward"):
            loss = model(input_ids=ids, labels=ids).loss
        acts = tr.breakdown()["activations"]
        with memlab.phase("backward"):
            loss.backward()
        grads = tr.breakdown()["gradients"]
        del loss
        with memlab.phase("step"):
            opt.step()
        after = tr.breakdown()
        opt.zero_grad(set_to_none=True)
    return dict(parameters=after["parameters"], gradients=grads, optimizer=after["optimizer"], activations=acts,
                peak=tr.peak)


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_qlora_step_real_equals_standin_and_estimator(ckpt, dropout):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    targets = list(QL.PROJECTIONS) if dropout else list(QL.ATTENTION)
    real = LL.tiny_llama("nf4", dtype=torch.bfloat16)
    real = prepare_model_for_kbit_training(real, use_gradient_checkpointing=ckpt,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})
    real = get_peft_model(real, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=targets)).train()
    stand = LL.finetune_llama(tiny_llama_config(), "qlora", r=8, targets=targets, lora_dropout=dropout,
                              checkpointing=ckpt)
    got_real, got_stand = _qlora_step(real), _qlora_step(stand)
    peak_real, peak_stand = got_real.pop("peak"), got_stand.pop("peak")
    assert got_real == got_stand
    # the stand-in also shows the dequantization temporaries bitsandbytes' CPU kernel hides inside one op
    cfg = tiny_llama_config()
    assert 0 <= peak_stand - peak_real <= 2 * cfg.hidden_size * cfg.intermediate_size + 2 * 4 * 1024
    est = QL.qlora_bytes(cfg, r=8, targets=targets, batch=2, seq=32, checkpointing=ckpt,
                         lora_dropout=dropout, mask_bytes=4)
    for k in ("parameters", "gradients", "optimizer", "activations"):
        assert got_real[k] == getattr(est, k), k
    assert -0.02 < (est.peak - peak_stand) / peak_stand < 0.10, (est, peak_stand)   # errs high with MLP adapters


def test_estimator_equals_fake_run_at_7b_shapes():
    """Two Llama-2-7B layers on fake tensors (exact bytes, no rounding): activations exact."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = QL.llama_7b_config(num_hidden_layers=2)
    for ckpt in (False, True):
        with FakeTensorMode():
            m = LL.finetune_llama(cfg, "qlora", r=16, targets=QL.ATTENTION, lora_dropout=0.05, checkpointing=ckpt)
            tr = memlab.MemoryTracker(m)
            with tr:
                ids = torch.randint(0, cfg.vocab_size, (1, 128))
                with memlab.phase("forward"):
                    loss = m(input_ids=ids, labels=ids).loss    # alive: what the backward would keep
                acts = tr.breakdown()["activations"]
                del loss
        est = QL.qlora_bytes(cfg, r=16, targets=QL.ATTENTION, seq=128, checkpointing=ckpt, lora_dropout=0.05,
                             mask_bytes=4)
        assert acts == est.activations
        assert tr.breakdown()["parameters"] == est.parameters


# ----------------------------------------------------------------------------- bad input
def test_bad_input():
    cfg = tiny_llama_config()
    cases = [
        (lambda: Q.bits_per_param(blocksize=0), ValueError),
        (lambda: Q.bits_per_param(double_quant="yes"), TypeError),
        (lambda: Q.nf4_bytes(0), ValueError),
        (lambda: Q.quant_state_bytes([1], None), TypeError),
        (lambda: Q.adam8bit_state_bytes(-1), ValueError),
        (lambda: Q.absmax_roundtrip(torch.arange(10), 8), TypeError),
        (lambda: Q.absmax_roundtrip(torch.randn(10), 1), ValueError),
        (lambda: Q.zeropoint_roundtrip(torch.randn(10), 8, blocksize=0), ValueError),
        (lambda: Q.bnb_roundtrip(torch.randn(64), "int4"), ValueError),
        (lambda: Q.relative_error(torch.randn(3), torch.randn(4)), ValueError),
        (lambda: Q.Linear4bitStandIn(8, 8, bias=True), ValueError),
        (lambda: Q.Linear4bitStandIn(0, 8), ValueError),
        (lambda: Q.Linear4bitStandIn(8, 8, compute_dtype=torch.int8), ValueError),
        (lambda: LL.stored_bytes("model"), TypeError),
        (lambda: LL.quant_tensors(None), TypeError),
        (lambda: QL.projection_shapes({"hidden_size": 8}), TypeError),
        (lambda: QL.lora_param_count(cfg, 0), ValueError),
        (lambda: QL.lora_param_count(cfg, 8, ["qkv"]), ValueError),
        (lambda: QL.lora_param_count(cfg, 8, "q_proj"), ValueError),
        (lambda: QL.qlora_bytes(cfg, targets=["down_proj"]), ValueError),
        (lambda: QL.qlora_bytes(cfg, mask_bytes=3), ValueError),
        (lambda: QL.qlora_bytes(cfg, seq=0), ValueError),
        (lambda: QL.qlora_bytes(cfg, lora_dropout=1.0), ValueError),
        (lambda: LL.tiny_llama("int3"), ValueError),
        (lambda: LL.finetune_llama(cfg, "prefix"), ValueError),
        (lambda: LL.finetune_llama(cfg, "qlora", r=0), ValueError),
        (lambda: LL.finetune_llama(cfg, "lora", lora_dropout=1.5), ValueError),
        (lambda: LL.tiny_llama(device="tpu"), ValueError),
        (lambda: LL.causal_lm_step(torch.nn.Linear(2, 2), None, torch.zeros(2, 2)), TypeError),
    ]
    for fn, exc in cases:
        with pytest.raises(exc):
            fn()
    assert math.isclose(Q.relative_error(torch.ones(4), torch.ones(4)), 0.0)


# ----------------------------------------------------------------------------- GaLore and paged state by formula
def _llama_on_meta(cfg):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("r, targets", [(8, QL.PROJECTIONS), (32, QL.ATTENTION), (128, ["down_proj"])])
def test_galore_bytes_count_every_parameter_of_a_real_llama(r, targets):
    cfg = tiny_llama_config()
    model = _llama_on_meta(cfg)
    states = 0
    for name, p in model.named_parameters():          # GaLore (section 4.2, Table 1): m <= n, 2nr + mr
        if p.dim() == 2 and name.split(".")[-2] in targets:
            m, n = sorted(p.shape)
            states += 2 * n * r + m * r
        else:
            states += 2 * p.numel()                    # ordinary Adam: two moments
    numels = [p.numel() for p in model.parameters()]
    got = QL.galore_bytes(cfg, r, targets=targets, weight_bytes=2, grad_bytes=4, state_bytes=1)
    assert got["parameters"] == 2 * sum(numels)
    assert got["gradients"] == 4 * sum(numels)
    assert got["optimizer"] == states
    assert got["total"] == got["parameters"] + got["gradients"] + got["optimizer"]
    per_layer = QL.galore_bytes(cfg, r, targets=targets, per_layer_update=True)
    assert per_layer["gradients"] == 2 * max(numels)
    assert per_layer["optimizer"] == 2 * states


def test_galore_bytes_sit_between_lora_and_full_finetuning_at_7b():
    cfg = QL.llama_7b_config()
    n = QL.llama_param_count(cfg)["total"]
    g = QL.galore_bytes(cfg, 256)
    assert g["optimizer"] < 4 * n / 8                  # far below bf16 Adam's 4 bytes per parameter
    assert 2 * 2 * n < g["total"] < 8 * n              # above weights + gradients, below full fine-tuning


def test_paged_state_bytes_follow_bitsandbytes():
    import inspect
    src = inspect.getsource(bnb.optim.optimizer.Optimizer8bit.get_state_buffer)
    assert "p.numel() < 1e5" in src and QL.PAGED_MIN_NUMEL == 100_000
    assert QL.paged_state_bytes([99_999]) == {"paged": 0, "device": 8 * 99_999}
    assert QL.paged_state_bytes([100_000]) == {"paged": 800_000, "device": 0}
    numels = [100, 4095, 4096, 65_536, 100_000, 4096 * 4096]
    eight = QL.paged_state_bytes(numels, eight_bit=True)
    assert eight["paged"] == 2 * (100_000 + 4096 * 4096)
    assert eight["paged"] + eight["device"] == sum(Q.adam8bit_state_bytes(n) for n in numels)
    assert sum(QL.paged_state_bytes(numels).values()) == 8 * sum(numels)


def test_galore_and_paged_bad_input():
    cfg = tiny_llama_config()
    cases = [
        (lambda: QL.galore_bytes(cfg, 0), ValueError),
        (lambda: QL.galore_bytes(cfg, cfg.hidden_size + 1), ValueError),
        (lambda: QL.galore_bytes(cfg, 8, targets=["qkv"]), ValueError),
        (lambda: QL.galore_bytes(cfg, 8, state_bytes=0), ValueError),
        (lambda: QL.galore_bytes(cfg, 8, per_layer_update="yes"), TypeError),
        (lambda: QL.galore_bytes({"hidden_size": 8}, 8), TypeError),
        (lambda: QL.paged_state_bytes(5), TypeError),
        (lambda: QL.paged_state_bytes([0]), ValueError),
        (lambda: QL.paged_state_bytes([10], eight_bit=1), TypeError),
        (lambda: QL.paged_state_bytes([10], min_8bit_size=0), ValueError),
    ]
    for fn, exc in cases:
        with pytest.raises(exc):
            fn()
