"""memlab.fit on every layer of the model as its config builds it: AMP with checkpointing on every shipped family,
per-layer attention types (sliding / global / chunked), mixture-of-experts layers interleaved with dense ones,
fp32 routers, encoder-decoders with their own target length and head tying. The references are real CPU steps of
the model built the ordinary way (tests/_plain_step.py) or the full-depth virtual run."""

import json
import os

import pytest
import torch

import memlab
from memlab.fitting.config import CONFIG_DIR

SHRINK = dict(hidden_size=64, n_embd=64, d_model=64, intermediate_size=128, n_inner=128, d_ff=128, vocab_size=256,
              num_attention_heads=4, n_head=4, num_heads=4, num_key_value_heads=2, head_dim=16, d_kv=16,
              num_hidden_layers=2, n_layer=2, num_layers=2, num_decoder_layers=2)


def tiny_of(preset: str) -> dict:
    """The shipped preset's config.json with its sizes cut down (same model_type and options)."""
    with open(os.path.join(CONFIG_DIR, preset + ".json")) as f:
        d = json.load(f)
    return {k: (SHRINK[k] if k in SHRINK and v is not None else v) for k, v in d.items()}


FAMILY_PRESETS = ["gpt2", "bloomz-7b1", "gemma-2b", "llama-2-7b", "mistral-7b", "qwen2.5-7b", "t5-3b"]


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_amp_with_checkpointing_runs_on_every_shipped_family(preset):
    """Checkpointing recomputes the forward in the backward; under AMP the virtual GPU's CUDA op lists must apply
    there too (memlab/fitting/model.py, _amp_recompute), or GPT-2's GELU (pow) and eager attention (softmax)
    recompute in bf16 where the forward ran fp32 and torch.utils.checkpoint raises CheckpointError."""
    cfg = tiny_of(preset)
    plain = memlab.fit(cfg, 1, seq=64, precision="amp")
    for ckpt in ("full", "selective"):
        r = memlab.fit(cfg, 1, seq=64, precision="amp", checkpointing=ckpt)
        assert r.peak > 0 and r.by_phase["backward"] > 0
        if ckpt == "full":
            assert r.by_phase["forward"] < plain.by_phase["forward"], (preset, ckpt)


def test_amp_with_checkpointing_and_eager_attention_runs_on_bert():
    bert = dict(model_type="bert", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    for ckpt in ("full", "selective"):
        assert memlab.fit(bert, 1, seq=64, precision="amp", checkpointing=ckpt, attention="eager").peak > 0
    assert torch.is_autocast_enabled("cpu") is False          # nothing left switched on


# ----------------------------------------------------------------------------- layers of several kinds
SW, FA = "sliding_attention", "full_attention"
MIXED = {
    # Gemma-3: five sliding-window layers, then one global, twice (the pattern repeats at 12 layers)
    "gemma3": dict(model_type="gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                   layer_types=[SW] * 5 + [FA] + [SW] * 5 + [FA], max_position_embeddings=512),
    # GPT-OSS: sliding and full attention alternating, every layer a mixture of experts, attention sinks
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16, num_local_experts=4,
                    num_experts_per_tok=2, layer_types=[SW, FA] * 2, max_position_embeddings=512),
    # Llama 4: MoE every second layer, chunked attention with every fourth layer global and without RoPE
    "llama4": dict(model_type="llama4_text", vocab_size=256, hidden_size=64, intermediate_size=128,
                   intermediate_size_mlp=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                   attention_chunk_size=16, max_position_embeddings=512),
    # DeepSeek-V3: two dense layers, then MoE layers with an fp32 router (gate.weight, e_score_correction_bias)
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128,
                        moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                        first_k_dense_replace=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512),
    # Qwen2-MoE: MoE every second layer (decoder_sparse_step), layer 5 forced dense (mlp_only_layers)
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=256, hidden_size=64, intermediate_size=128,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=2, mlp_only_layers=[5], max_position_embeddings=512),
}


