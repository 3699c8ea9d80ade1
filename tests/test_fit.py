"""memlab.fit: real vs virtual bytes, the 1,2 -> L layer extension, published points, bad input, the CLI."""

import json
import os
import subprocess
import sys

import pytest
import torch

import memlab
from _plain_step import plain_step
from memlab.fitting.plan import Plan, fit_presets, load_config
from memlab.fitting.model import AdamW8bitStandIn, fit_step, precision_dtype, skeleton
from memlab.fitting.run import _run_key, measure
from memlab.core.track import MemoryTracker
from memlab.core.virtual_gpu import VirtualGPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
MID = dict(TINY, vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=5)


def _real(cfg_dict, plan):
    """The same step on real CPU tensors under memlab's tracker (512-byte rounding, as the virtual GPU)."""
    cfg = load_config(cfg_dict)
    sk, info = skeleton(cfg, plan.method, precision_dtype(plan.precision), plan.lora_r, plan.attention)
    trk = MemoryTracker(device="cpu", round_to=512)
    with trk:
        fit_step(sk, info, plan)
    return trk


@pytest.mark.parametrize("kw", [dict(), dict(method="lora"), dict(checkpointing="full"),
                                dict(method="qlora", checkpointing="full"),
                                dict(method="qlora", checkpointing="full", qlora_rest="16bit"),
                                dict(loss="chunked"), dict(method="lora", loss="chunked", checkpointing="full"),
                                dict(step_in_backward=True), dict(method="lora", step_in_backward=True),
                                dict(step_in_backward=True, optimizer="adamw8bit", loss="chunked"),
                                dict(precision="mixed", checkpointing="selective"), dict(optimizer="adamw8bit"),
                                dict(batch=2, micro_batch=1), dict(mode="inference")])
def test_real_cpu_tensors_match_fit_to_the_byte(kw):
    kw = dict(kw, seq=64)
    kw.setdefault("optimizer", "adamw")          # the reference runs fit_step's own Plan: foreach AdamW
    trk = _real(TINY, Plan(**kw))
    r = memlab.fit(TINY, 1, **kw)
    assert r.peak == trk.peak
    assert r.by_category == trk.peak_breakdown
    assert r.by_phase["forward"] == trk.phase_peaks["forward"]["total"]


def test_amp_on_real_tensors_differs_by_a_known_bound():
    # precision="amp": the real CPU run allocates 512 bytes per token more in the forward than the fake run
    # (unexplained; found at seq 32-256 on this tiny config, benchmarks/fit.md). Hold it to that bound.
    for seq in (32, 64):
        trk = _real(TINY, Plan(seq=seq, precision="amp"))
        r = memlab.fit(TINY, 1, seq=seq, precision="amp", optimizer="adamw")
        assert 0 <= trk.phase_peaks["forward"]["total"] - r.by_phase["forward"] <= 512 * seq
        assert 0 <= trk.peak - r.peak <= 512 * seq


def test_checkpointing_lowers_the_peak_on_the_tiny_config():
    # the byte-exact test above is only meaningful if the options change what is allocated
    # (LoRA does not lower it here: on a 64-wide model rank-16 fp32 adapters outweigh a bf16 base)
    peaks = {k: memlab.fit(TINY, 1, seq=256, **kw).peak for k, kw in
             {"none": {}, "full": dict(checkpointing="full"), "sel": dict(checkpointing="selective")}.items()}
    assert peaks["full"] < peaks["sel"] < peaks["none"]


EXACT = [Plan(seq=64, batch=2), Plan(seq=64, method="qlora", checkpointing="full"),
         Plan(seq=64, batch=4, micro_batch=2, checkpointing="full"),
         Plan(seq=64, precision="mixed", checkpointing="selective", optimizer="adamw8bit"),
         Plan(seq=64, mode="inference", batch=2)]
BOUNDED = [Plan(seq=64, method="lora", precision="amp")]


