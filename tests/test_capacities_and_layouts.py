"""Real GPU capacities, the training layouts' bytes per parameter, CUDA's autocast lists on the
virtual GPU, grouped-query attention, and the plots and calculator that show them."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn.functional as F

import memlab
from memlab.core import estimate as E
from memlab.plot import breakdown_bar
from memlab.core.virtual_gpu import CUDA_CONTEXT_GB, PRESETS, cuda_autocast, lookup_preset
from memlab.widgets import calculator_rows

GiB, MiB = 2**30, 2**20


# ----------------------------------------------------------------------------- capacities
def test_presets_are_what_the_cards_report_not_nominal_gib():
    # total_memory as reported (deviceQuery / torch), each below the vendor's nominal size read as GiB
    assert PRESETS["T4-16GB"].capacity == 15095 * MiB                       # Colab: "14.74 GiB"
    assert f"{PRESETS['T4-16GB'].capacity / GiB:.2f}" == "14.74"
    assert PRESETS["L4-24GB"].capacity == 23570219008
    assert PRESETS["A100-80GB"].capacity == 85100068864
    for name, spec in PRESETS.items():
        nominal = int(name.split("-")[1].rstrip("GB"))
        assert 0.9 * nominal * GiB < spec.capacity < nominal * GiB, name
        assert "github.com" in spec.note, f"{name}: cite where the figure comes from"


def test_one_gpu_table_gives_the_same_presets_and_data_sheets():
    # memlab.core.gpus.GPUS holds each card once; PRESETS and GPU_SPECS are views of it, with these numbers
    from memlab.core import gpus
    from memlab.hardware.hierarchy import GPU_SPECS
    assert PRESETS is gpus.PRESETS and GPU_SPECS is gpus.GPU_SPECS
    assert {k: (s.name, s.capacity, s.bf16) for k, s in PRESETS.items()} == {
        "T4-16GB": ("T4-16GB", 15095 * MiB, False), "L4-24GB": ("L4-24GB", 23570219008, True),
        "RTX4090-24GB": ("RTX4090-24GB", 25386352640, True), "A100-40GB": ("A100-40GB", 42298834944, True),
        "A100-80GB": ("A100-80GB", 85100068864, True), "H100-80GB": ("H100-80GB", 85045477376, True),
        # the cards known by the memory they report only (memlab/core/gpus.py names each record)
        "RTX3090-24GB": ("RTX3090-24GB", 25327697920, True), "RTX4060Ti-16GB": ("RTX4060Ti-16GB", 16857038848, True),
        "RTX4080-16GB": ("RTX4080-16GB", 16049 * MiB, True), "RTX5090-32GB": ("RTX5090-32GB", 33677180928, True),
        "A10G-24GB": ("A10G-24GB", 22587 * MiB, True), "RTXA6000-48GB": ("RTXA6000-48GB", 48676 * MiB, True),
        "A40-48GB": ("A40-48GB", 47608692736, True), "L40S-48GB": ("L40S-48GB", 47803596800, True),
        "RTX6000Ada-48GB": ("RTX6000Ada-48GB", 51002867712, True),
        "H100NVL-94GB": ("H100NVL-94GB", 99861594112, True), "H200-141GB": ("H200-141GB", 143156 * MiB, True),
        "B200-180GB": ("B200-180GB", 182642 * MiB, True), "MI300X-192GB": ("MI300X-192GB", 196592 * MiB, True)}
    assert list(PRESETS)[:6] == ["T4-16GB", "L4-24GB", "RTX4090-24GB", "A100-40GB", "A100-80GB", "H100-80GB"]
    T = 1e12
    assert {k: (s.dram_bandwidth / 1e9, s.fp32 / T, s.fp16_tensor / T, s.bf16_tensor and s.bf16_tensor / T, s.sms,
                s.l2_bytes // MiB) for k, s in GPU_SPECS.items()} == {
        "T4-16GB": (320, 8.1, 65, None, 40, 4), "L4-24GB": (300, 30.3, 121, 121, 58, 48),
        "V100-32GB": (900, 15.7, 125, None, 80, 6), "A100-40GB": (1555, 19.5, 312, 312, 108, 40),
        "A100-80GB": (2039, 19.5, 312, 312, 108, 40), "H100-80GB": (3350, 67, 989.5, 989.5, 132, 50)}
    for k, g in gpus.GPUS.items():
        assert g.sheet is not None or g.total_memory is not None, k
        if g.sheet is not None and g.total_memory is not None:        # both halves describe the same card
            assert g.bf16 == (g.sheet.bf16_tensor is not None), k
            assert int(g.sheet.memory.split()[0]) == int(k.split("-")[1].rstrip("GB")), k
            assert PRESETS[k].note == g.memory_source and GPU_SPECS[k] is g.sheet


def test_preset_names_ignore_case_and_near_misses_say_what_was_meant():
    assert memlab.VirtualGPU("t4-16gb").capacity == PRESETS["T4-16GB"].capacity
    assert lookup_preset(" A100-80gb ").name == "A100-80GB"
    with pytest.raises(ValueError, match=r"'A100' names more than one card: 'A100-40GB' or 'A100-80GB'"):
        memlab.VirtualGPU("A100")
    with pytest.raises(ValueError, match=r"no known card \(closest: 'A10G-24GB'"):
        memlab.VirtualGPU("A10")
    with pytest.raises(ValueError, match="memlab-fit --list") as e:
        memlab.VirtualGPU("V100-32GB")                 # a data sheet only: no capacity recorded
    assert "\n" not in str(e.value) and "capacity_gb" not in str(e.value)
    with pytest.raises(TypeError, match="preset"):
        memlab.VirtualGPU(16)


@pytest.mark.parametrize("typed, card", [("4090", "RTX4090-24GB"), ("rtx4090", "RTX4090-24GB"),
                                         ("RTX 4090", "RTX4090-24GB"), ("GeForce RTX 4090", "RTX4090-24GB"),
                                         ("3090", "RTX3090-24GB"), ("RTX3090", "RTX3090-24GB"),
                                         ("h100-80gb", "H100-80GB"), ("H100", "H100-80GB"), ("A100 80GB", "A100-80GB"),
                                         ("t4", "T4-16GB"), ("Tesla T4", "T4-16GB"),
                                         ("NVIDIA RTX A6000", "RTXA6000-48GB"), ("a10g", "A10G-24GB"),
                                         ("RTX 6000 Ada", "RTX6000Ada-48GB"), ("h100 nvl", "H100NVL-94GB"),
                                         ("MI300X", "MI300X-192GB"), ("h200", "H200-141GB")])
def test_one_resolver_reads_the_names_people_type(typed, card):
    """memlab.core.gpus.resolve_gpu: the one lookup behind memlab.fit, memlab-fit, the search and VirtualGPU."""
    from memlab.core.gpus import resolve_gpu
    from memlab.fitting.plan import auto_precision
    assert resolve_gpu(typed) is PRESETS[card] and memlab.VirtualGPU(typed).spec is PRESETS[card]
    assert auto_precision(typed) == ("bf16" if PRESETS[card].bf16 else "fp16")   # whatever the spelling


def test_a_bare_number_is_gib_only_when_it_is_a_plausible_capacity():
    from memlab.core.gpus import MAX_PLAUSIBLE_GIB, resolve_gpu
    assert resolve_gpu("24").capacity == 24 * GiB and resolve_gpu(1.5).capacity == int(1.5 * GiB)
    assert resolve_gpu("24").bf16 and resolve_gpu(0.01).capacity == int(0.01 * GiB)
    for bad in ("5000", "1080", 4090, -3, 0, math.inf, f"{MAX_PLAUSIBLE_GIB + 1}"):
        with pytest.raises(ValueError, match="GiB") as e:
            resolve_gpu(bad)
        assert "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)
    with pytest.raises(ValueError, match="closest: 'RTX4090-24GB'"):
        resolve_gpu(4090)                            # a card's number given as a number: its name is suggested
    for bad in (True, [16], None):
        with pytest.raises(TypeError, match="gpu must be"):
            resolve_gpu(bad)


def test_reserve_for_the_cuda_context():
    t4 = memlab.VirtualGPU("T4-16GB")
    kept = memlab.VirtualGPU("T4-16GB", reserve_gb=CUDA_CONTEXT_GB)
    assert t4.capacity - kept.capacity == int(CUDA_CONTEXT_GB * GiB)
    assert "reserved" in kept.name
    with pytest.raises(ValueError, match="reserve_gb"):
        memlab.VirtualGPU("T4-16GB", reserve_gb=15)
    with pytest.raises(ValueError, match="reserve_gb"):
        memlab.VirtualGPU("T4-16GB", reserve_gb=-1)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_infinite_capacity_is_refused_with_a_way_out(bad):
    with pytest.raises(ValueError, match="finite.*capacity_gb=4096"):
        memlab.VirtualGPU(capacity_gb=bad)


def test_reading_a_value_on_the_virtual_gpu_says_what_to_do():
    def step():
        m = memlab.MLP(8, 8, 1, 2)
        memlab.watch(m)
        return m(torch.randn(4, 8), torch.randint(0, 2, (4,))).item()
    with pytest.raises(RuntimeError, match=r"\.item\(\).*memlab.train_step"):
        memlab.VirtualGPU(capacity_gb=1).run(step)


# ----------------------------------------------------------------------------- CUDA's autocast lists
def test_cuda_autocast_runs_the_fp32_list_in_fp32_and_the_cpu_lists_do_not():
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with cuda_autocast(torch.bfloat16):
        h = lin(x)
        assert h.dtype == torch.bfloat16                       # matmuls: 16-bit
        assert h.softmax(-1).dtype == torch.float32            # CUDA's fp32 list
        assert F.layer_norm(h, (16,)).dtype == torch.float32
        assert F.cross_entropy(h, torch.zeros(4, dtype=torch.long)).dtype == torch.float32
        assert (h * 2).dtype == torch.bfloat16                 # not on a list: follows its input
    gpu = memlab.VirtualGPU("T4-16GB")
    with gpu.autocast(torch.bfloat16, op_lists="cpu"):
        assert lin(x).softmax(-1).dtype == torch.bfloat16      # CPU lists: softmax follows its input
    with pytest.raises(ValueError, match="op_lists"):
        gpu.autocast(torch.bfloat16, op_lists="tpu")
    with pytest.raises(ValueError, match="dtype"):
        cuda_autocast(torch.float32)


def test_cuda_lists_keep_the_fp32_softmax_for_backward():
    def step(lists):
        model = memlab.GPT(memlab.GPTConfig.tiny(attn="math"))
        memlab.watch(model)
        x = torch.randint(0, 256, (4, 64))
        with memlab.phase("forward"), gpu.autocast(torch.float16, op_lists=lists):
            loss = model(x, x)
        with memlab.phase("backward"):
            loss.backward()
    gpu = memlab.VirtualGPU(capacity_gb=1)
    saved = {lists: gpu.run(step, lists).phase_peaks["forward"]["activations"] for lists in ("cpu", "cuda")}
    # the explicit attention's (B, H, T, T) scores, per element: under the CPU lists one 16-bit softmax output
    # (2 B) serves softmax's and the next matmul's backward; on CUDA softmax runs in fp32 and keeps its fp32
    # output (4 B), and the matmul keeps its own 16-bit copy of it (2 B): 4 bytes more per element
    scores = 4 * 4 * 64 * 64                               # B * H * T * T elements per layer, 4 layers
    assert saved["cuda"] - saved["cpu"] == 4 * scores * 4


def test_fp16_steps_with_a_loss_scaler_run_on_the_virtual_gpu():
    def step(scaler_kind):
        model = memlab.MLP(64, 64, 2, 8)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        memlab.watch(model, opt)
        scaler = gpu.grad_scaler() if scaler_kind == "virtual" else torch.amp.GradScaler("cpu")
        x, y = torch.randn(16, 64), torch.randint(0, 8, (16,))
        memlab.train_step(model, opt, x, y, autocast_dtype=torch.float16, scaler=scaler)
    gpu = memlab.VirtualGPU(capacity_gb=1)
    assert gpu.run(step, "virtual").fits
    with pytest.raises(RuntimeError, match="grad_scaler"):
        gpu.run(step, "real")


# ----------------------------------------------------------------------------- training layouts
def test_layouts_bytes_per_param_with_adam():
    want = {"fp32": 16, "amp": 16, "bf16_master": 16, "bf16_master_fp32_grads": 20, "bf16": 8}
    for precision, b in want.items():
        assert E.BYTES_PER_PARAM[(precision, "adam")] == b, precision
        assert sum(E.model_state_bytes(1000, precision, "adamw").values()) == 1000 * b
    parts = E.layout_bytes_per_param("bf16_master_fp32_grads", "adamw")
    assert parts == {"weights": 2, "grads": 2, "master": 4, "grad_accum": 4, "optimizer state": 8,
                     "transient copies": 0}
    assert E.layout_bytes_per_param("amp")["transient copies"] == 2
    assert E.model_state_bytes(10, "bf16_master_fp32_grads") == {"parameters": 20, "gradients": 60, "optimizer": 120}
    with pytest.raises(ValueError, match="precision"):
        E.layout_bytes_per_param("fp8")


def _measured_step_scratch(opt_kw, dtype=torch.float32):
    torch.manual_seed(0)
    model = memlab.MLP(96, 128, 3, 64, bias=True).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), **opt_kw)
    x, y = torch.randn(2, 96, dtype=dtype), torch.randint(0, 64, (2,))
    memlab.train_step(model, opt, x, y)                     # step 1 creates the state: measure step 2
    tr = memlab.MemoryTracker(model, opt)
    with tr:
        memlab.train_step(model, opt, x, y)
    return tr.phase_peaks["step"]["temporaries"], [p.numel() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(foreach=False), dict(foreach=True), dict(fused=True)], ids=str)
def test_optimizer_step_scratch_is_predicted_to_the_byte(kw, dtype):
    measured, numels = _measured_step_scratch(kw, dtype)
    predicted = E.optimizer_step_temp_bytes(numels, "adamw", foreach=kw.get("foreach", False),
                                            fused=kw.get("fused", False), bytes_per_element=dtype.itemsize)
    assert measured == predicted, (kw, dtype, measured, predicted)
    if kw.get("fused"):
        assert measured == 0


def test_zero_paper_uses_k_12_in_every_stage():
    psi, n = 10**9, 8
    assert E.zero_model_state_bytes(psi, n, 1) == 4 * psi + 12 * psi / n
    assert E.zero_model_state_bytes(psi, n, 2) == 2 * psi + 14 * psi / n
    assert E.zero_model_state_bytes(psi, n, 0) == E.BYTES_PER_PARAM[("bf16_master", "adam")] * psi


# ----------------------------------------------------------------------------- models
def test_llama31_8b_parameter_count_with_grouped_query_attention():
    cfg = memlab.GPTConfig.llama3_8b()
    assert (cfg.n_head, cfg.n_kv_head, cfg.mlp_hidden, cfg.vocab_size) == (32, 8, 14336, 128256)
    assert E.gpt_param_count(cfg) == 8_030_261_248
    run = memlab.VirtualGPU(capacity_gb=64).run(lambda: memlab.GPT(cfg).num_params())
    assert run.value == 8_030_261_248
    assert E.gpt_param_count(memlab.GPTConfig.llama_7b()) == 6_738_415_616


def test_preset_overrides_recompute_the_mlp_width():
    assert memlab.GPTConfig.llama_7b().mlp_hidden == 11008
    assert memlab.GPTConfig.llama_7b(n_embd=5120, n_head=40).mlp_hidden == 13824     # Llama-2-13B's width
    assert memlab.GPTConfig.gpt2_small(n_embd=1024, n_head=16).mlp_hidden == 4096
    assert memlab.GPTConfig.llama_7b(mlp_hidden=1000).mlp_hidden == 1000             # explicit wins


def test_grouped_query_attention_matches_repeated_heads():
    torch.manual_seed(0)
    cfg = memlab.GPTConfig.tiny(n_head=4, n_kv_head=2, pos="rope")
    sdpa = memlab.GPT(cfg)
    math_attn = memlab.GPT(memlab.GPTConfig.tiny(n_head=4, n_kv_head=2, pos="rope", attn="math"))
    math_attn.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, 256, (2, 32))
    assert torch.allclose(sdpa(x), math_attn(x), atol=1e-5)
    assert sdpa.num_params() == E.gpt_param_count(cfg) < E.gpt_param_count(memlab.GPTConfig.tiny(pos="rope"))
    sdpa(x, x).backward()
    with pytest.raises(ValueError, match="n_kv_head"):
        memlab.GPTConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match="n_kv_head"):
        E.gpt_activation_bytes(cfg.__class__(n_kv_head=2), 1, 8)


# ----------------------------------------------------------------------------- plots and the calculator
def test_an_oom_bar_shows_the_failed_request_above_the_capacity():
    def step():
        x = torch.empty(600 * MiB, dtype=torch.uint8)
        y = torch.empty(600 * MiB, dtype=torch.uint8)
        return x, y
    gpu = memlab.VirtualGPU(capacity_gb=1)
    run = gpu.run(step, catch_oom=True)
    assert not run.fits and run.request == 600 * MiB and run.peak > gpu.capacity
    ax = breakdown_bar({"a long label that must wrap": run}, unit="MiB", capacity=gpu.capacity)
    top = max(p.get_y() + p.get_height() for p in ax.patches)
    assert top == pytest.approx(run.peak / MiB)
    assert any(p.get_hatch() == "//" for p in ax.patches)
    assert "\n" in ax.get_xticklabels()[0].get_text()
    with pytest.raises(TypeError, match="VirtualRun"):
        breakdown_bar({"x": 3})


def test_usable_bytes_is_the_one_fit_criterion():
    assert memlab.HEADROOM == 0.05
    assert memlab.usable_bytes(1000) == 950 and memlab.usable_bytes(1000, 0) == 1000
    for bad in (0, -5, 2.5, True, "16GB"):
        with pytest.raises(ValueError, match="capacity"):
            memlab.usable_bytes(bad)
    for bad in (1, -0.1, 1.5, None):
        with pytest.raises(ValueError, match="headroom"):
            memlab.usable_bytes(1000, bad)


def test_calculator_is_one_labelled_table():
    rows = calculator_rows(7, "fp32", "adamw")
    assert rows[0].startswith("Model states of a 7.00B-parameter model")
    assert sum("B/param" in r for r in rows) == 6
    assert any("T4-16GB" in r and "14.00 GiB usable" in r for r in rows), "the T4's 14.74 GiB less 5% headroom"
    # states between the usable bytes and the capacity: does not fit (the course's one criterion, memlab.HEADROOM)
    n = 14.4 * 2**30 / 16 / 1e9                           # 14.4 GiB of fp32 AdamW states, no step scratch
    t4 = [r for r in calculator_rows(n, "fp32", "adamw", foreach_step=False) if "T4-16GB" in r]
    assert t4 and "does NOT fit" in t4[0], t4
    rows = calculator_rows(7, "bf16_master_fp32_grads", "adam", foreach_step=False)
    assert any("states" in r and "20 B/param" in r for r in rows)
    with pytest.raises(ValueError, match="precision"):
        calculator_rows(7, "fp8", "adam")


def test_chunked_cross_entropy_gives_the_same_loss_and_gradients_in_less_memory():
    torch.manual_seed(0)
    cfg = memlab.GPTConfig.tiny(n_layer=1, vocab_size=512)
    model = memlab.GPT(cfg)
    x, y = torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64))
    peaks, grads, losses = {}, {}, {}
    for k in (1, 8):
        model.zero_grad(set_to_none=True)
        tr = memlab.MemoryTracker(model)
        with tr:
            with memlab.phase("forward"):
                loss = model(x, y, loss_chunks=k)
            with memlab.phase("backward"):
                loss.backward()
        peaks[k], losses[k] = tr.peak, loss.item()
        grads[k] = [p.grad.clone() for p in model.parameters()]
    assert losses[1] == pytest.approx(losses[8], rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[1], grads[8]))
    logits = 4 * 64 * 512 * 4                                # one fp32 (B, T, V) tensor
    assert peaks[1] - peaks[8] > logits, (peaks, logits)      # the full logits never exist at once
    with pytest.raises(ValueError, match="loss_chunks"):
        model(x, y, loss_chunks=0)


def test_gpt_param_numels_follow_the_parameters_order():
    for cfg in (memlab.GPTConfig.tiny(), memlab.GPTConfig.tiny(bias=False), memlab.GPTConfig.tiny(tie_weights=False)):
        assert E.gpt_param_numels(cfg) == [p.numel() for p in memlab.GPT(cfg).parameters()]
    with pytest.raises(ValueError, match="default block"):
        E.gpt_param_numels(memlab.GPTConfig.tiny(mlp="swiglu"))