def _real(cfg_dict, seq, dtype=torch.bfloat16):
    """Two foreach-AdamW steps of the model as a practitioner loads it: AutoModelForCausalLM.from_config(cfg,
    dtype=bf16), which keeps what the model class keeps in fp32 (its routers), real CPU tensors, counted."""
    from transformers import AutoModelForCausalLM
    from memlab.core.track import MemoryTracker
    from memlab.fitting.plan import load_config
    cfg = load_config(cfg_dict)
    trk = MemoryTracker(device="cpu", round_to=512)
    with trk:
        with memlab.phase("load"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            memlab.watch(model, opt)
        for _ in range(2):
            x = torch.randint(0, cfg.vocab_size, (1, seq))
            with memlab.phase("forward"):
                loss = model(input_ids=x, labels=x, use_cache=False).loss
            with memlab.phase("backward"):
                loss.backward()
            del loss, x
            with memlab.phase("step"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    return trk, model


@pytest.mark.parametrize("family", sorted(MIXED))
def test_layers_of_several_kinds_equal_a_real_cpu_step_to_the_byte(family):
    """Each kind of layer measured on its own (memlab/fitting/layers.py), extended over the model's own pattern:
    equal, phase by phase and category by category, to the whole model stepped on real CPU tensors at a depth
    where the pattern repeats."""
    from memlab.fitting.config import load_config
    from memlab.fitting.layers import layer_kinds
    cfg = MIXED[family]
    kinds = layer_kinds(load_config(cfg), cfg["num_hidden_layers"])
    assert kinds is not None and len(set(kinds)) > 1, f"{family}: its layers are not all alike"
    trk, _ = _real(cfg, 64)
    r = memlab.fit(cfg, 1, seq=64, optimizer="adamw")
    gaps = {ph: r.by_phase[ph] - trk.phase_peaks[ph]["total"] for ph in ("forward", "backward", "step")}
    assert gaps == dict.fromkeys(gaps, 0), f"{family}: fit - real per phase {gaps}"
    assert r.by_category == trk.peak_breakdown


def test_a_uniform_extension_would_charge_every_gemma3_layer_as_sliding(monkeypatch):
    """What the kinds fix: Gemma-3's layers 0-2 are all sliding, so extending from them (as fit did) charges its
    global layers as sliding ones. A sliding layer runs sdpa with its window's mask and keeps more for its backward
    than a global layer's causal kernel, so at seq 256 (a window of 16) that answer is too high."""
    from memlab.fitting import layers, run
    cfg = MIXED["gemma3"]
    right = memlab.fit(cfg, 1, seq=256, optimizer="adamw").by_phase["forward"]
    monkeypatch.setattr(layers, "layer_kinds", lambda cfg, depth: None)      # 2 and 3 layers, extended
    monkeypatch.setenv("MEMLAB_FIT_CACHE", "")
    run.clear_cache()
    try:
        uniform = memlab.fit(cfg, 1, seq=256, optimizer="adamw").by_phase["forward"]
    finally:
        run.clear_cache()
    assert uniform > right, (uniform, right)


def test_moe_routers_stay_in_fp32_as_from_pretrained_keeps_them():
    """DeepSeek-V3 keeps gate.weight and e_score_correction_bias in fp32 when loaded in bf16
    (_keep_in_fp32_modules_strict): their bytes, gradients and AdamW state are fp32 in fit as in the real model."""
    cfg = MIXED["deepseek_v3"]
    _, model = _real(cfg, 8)
    gates = [(n, p) for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert gates and all(p.dtype == torch.float32 for _, p in gates)
    r = memlab.fit(cfg, 1, seq=8, optimizer="adamw")
    as_bf16 = {n: p.numel() * 2 for n, p in model.named_parameters()}
    in_fp32 = sum(p.numel() * 2 for _, p in gates)                   # 2 more bytes per router weight
    rounded = sum(-(-b // 512) * 512 for b in as_bf16.values())
    assert r.model_states["parameters"] >= rounded + in_fp32 - 512 * len(gates)


# ----------------------------------------------------------------------------- encoder-decoders
MT5 = dict(model_type="mt5", vocab_size=512, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
           feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0, decoder_start_token_id=0,
           pad_token_id=0)


def _real_seq2seq(cfg_dict, seq, target_seq, untie):
    """Two foreach-AdamW bf16 steps of the seq2seq model on real CPU tensors: seq source tokens, target_seq labels;
    with untie, the head its own weight, as a checkpoint with "tie_word_embeddings": false loads it."""
    from transformers import AutoModelForSeq2SeqLM
    from memlab.core.track import MemoryTracker
    from memlab.fitting.plan import load_config
    cfg = load_config(cfg_dict)
    trk = MemoryTracker(device="cpu", round_to=512)
    with trk:
        with memlab.phase("load"):
            model = AutoModelForSeq2SeqLM.from_config(cfg)
            if untie:
                model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
            model = model.to(torch.bfloat16)
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            memlab.watch(model, opt)
        for _ in range(2):
            x = torch.randint(0, cfg.vocab_size, (1, seq))
            y = torch.randint(0, cfg.vocab_size, (1, target_seq))
            with memlab.phase("forward"):
                loss = model(input_ids=x, labels=y, use_cache=False).loss
            with memlab.phase("backward"):
                loss.backward()
            del loss, x, y
            with memlab.phase("step"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    return trk, model


def test_an_encoder_decoder_has_its_own_target_length_and_head_as_its_config_says():
    """mT5 ("tie_word_embeddings": false in every official config.json; transformers 5 ties it anyway): fit gives
    the head its own weight, and runs 64 source tokens into 8 target tokens, equal to the real CPU step."""
    trk, model = _real_seq2seq(MT5, 64, 8, untie=True)
    r = memlab.fit(MT5, 1, seq=64, target_seq=8, optimizer="adamw")
    assert r.n_params == sum(p.numel() for p in model.parameters())
    gaps = {ph: r.by_phase[ph] - trk.phase_peaks[ph]["total"] for ph in ("forward", "backward", "step")}
    assert gaps == dict.fromkeys(gaps, 0), gaps
    assert "-> target 8" in str(r)
    same = memlab.fit(MT5, 1, seq=64, optimizer="adamw")          # target_seq=None: the source's length
    assert same.by_phase["forward"] > r.by_phase["forward"]
    tied = memlab.fit(dict(MT5, tie_word_embeddings=True), 1, seq=64, target_seq=8, optimizer="adamw")
    assert r.n_params - tied.n_params == MT5["vocab_size"] * MT5["d_model"]
    with pytest.raises(ValueError, match="target_seq is the target length of an encoder-decoder") as e:
        memlab.fit(tiny_of("llama-2-7b"), 1, seq=64, target_seq=8)
    assert "\n" not in str(e.value)


def test_an_attention_path_other_than_the_one_asked_is_named_in_the_answer():
    """GPT-OSS has no sdpa path in transformers (its attention sinks): fit runs its eager one, and says so."""
    r = memlab.fit(MIXED["gpt_oss"], 1, seq=64, optimizer="adamw")
    assert r.notes and "attention eager: transformers has no sdpa path for 'gpt_oss'" in str(r)
    assert not memlab.fit(MIXED["gemma3"], 1, seq=64, optimizer="adamw").notes