@pytest.mark.parametrize("plan", EXACT + BOUNDED)
def test_two_and_three_layers_extend_to_the_full_depth_run(plan):
    cfg = load_config(MID)
    ext = measure(cfg, plan)["phases"]
    sk, info = skeleton(cfg, plan.method, precision_dtype(plan.precision), plan.lora_r, plan.attention)
    full = VirtualGPU(capacity_gb=64).run(fit_step, sk, info, _run_key(plan)).phase_peaks
    for ph in ("load", "forward", "backward", "step"):
        if ph not in full:
            continue
        if plan in EXACT:
            assert ext[ph] == full[ph], ph
        else:   # amp's forward: the moment of its peak moves with depth; within 2% (benchmarks/fit.md)
            assert abs(ext[ph]["total"] - full[ph]["total"]) <= 0.02 * full[ph]["total"], ph


def test_adamw8bit_stand_in_holds_bitsandbytes_state():
    bnb = pytest.importorskip("bitsandbytes")
    shapes = [(64, 80), (100,), (4096,), (300, 17)]          # below and above min_8bit_size = 4096

    def state_bytes(opt_cls):
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt = opt_cls(ps)
        opt.step()
        seen, n = set(), 0
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                    seen.add(v.untyped_storage().data_ptr())
                    n += v.untyped_storage().nbytes()
        return n, sorted((k, str(v.dtype), tuple(v.shape)) for st in opt.state.values() for k, v in st.items()
                         if isinstance(v, torch.Tensor))
    try:
        real = state_bytes(bnb.optim.AdamW8bit)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"bitsandbytes' 8-bit AdamW does not run on this CPU: {e}")
    assert state_bytes(AdamW8bitStandIn) == real


def test_zero_paper_figure_1_model_states():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12):
    # 120 GB -> 31.4 (stage 1) -> 16.6 (stage 2) -> 1.88 GB (stage 3) of model states per GPU
    cfg = dict(TINY, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    paper = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.88e9}
    for stage, want in paper.items():
        r = memlab.fit(cfg, "A100-80GB", precision="mixed", zero=stage, gpus=64, checkpointing="full")
        assert 7.4e9 < r.n_params < 7.6e9
        got = sum(r.model_states.values())
        assert abs(got / want - 1) < 0.012, (stage, got, want)
        exact = memlab.core.estimate.zero_model_state_bytes(r.n_params, 64, stage)
        assert abs(got / exact - 1) < 1e-3, (stage, got, exact)


@pytest.mark.slow
def test_qlora_paper_65b_fits_a_48gb_gpu_and_full_does_not():
    # Dettmers et al. 2023: QLoRA fine-tunes a 65B model on a single 48 GB GPU. LLaMA-65B's shapes
    # (Touvron et al. 2023, Table 2: dimension 8192, 64 heads, 80 layers; FFN 22016). 48 GB = 48e9 bytes,
    # below the real card's total_memory, so "fits" here is conservative.
    cfg = dict(TINY, vocab_size=32000, hidden_size=8192, intermediate_size=22016, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=64, max_position_embeddings=2048)
    gpu = 48e9 / 2**30
    q = memlab.fit(cfg, gpu, method="qlora", batch=1, seq=512, checkpointing="full")
    assert q.fits and 64e9 < q.n_params < 66e9, str(q)
    f = memlab.fit(cfg, gpu, method="full", batch=1, seq=512, checkpointing="full")
    assert not f.fits


def test_result_is_consistent():
    r = memlab.fit("gpt2", "T4-16GB", batch=2, seq=256, checkpointing="full", zero=2, gpus=4)
    assert r.peak == max(r.by_phase.values()) == sum(r.by_category.values())
    assert r.usable == memlab.usable_bytes(r.capacity) == int(r.capacity * (1 - memlab.HEADROOM))
    assert r.fits == (r.reserved + r.context <= r.usable) and r.needed == r.reserved + r.context
    assert r.reserved_cached >= r.reserved >= r.peak and r.context > 0
    assert r.cost["recompute_flops"] > 0 and r.cost["comm_bytes"] > 0 and r.cost["steps_per_batch"] == 1
    d = r.to_dict()
    assert json.loads(json.dumps(d))["plan"]["zero"] == 2
    assert "FITS" in str(r) and "ZeRO-2" in str(r)


