"""The optimizer as run (memlab/fitting/optimizers.py): each one's state and step scratch, byte for byte against the
real optimizer stepping a tiny Llama on real CPU tensors, and the default is what the Hugging Face Trainer picks.

The reference is built the ordinary way (transformers' AutoModelForCausalLM, the optimizer class a practitioner
would make: torch's AdamW with fused=True / foreach / for-loop, torch's SGD, transformers' Adafactor as the Trainer
makes it, bitsandbytes' AdamW8bit), two steps counted by memlab's MemoryTracker, as tests/_plain_step.py does."""

import pytest
import torch

import memlab
from memlab.core.track import MemoryTracker
from memlab.fitting.optimizers import OPTIMIZER_NAMES, trainer_default
from memlab.fitting.plan import load_config

TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
SEQ = 32


def _real_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)      # the CPU has a fused AdamW kernel too
    if name == "adamw_forloop":
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, foreach=True)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    if name == "adafactor":
        from transformers.optimization import Adafactor      # imported before the tracker starts: see _real_step
        return Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False, warmup_init=False)
    import bitsandbytes as bnb
    return {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name](params, lr=1e-4)


def _real_step(name, dtype=torch.bfloat16):
    """Two steps of the tiny Llama with the real optimizer, counted (the second's forward and backward run beside
    the state the first step made, as fit's steady state)."""
    import warnings
    import transformers.optimization  # noqa: F401  (importing it makes module-level tensors: not the step's)
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    trk = MemoryTracker(device="cpu", round_to=512)
    with trk, warnings.catch_warnings():
        warnings.simplefilter("ignore")                          # bitsandbytes: paged falls back on the CPU
        with memlab.phase("load"):
            model = AutoModelForCausalLM.from_config(load_config(TINY)).to(dtype)
            model.train()
            opt = _real_optimizer(name, [p for p in model.parameters() if p.requires_grad])
            memlab.watch(model, opt)
        for _ in range(2):
            x = torch.randint(0, TINY["vocab_size"], (1, SEQ))
            with memlab.phase("forward"):
                loss = model(input_ids=x, labels=x, use_cache=False).loss
            with memlab.phase("backward"):
                loss.backward()
            del loss, x
            with memlab.phase("step"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    return trk, opt


def _state_bytes(opt) -> int:
    seen, n = set(), 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                n += -(-v.untyped_storage().nbytes() // 512) * 512
    return n


@pytest.mark.parametrize("name", ["adamw", "adamw_fused", "adamw_forloop", "sgd", "sgd_momentum", "adafactor"])
def test_each_torch_optimizer_equals_a_real_cpu_step_to_the_byte(name):
    trk, opt = _real_step(name)
    r = memlab.fit(TINY, 1, seq=SEQ, optimizer=name)
    assert r.plan["optimizer"] == name and OPTIMIZER_NAMES[name] in str(r)
    for ph in ("forward", "backward", "step"):
        assert r.by_phase[ph] == trk.phase_peaks[ph]["total"], (name, ph, r.by_phase[ph] - trk.phase_peaks[ph]["total"])
    assert r.model_states["optimizer"] == _state_bytes(opt), name


def test_their_step_scratch_differs_as_their_implementations_do():
    """The same model and state bytes (AdamW: 2 moments per weight), three step peaks: foreach makes one sqrt tensor
    per weight at once, the for-loop two temporaries of the largest weight, the fused kernel none."""
    peaks = {n: memlab.fit(TINY, 1, seq=SEQ, optimizer=n) for n in ("adamw", "adamw_fused", "adamw_forloop")}
    states = {n: r.model_states["optimizer"] for n, r in peaks.items()}
    step = {n: r.by_phase["step"] for n, r in peaks.items()}
    assert states["adamw"] == states["adamw_forloop"] and step["adamw_fused"] < step["adamw_forloop"] < step["adamw"]
    assert peaks["adamw"].by_phase["forward"] == peaks["adamw_forloop"].by_phase["forward"]


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_8bit_adamw_holds_bitsandbytes_state_exactly(name):
    """bitsandbytes runs its 8-bit AdamW on the CPU here (paged falls back to unpaged state, with a warning), so its
    state is checked to the byte; its update is one fused CUDA kernel on a card (no scratch), which the CPU
    implementation is not, so the step phase is held to the state and not to the CPU's temporaries."""
    pytest.importorskip("bitsandbytes")
    try:
        trk, opt = _real_step(name)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"bitsandbytes' 8-bit AdamW does not run on this CPU: {e}")
    r = memlab.fit(TINY, 1, seq=SEQ, optimizer=name)
    state = _state_bytes(opt)
    for ph in ("forward", "backward"):
        if name == "adamw8bit":
            assert r.by_phase[ph] == trk.phase_peaks[ph]["total"], (ph, r.by_phase[ph] - trk.phase_peaks[ph]["total"])
        else:   # paged: the state is off the card's books
            assert r.by_phase[ph] == trk.phase_peaks[ph]["total"] - state, ph
    if name == "adamw8bit":
        assert r.model_states["optimizer"] == state
        assert r.by_category["optimizer"] == trk.phase_peaks["step"]["optimizer"]
    else:
        assert r.by_category["optimizer"] == 0 and r.model_states["optimizer"] == state      # in unified memory
        assert r.cost["offload_bytes"] >= 2 * state
        assert "paged AdamW 8-bit" in str(r)


def test_the_default_is_what_the_hugging_face_trainer_picks_on_this_torch():
    from transformers import TrainingArguments
    trainer = TrainingArguments.__dataclass_fields__["optim"].default
    trainer = getattr(trainer, "value", trainer)
    assert {"adamw_torch_fused": "adamw_fused", "adamw_torch": "adamw"}[trainer] == trainer_default()
    r = memlab.fit(TINY, 1, seq=SEQ)
    assert r.plan["optimizer"] == trainer_default() and OPTIMIZER_NAMES[trainer_default()] in str(r)


def test_optimizers_deepspeed_cannot_offload_are_refused_in_one_line():
    for name in ("adamw8bit", "adafactor", "sgd_momentum"):
        with pytest.raises(ValueError, match="offload=True runs DeepSpeed's CPU Adam") as e:
            memlab.fit(TINY, 1, seq=SEQ, optimizer=name, zero=2, offload=True, precision="mixed")
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        memlab.fit(TINY, 1, seq=SEQ, optimizer="lion")
