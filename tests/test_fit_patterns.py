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