def test_runs_kept_in_memlab_fit_cache_are_read_back_and_bad_files_measured_again(tmp_path, monkeypatch):
    """MEMLAB_FIT_CACHE (memlab/fitting/run.py): a measured run is written to the folder and read back instead of
    measured (here after clear_cache, as by another process); a file another process left half-written, or JSON
    that is no measured run, is measured again and rewritten; another version of the code reads other files; a
    folder that cannot be made costs only the saving."""
    from memlab.fitting import run
    folder = tmp_path / "cache"
    monkeypatch.setenv("MEMLAB_FIT_CACHE", str(folder))
    try:
        run.clear_cache()
        first = memlab.fit(TINY, 1, seq=64)
        (kept,) = folder.glob("*.json")
        stored = json.loads(kept.read_text())
        stored["phases"]["forward"]["total"] += 512           # a mark only a read of this file can give back
        kept.write_text(json.dumps(stored))
        run.clear_cache()
        assert memlab.fit(TINY, 1, seq=64).by_phase["forward"] == first.by_phase["forward"] + 512
        kept.write_text(kept.read_text()[:40])                 # cut short, as by a writer that died
        run.clear_cache()
        assert memlab.fit(TINY, 1, seq=64).by_phase == first.by_phase
        assert json.loads(kept.read_text())["phases"]["forward"]["total"] == first.by_phase["forward"]
        kept.write_text(json.dumps({"phases": []}))            # JSON, but not a measured run
        run.clear_cache()
        assert memlab.fit(TINY, 1, seq=64).by_phase == first.by_phase
        monkeypatch.setattr(run, "_code_version", lambda: "another version of memlab")
        run.clear_cache()
        assert memlab.fit(TINY, 1, seq=64).by_phase == first.by_phase and len(list(folder.glob("*.json"))) == 2
        (tmp_path / "a-file").write_text("")
        monkeypatch.setenv("MEMLAB_FIT_CACHE", str(tmp_path / "a-file" / "cache"))
        run.clear_cache()
        assert memlab.fit(TINY, 1, seq=64).by_phase == first.by_phase
    finally:
        run.clear_cache()                                     # the marked run must not outlive this test


def test_presets_load():
    names = fit_presets()
    assert {"llama-2-7b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b", "gemma-7b", "gpt2-xl"} <= set(names)
    assert load_config("llama-3.1-8b").num_key_value_heads == 8
    assert load_config(os.path.join(ROOT, "memlab", "fitting", "configs", "gpt2.json")).n_embd == 768


@pytest.mark.parametrize("kw, word", [(dict(method="dora"), "method"), (dict(precision="fp8"), "precision"),
                                      (dict(zero=4), "zero"), (dict(batch=0), "batch"),
                                      (dict(batch=4, micro_batch=3), "micro_batch"),
                                      (dict(offload=True), "offload"), (dict(headroom=1.5), "headroom"),
                                      (dict(mode="serve"), "mode"), (dict(seq=10**6), "seq")])
def test_bad_input_names_the_argument(kw, word):
    with pytest.raises(ValueError, match=word):
        memlab.fit("gpt2", "T4-16GB", **kw)


def test_bad_model_and_gpu():
    with pytest.raises(ValueError, match="preset"):
        memlab.fit("llama-9b")
    with pytest.raises(TypeError, match="model"):
        memlab.fit(42)
    with pytest.raises(ValueError, match="gpu 'B300' is no known card"):
        memlab.fit("gpt2", "B300")
    with pytest.raises(TypeError, match="gpu"):
        memlab.fit("gpt2", [16])
    with pytest.raises(ValueError, match="methods"):
        memlab.fit_search("gpt2", methods=("full", "adapter"))


@pytest.mark.slow
def test_search_finds_cheapest_plans_first():
    lines = []
    plans = memlab.fit_search("gpt2", 1.5, batch=2, seq=256, gpus=(1, 2), optimizers=("adamw",),
                              progress=lines.append)
    assert plans and all(p.fits for p in plans)
    assert lines and all(line.startswith("[") and " s] " in line for line in lines), lines[:3]
    assert any("fits" in line for line in lines), "one line per branch and per plan tried, with its verdict"
    with pytest.raises(ValueError, match="progress"):
        memlab.fit_search("gpt2", 1.5, progress="print")
    ranks = [({"full": 0, "lora": 1, "qlora": 2}[p.plan["method"]], p.plan["gpus"]) for p in plans]
    assert ranks == sorted(ranks)
    full1 = [p.cost["extra_seconds"] for p in plans if p.plan["method"] == "full" and p.plan["gpus"] == 1]
    assert full1 == sorted(full1)


