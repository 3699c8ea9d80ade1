"""memlab.fit beyond decoder-only causal LMs: encoder classifiers, encoder-decoders, vision, mixture-of-experts.

The reference is independent of memlab.fit's model code: the model built the ordinary way (the Auto class for the
task, from_config, real CPU tensors, transformers' default attention, peft's LoRA), two bf16 AdamW steps on the
task's own batch, counted by memlab's MemoryTracker; fit must equal it phase by phase."""

import pytest
import torch

import memlab
from _plain_step import plain_step
from memlab.core.virtual_gpu import VirtualGPU
from memlab.fitting.model import fit_step, model_task, precision_dtype, skeleton
from memlab.fitting.plan import Plan, load_config
from memlab.fitting.run import _run_key, measure

GiB = 2**30

NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)   # see tests/test_fit.py FAMILIES
ENC = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
           **NO_DROPOUT)
BART = dict(model_type="bart", vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
TINY_MOE = dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                num_local_experts=4, num_experts_per_tok=2)
# family: (config, the Auto class a practitioner would pick for it)
FAMILIES = {
    "bert": (dict(model_type="bert", **ENC), "AutoModelForSequenceClassification"),
    "roberta": (dict(model_type="roberta", **ENC), "AutoModelForSequenceClassification"),
    # problem_type set: DeBERTa-v2's default picks the labelled rows with nonzero(), which fake tensors cannot size
    "deberta-v2": (dict(model_type="deberta-v2", problem_type="single_label_classification", **ENC),
                   "AutoModelForSequenceClassification"),
    "distilbert": (dict(model_type="distilbert", vocab_size=256, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0),
                   "AutoModelForSequenceClassification"),
    "t5": (dict(model_type="t5", vocab_size=256, d_model=64, num_layers=2, num_heads=4, d_ff=128, d_kv=16,
                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0), "AutoModelForSeq2SeqLM"),
    "bart": (BART, "AutoModelForSeq2SeqLM"),
    "vit": (dict(model_type="vit", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 image_size=32, patch_size=8, **NO_DROPOUT), "AutoModelForImageClassification"),
    "bart-causal": (dict(BART, is_decoder=True), "AutoModelForCausalLM"),
    "roberta-causal": (dict(model_type="roberta", is_decoder=True, **ENC), "AutoModelForCausalLM"),
    "qwen3-moe": (dict(TINY_MOE, model_type="qwen3_moe", moe_intermediate_size=96, num_experts=4, head_dim=16,
                       decoder_sparse_step=1), "AutoModelForCausalLM"),
}


def _reference(family, seq, method="full", checkpointing=False, dtype=torch.bfloat16):
    """tests/_plain_step.py's two plain AdamW steps of the family's model with its task's Auto class."""
    cfg_dict, auto = FAMILIES[family]
    return plain_step(cfg_dict, seq, method, checkpointing, auto=auto, dtype=dtype)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("method,checkpointing", [("full", False), pytest.param("full", True, marks=pytest.mark.slow),
                                                  pytest.param("lora", False, marks=pytest.mark.slow)])
def test_fit_equals_a_plain_step_of_each_family(family, method, checkpointing):
    seq = 64
    trk = _reference(family, seq, method, checkpointing)
    r = memlab.fit(FAMILIES[family][0], 1, seq=seq, method=method, checkpointing="full" if checkpointing else "none",
                   optimizer="adamw")                           # tests/_plain_step.py steps foreach AdamW
    gaps = {ph: r.by_phase[ph] - trk.phase_peaks[ph]["total"] for ph in ("forward", "backward", "step")}
    assert gaps == dict.fromkeys(gaps, 0), f"{family} {method}: fit - real per phase {gaps}"
    assert r.peak == trk.peak and r.by_category == trk.peak_breakdown


@pytest.mark.parametrize("family", ["bert", pytest.param("t5", marks=pytest.mark.slow),
                                    pytest.param("bart", marks=pytest.mark.slow)])
def test_two_and_three_layers_extend_to_the_full_depth_run(family):
    """measure() runs 2 and 3 layers (both stacks of an encoder-decoder) and extends linearly: exact against the
    5-layer model run whole, as tests/test_fit.py checks for decoders."""
    depth = {"bert": dict(num_hidden_layers=5), "t5": dict(num_layers=5, num_decoder_layers=6),
             "bart": dict(encoder_layers=5, decoder_layers=5)}[family]
    cfg = load_config(dict(FAMILIES[family][0], **depth))
    for plan in (Plan(seq=64, batch=2), Plan(seq=64, method="lora", checkpointing="full"),
                 Plan(seq=64, mode="inference")):
        ext = measure(cfg, plan)["phases"]
        whole = _cut(cfg, cfg.num_hidden_layers)       # uncut; use_cache=False as fit's runs (no cache in training)
        sk, info = skeleton(whole, plan.method, precision_dtype(plan.precision), plan.lora_r, plan.attention)
        full = VirtualGPU(capacity_gb=64).run(fit_step, sk, info, _run_key(plan)).phase_peaks
        for ph in ("forward", "backward", "step"):
            if ph not in full:
                continue
            if family == "bart" and (plan.checkpointing == "full" or plan.mode == "inference"):
                # the moment of the peak moves with depth here (0.5% at 5 layers, checkpointed LoRA's backward and
                # the inference forward); held within 2%, as tests/test_fit.py holds amp
                assert abs(ext[ph]["total"] - full[ph]["total"]) <= 0.02 * full[ph]["total"], (family, plan)
            else:
                assert ext[ph] == full[ph], (family, plan, ph)