def _cli(*args):
    code = "import sys; from memlab.fitting.search import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_cli_prints_a_verdict_and_exits_2_on_bad_input():
    ok = _cli("gpt2", "--gpu", "T4-16GB", "--seq", "64")
    assert ok.returncode == 0 and "FITS" in ok.stdout, ok.stderr
    bad = _cli("gpt2", "--method", "dora")
    assert bad.returncode == 2 and "--method" in bad.stderr
    bad = _cli("gpt2", "--batch", "4", "--micro-batch", "3")
    assert bad.returncode == 2 and "micro_batch" in bad.stderr
    tight = _cli("gpt2", "--gpu", "0.01", "--seq", "64", "--no-search")      # 10 MiB: does not fit, no search
    assert tight.returncode == 0 and "DOES NOT FIT" in tight.stdout and "searching" not in tight.stdout
    both = _cli("gpt2", "--search", "--no-search")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    helped = _cli("--help")
    text = " ".join(helped.stdout.split())
    assert all(opt in text for opt in ("--offload", "--no-search", "--micro-batch", "--headroom", "--lora-r",
                                       "--activation-offload", "--step-in-backward", "--paged", "--loss", "--no-cache"))
    assert "memlab/fit" in text or "MEMLAB_FIT_CACHE" in text, "the help names where measured steps are kept"
    assert "amp: fp32 weights, bf16 autocast" in text and "mixed: bf16 weights and gradients + fp32 master" in text


# ----------------------------------------------------------------------------- against a plain transformers step
def _plain_step(cfg_dict, seq, method="full", checkpointing=False):
    """tests/_plain_step.py's independent reference: two plain bf16 AdamW steps of the causal LM, counted."""
    return plain_step(cfg_dict, seq, method, checkpointing)


FAMILIES = {
    "llama": TINY,
    "llama-tied": dict(TINY, tie_word_embeddings=True),                  # tied: one tensor, counted once
    "mistral-window": dict(TINY, model_type="mistral", sliding_window=32),  # the window's mask is built
    # dropout off: CUDA's native_dropout keeps a 1-byte mask, the CPU's a mask in the activations' dtype, so a
    # CPU step is no reference for dropout (the virtual GPU is: it runs CUDA's kernels' shapes)
    "gpt2": dict(model_type="gpt2", vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "qwen2": dict(TINY, model_type="qwen2"),
    "falcon": dict(model_type="falcon", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    "gemma2-eager": dict(TINY, model_type="gemma2", head_dim=16),       # no sdpa path: its eager one
    "bert-decoder": dict(model_type="bert", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, is_decoder=True, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0),
    "mixtral": dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("method,checkpointing", [("full", False), ("full", True), ("lora", False)])
def test_fit_equals_a_plain_transformers_step(family, method, checkpointing):
    seq = 128
    trk = _plain_step(FAMILIES[family], seq, method, checkpointing)
    r = memlab.fit(FAMILIES[family], 1, seq=seq, method=method, checkpointing="full" if checkpointing else "none",
                   optimizer="adamw")                           # tests/_plain_step.py steps foreach AdamW
    assert r.peak == trk.peak, f"{family} {method}: fit {r.peak} vs a real step {trk.peak}"
    assert r.by_category == trk.peak_breakdown
    if method == "full":   # bf16, each tensor rounded to 512 bytes as the allocator and the tracker round
        assert r.model_states["parameters"] == sum(-(-t.numel() * (2 if t.is_floating_point() and isinstance(
            t, torch.nn.Parameter) else t.element_size()) // 512) * 512 for t in _unique_params(FAMILIES[family]))
    for ph in ("forward", "backward", "step"):
        assert r.by_phase[ph] == trk.phase_peaks[ph]["total"], ph


def _unique_params(cfg_dict):
    """The model's distinct parameters (a tied head is the embedding: one tensor)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(cfg_dict))
    return list(model.parameters()) + list(model.buffers())


def test_offload_keeps_only_the_16_bit_weights_and_the_bucket_on_the_gpu():
    # ZeRO-Offload as DeepSpeed runs it: DeepSpeed's estimator says gpu_mem = 2 * total_params with cpu_offload
    # (estimate_zero2_model_states_mem_needs); the step's traffic is fp32 gradients out, 16-bit weights back
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    plan = dict(seq=64, precision="mixed", zero=2, offload=True)
    r = memlab.fit(MID, 1, **plan)
    n = r.n_params
    _, gpu_ds = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=1, num_nodes=1, cpu_offload=True)
    assert r.model_states["optimizer"] == 0 and r.model_states["gradients"] == 0
    assert abs(r.model_states["parameters"] - gpu_ds) <= 512 * 64     # DeepSpeed's 2 bytes/param, tensors rounded
    assert r.cost["offload_bytes"] == 4 * n + 2 * n                       # fp32 gradients out, bf16 weights back
    plain = memlab.fit(MID, 1, seq=64, precision="mixed")
    assert r.peak < plain.peak and plain.by_category["optimizer"] + plain.model_states["optimizer"] > 0


def test_what_cannot_run_says_so_in_one_line():
    speech = dict(model_type="wav2vec2", vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4)
    with pytest.raises(ValueError, match="'wav2vec2'.*is not a causal language model") as e:
        memlab.fit(speech, 1, seq=64)
    assert "\n" not in str(e.value)


def test_precision_follows_the_card_fp16_where_there_is_no_bf16():
    """A T4 has no bf16 tensor cores (lesson 03): plans default to fp16 there, bf16 on an L4; same bytes."""
    from memlab.fitting.plan import auto_precision
    assert auto_precision("T4-16GB") == "fp16" and auto_precision("L4-24GB") == "bf16"
    assert auto_precision(memlab.VirtualGPU("T4-16GB")) == "fp16" and auto_precision(20.0) == "bf16"
    t4 = memlab.fit("gpt2", "T4-16GB", batch=1, seq=64)
    assert t4.plan["precision"] == "fp16", t4.plan
    bf = memlab.fit("gpt2", "T4-16GB", batch=1, seq=64, precision="bf16")
    assert t4.peak == bf.peak and t4.by_phase == bf.by_phase, "fp16 and bf16 are both 2 bytes per element"
    assert "fp16" in main_help()


def main_help() -> str:
    import contextlib
    import io
    from memlab.fitting.search import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main(["--help"])
    return buf.getvalue()


def test_a_plan_with_little_to_spare_is_called_borderline():
    from memlab.fitting.plan import BORDERLINE, FitResult
    cap = 16 * 2**30
    usable = memlab.usable_bytes(cap)

    def result(peak):
        return FitResult(peak=peak, capacity=cap, usable=usable, fits=peak <= usable, by_category={}, by_phase={},
                         plan={}, cost={}, seconds=0.0)
    assert result(usable - 41 * 2**20).verdict == "fits (borderline)"             # lesson 08's LoRA on a T4
    assert result(usable - int(BORDERLINE * cap) - 1).verdict == "fits"
    assert result(usable + 1).verdict == "does not fit" and not result(usable + 1).borderline


def test_qlora_rest_in_16_bits_halves_the_embeddings_and_head():
    """QLoRA's non-quantized parts: fp32 as peft leaves them, or the plan's 16-bit dtype as the QLoRA authors cast
    them. On the tiny Llama (untied embeddings and head, V x C each) the parameters after the step differ by
    2 bytes x 2 x V x C; the norms' 4-byte and 2-byte rows both round up to 512 bytes on the virtual GPU."""
    fp32 = memlab.fit(TINY, 1, seq=64, method="qlora", checkpointing="full")
    half = memlab.fit(TINY, 1, seq=64, method="qlora", checkpointing="full", qlora_rest="16bit")
    V, C = TINY["vocab_size"], TINY["hidden_size"]
    assert fp32.model_states["parameters"] - half.model_states["parameters"] == 2 * 2 * V * C
    assert "non-quantized parts 16bit" in str(half) and half.plan["qlora_rest"] == "16bit"
    with pytest.raises(ValueError, match="qlora_rest"):
        memlab.fit(TINY, 1, seq=64, method="qlora", qlora_rest="int8")


def test_chunked_loss_is_the_models_loss_and_keeps_no_whole_logits():
    """The chunked cross-entropy gives HF's own loss and gradients (the reference: model(labels=x).loss), and on a
    model whose logits dominate (a large vocabulary, a short, narrow stack) fit's peak falls with it."""
    from memlab.fitting.model import build_causal_lm, chunked_causal_lm_loss
    cfg = load_config(TINY)
    torch.manual_seed(0)
    model = build_causal_lm(cfg, "sdpa").float()
    x = torch.randint(0, cfg.vocab_size, (2, 40))
    want = model(input_ids=x, labels=x).loss
    want.backward()
    g_want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    got = chunked_causal_lm_loss(model, x, chunks=3)
    got.backward()
    assert torch.allclose(got, want, rtol=1e-5), (got.item(), want.item())
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip((p.grad for p in model.parameters()), g_want))
    wide_vocab = dict(TINY, vocab_size=8192)
    full = memlab.fit(wide_vocab, 1, seq=256, batch=2)
    chunked = memlab.fit(wide_vocab, 1, seq=256, batch=2, loss="chunked")
    assert chunked.peak < full.peak, (chunked.peak, full.peak)
    assert "chunked loss" in str(chunked)


def test_step_in_backward_frees_each_gradient_and_paged_state_leaves_the_card():
    """Options of torchtune's single-device full fine-tune: the optimizer step in the backward pass never holds all
    gradients (no step phase, no gradients at the peak), and a paged optimizer's state is not counted against the
    card but crosses PCIe (twice, at worst) every step."""
    # 8 tokens: the model states, not the activations, set the peak (the step phase, where every gradient is alive
    # beside foreach AdamW's scratch)
    plain = memlab.fit(MID, 1, seq=8, batch=1, optimizer="adamw")
    inbwd = memlab.fit(MID, 1, seq=8, batch=1, step_in_backward=True, optimizer="adamw")
    assert plain.peak_phase == "step" and "step" not in inbwd.by_phase
    assert inbwd.by_category["gradients"] < plain.model_states["gradients"]
    assert inbwd.peak < plain.peak, (inbwd.peak, plain.peak)
    assert "optimizer step in backward" in str(inbwd)
    paged = memlab.fit(MID, 1, seq=8, batch=1, step_in_backward=True, paged=True, optimizer="adamw")
    state = inbwd.by_category["optimizer"]
    assert state > 0 and paged.by_category["optimizer"] == 0
    assert paged.peak <= inbwd.peak - state and paged.cost["offload_bytes"] >= 2 * state
    for bad, word in ((dict(step_in_backward=True, micro_batch=1), "step_in_backward"),
                      (dict(paged=True, optimizer="sgd"), "paged")):
        with pytest.raises(ValueError, match=word):
            memlab.fit(MID, 1, seq=64, batch=2, **bad)
    with pytest.raises(TypeError, match="step_in_backward"):
        memlab.fit(MID, 1, seq=64, batch=2, step_in_backward="yes")


def test_qlora_dequantization_is_counted_per_use_of_the_4_bit_base():
    """2.5 bytes of DRAM traffic per quantized weight per use (read 4 bits, write 16): forward, the backward's input
    gradient, and the recomputed forward under full checkpointing, in every micro-batch; none without QLoRA."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(load_config(MID))
    linear = sum(m.weight.numel() for layer in hf.model.layers for m in layer.modules()
                 if isinstance(m, torch.nn.Linear))                     # the weights QLoRA stores in 4 bits
    cost = {(ck, mb): memlab.fit(MID, 1, seq=32, batch=2, method="qlora", checkpointing=ck,
                                 micro_batch=mb).cost["dequant_bytes"] for ck in ("none", "full") for mb in (None, 1)}
    assert cost[("none", None)] == pytest.approx(2.5 * linear * 2, rel=0.02)
    assert cost[("full", None)] * 2 == cost[("none", None)] * 3        # a third use: the recomputed forward
    assert cost[("full", 1)] == 2 * cost[("full", None)]                 # every micro-batch dequantizes again
    assert memlab.fit(MID, 1, seq=32, batch=2, method="lora").cost["dequant_bytes"] == 0
    assert extra_seconds_of(memlab.fit(MID, "L4-24GB", seq=32, batch=2, method="qlora")) > \
        extra_seconds_of(memlab.fit(MID, "L4-24GB", seq=32, batch=2, method="lora"))


def extra_seconds_of(r):
    from memlab.fitting.search import extra_seconds
    return extra_seconds(r)


def test_a_bad_config_file_fails_in_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ValueError, match=f"{bad} is not a readable JSON") as e:
        load_config(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list"):
        load_config(str(bad))
    bad.write_text('{"hidden_size": 64}')
    with pytest.raises(ValueError, match=f"{bad} has no 'model_type'"):
        load_config(str(bad))
    bad.write_text('{"model_type": "lama", "hidden_size": 64}')
    with pytest.raises(ValueError, match="'lama', which transformers .* does not know \\(did you mean 'llama'") as e:
        load_config(str(tmp_path))                                  # the folder holding config.json
    assert "\n" not in str(e.value) and len(str(e.value)) < 600, "one line, not transformers' list of every model"


@pytest.mark.parametrize("model", ["gpt2", "bloomz-7b1"])
def test_zero2_offload_states_equal_deepspeeds_estimator(model):
    """DeepSpeed's estimate_zero2_model_states_mem_needs(cpu_offload=True) puts 2 * total_params bytes on each GPU
    (deepspeed/runtime/zero/stage_1_and_2.py): fit's model states with the optimizer offloaded are those weights."""
    r = memlab.fit(model, "A100-80GB", precision="mixed", zero=2, gpus=8, offload=True, batch=1, seq=64)
    assert r.model_states == {"parameters": 2 * r.n_params, "gradients": 0, "optimizer": 0}


def test_t5_3b_model_states_are_deepspeeds_published_figure():
    """DeepSpeed's docs (memory.rst): t5-3b, ZeRO-2 on 8 GPUs, offload_optimizer=cpu -> '5.31GB' per GPU
    (benchmarks/fit_published.md)."""
    r = memlab.fit("t5-3b", "A100-80GB", precision="mixed", zero=2, gpus=8, offload=True, batch=1, seq=128)
    assert r.n_params == 2_851_598_336
    assert sum(r.model_states.values()) == 2 * 2_851_598_336
    assert f"{sum(r.model_states.values()) / 2**30:.2f}" == "5.31"


def _saved_bytes_plainly(cfg_dict, seq):
    """The bytes autograd saves in one plain bf16 forward of the model on real CPU tensors (parameters, views of
    them and tensors under 1 KiB left out, each save counted, as torch.autograd.graph.save_on_cpu copies each)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(load_config(cfg_dict)).to(torch.bfloat16)
    total = 0

    def pack(t):
        nonlocal total
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter) \
                and t.numel() * t.element_size() >= 1024:
            total += t.numel() * t.element_size()
        return t
    x = torch.randint(0, cfg_dict["vocab_size"], (1, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
    return total


def test_activation_offload_takes_the_saved_tensors_off_the_card_and_counts_their_traffic():
    plain = memlab.fit(TINY, 1, seq=128)
    off = memlab.fit(TINY, 1, seq=128, activation_offload=True)
    assert off.peak < plain.peak and off.by_phase["backward"] < plain.by_phase["backward"]
    assert off.by_category["activations"] < 0.05 * max(plain.by_category["activations"], 1)
    # two micro-batches of one sequence each send what one forward saves, out and back
    saved = _saved_bytes_plainly(TINY, 128)
    assert off.cost["offload_bytes"] == 2 * saved, (off.cost["offload_bytes"], saved)
    acc = memlab.fit(TINY, 1, seq=128, batch=4, micro_batch=1, activation_offload=True)
    assert acc.cost["offload_bytes"] == 4 * 2 * saved
    with pytest.raises(ValueError, match="activation_offload"):
        memlab.fit(TINY, 1, seq=128, mode="inference", activation_offload=True)