def test_each_config_runs_its_own_step():
    kinds = {"bert": "seq-cls", "t5": "seq2seq", "vit": "image-cls", "bart-causal": "causal", "qwen3-moe": "causal"}
    for family, kind in kinds.items():
        assert model_task(load_config(FAMILIES[family][0])) == kind
    # inference: a classifier's forward, a seq2seq model's encoder and first decoder step
    for family in ("bert", "t5", "vit"):
        r = memlab.fit(FAMILIES[family][0], 1, seq=64, mode="inference")
        assert r.peak_phase == "forward" and r.by_category["activations"] + r.by_category["temporaries"] > 0
    # a vision model's batch is images: seq does not change its bytes
    vit = FAMILIES["vit"][0]
    assert memlab.fit(vit, 1, seq=16).peak == memlab.fit(vit, 1, seq=256).peak
    # Falcon's and Gemma-2's own attention paths
    falcon = dict(model_type="falcon", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    assert memlab.fit(falcon, 1, seq=64, attention="eager").peak > 0 and memlab.fit(falcon, 1, seq=64).peak > 0


def test_what_cannot_run_says_so_in_one_line():
    for multimodal in ("llava", "whisper"):          # image + text; speech encoder-decoder
        with pytest.raises(ValueError, match=f"'{multimodal}'.*not a causal language model.*image classifiers") as e:
            model_task(load_config(dict(model_type=multimodal)))
        assert "\n" not in str(e.value) and len(str(e.value)) < 500
    speech = dict(model_type="wav2vec2", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4)
    with pytest.raises(ValueError, match="'wav2vec2'.*memlab.fit runs") as e:
        memlab.fit(speech, 1, seq=16)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="loss='chunked' is for causal language models; 't5'") as e:
        memlab.fit(FAMILIES["t5"][0], 1, seq=16, loss="chunked")
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- mixture-of-experts
MIXTRAL_8X7B = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=32768, tie_word_embeddings=False)


def test_experts_in_fp32_run_on_the_virtual_gpu_as_on_real_tensors():
    """aten._grouped_mm's meta kernel takes bf16 only; fp32 experts (precision fp32/amp, QLoRA's) used to crash the
    fake run. Now the virtual GPU's bytes equal a real fp32 CPU step of the tiny Mixtral (the CPU kernel takes fp32)."""
    trk = plain_step(TINY_MOE, 64, dtype=torch.float32)
    r = memlab.fit(TINY_MOE, 1, seq=64, precision="fp32", optimizer="adamw")
    assert r.peak == trk.peak and r.by_category == trk.peak_breakdown
    assert all(r.by_phase[ph] == trk.phase_peaks[ph]["total"] for ph in ("forward", "backward", "step"))
    for kw in (dict(method="qlora"), dict(method="lora", precision="amp")):
        assert memlab.fit(MIXTRAL_8X7B, "A100-80GB", seq=128, **kw).peak > 0


def test_mixtral_8x7b_lora_activations_per_layer_are_the_merged_experts_plus_the_tokens():
    """Mixtral-8x7B, LoRA (peft "all-linear"), bf16, 1 x 1024 tokens. Per layer (3 layers minus 2):
    peft's ParamWrapper builds the adapted expert weights W + s B A for gate_up (E, 2I, C) and down (E, C, I) and the
    grouped matmul keeps them for its backward: M = 2 E (2I C + C I) bytes (memlab/fitting/model.py, the note above
    grouped_mm_any_dtype). Beside them the tokens: at least the gate_up outputs of the T k routed copies,
    T k 2I x 2 bytes; at most those plus the activation and the gated product (T k (2I + I + I) x 2 bytes) and
    64 bytes per hidden unit per token for attention, norms (fp32), router, LoRA inputs and residuals (a GPT layer
    without its MLP keeps 15 bytes per hidden unit per token in 16-bit, Korthikanti et al. 2022, section 4.1).
    Full fine-tuning builds no merged weights: only the token term."""
    cfg = load_config(MIXTRAL_8X7B)
    E, C, I, k, T = 8, 4096, 14336, 2, 1024
    M = 2 * E * (2 * I * C + C * I)                     # 2.625 GiB
    lo, hi = T * k * 2 * I * 2, T * (k * 4 * I * 2 + 64 * C)

    def per_layer(method):
        runs = [VirtualGPU(capacity_gb=2**20).run(fit_step, *skeleton(_cut(cfg, n), method, torch.bfloat16, 16,
                                                                      "sdpa"), Plan(seq=T, method=method))
                for n in (2, 3)]
        return runs[1].phase_peaks["forward"]["activations"] - runs[0].phase_peaks["forward"]["activations"]
    lora = per_layer("lora")
    assert M + lo <= lora <= M + hi, (lora / GiB, (M + lo) / GiB, (M + hi) / GiB)
    assert lo <= per_layer("full") <= hi
    r = memlab.fit(MIXTRAL_8X7B, "A100-80GB", method="lora", seq=T)
    assert 32 * (M + lo) <= r.by_category["activations"] <= 32 * (M + hi) + 2 * T * 32000 * 4, r.by_category


def _cut(cfg, n):
    from memlab.fitting.model import cut_layers
    return cut_layers(cfg, n)
