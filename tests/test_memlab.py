"""memlab: the tracker, the virtual GPU, the estimator, and bad input."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn.functional as F

import memlab
from benchmarks import zoo
from memlab.core import estimate as E
from memlab.plot import breakdown_bar, timeline, tradeoff
from memlab.widgets import calculator_rows


def _mlp_step(model, opt, make_batch, *, steps_before=0, amp=None, tracker_kw=None):
    for _ in range(steps_before):
        memlab.train_step(model, opt, *make_batch(), autocast_dtype=amp)
    tr = memlab.MemoryTracker(model, opt, **(tracker_kw or {}))
    with tr:
        x, y = make_batch()
        memlab.train_step(model, opt, x, y, autocast_dtype=amp)
        del x, y
    return tr


# ----------------------------------------------------------------------------- tracker: exact by hand
def test_peak_equals_hand_computed_adam_step():
    """One Linear(256, 256) with Adam (foreach=False), batch 1, first step.
    The peak is inside optimizer.step(), updating the weight:
      parameters  4 * (256*256 + 256)           weight and bias, fp32
      gradients   the same
      optimizer   2 * that + 2 * 4              exp_avg, exp_avg_sq, and a 4-byte `step` per tensor
      batch       256 * 4 + 1 * 8                x fp32 and the int64 label
      scratch     2 * 256*256*4                 exp_avg_sq.sqrt() and its division, alive together
    """
    class Classifier(torch.nn.Linear):
        def forward(self, x, targets):
            return F.cross_entropy(super().forward(x), targets)

    torch.manual_seed(0)
    model = Classifier(256, 256)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    tr = memlab.MemoryTracker(model, opt)
    with tr:
        x, y = torch.randn(1, 256), torch.randint(0, 256, (1,))
        memlab.train_step(model, opt, x, y)
    P = 4 * (256 * 256 + 256)
    want = P + P + (2 * P + 2 * 4) + (256 * 4 + 8) + 2 * 256 * 256 * 4
    assert tr.peak == want, f"peak {tr.peak} != hand-computed {want}"
    assert tr.peak_phase == "step"
    assert tr.peak_breakdown == {"parameters": P, "gradients": P, "optimizer": 2 * P + 8, "activations": 0,
                                 "temporaries": 256 * 4 + 8 + 2 * 256 * 256 * 4}


def test_forward_activations_equal_the_formula():
    torch.manual_seed(0)
    for act in ("relu", "gelu", "tanh"):
        model = memlab.MLP(64, 96, 3, 10, act=act)
        tr = memlab.MemoryTracker(model)
        x, y = torch.randn(40, 64), torch.randint(0, 10, (40,))
        with tr:
            with memlab.phase("forward"):
                loss = model(x, y)
            with memlab.phase("backward"):
                acts = tr.breakdown()["activations"]
                loss.backward()
        # the formula excludes the loss scalar (4 bytes), which the forward also leaves alive
        assert acts == E.mlp_activation_bytes(40, 64, 96, 3, 10, act=act) + 4, act


def test_views_and_inplace_allocate_nothing():
    tr = memlab.MemoryTracker()
    with tr:
        a = torch.zeros(1000)
        b = a.view(10, 100)[2:5]
        a.add_(1)
        assert tr.current == 4000
        del a
        assert tr.current == 4000, "b still holds the storage"
        del b
        assert tr.current == 0
    assert tr.peak == 4000


def test_views_and_inplace_results_of_older_tensors_are_not_new_memory():
    outside = torch.zeros(1000)
    tr = memlab.MemoryTracker()
    with tr:
        v = outside.view(10, 100)
        outside.add_(1)
        flat = v.reshape(-1)
        assert tr.current == 0, "views/in-place results of a tensor made before the tracker share its storage"
        fresh = outside * 2
        assert tr.current == 4000
    del v, flat, fresh


# ----------------------------------------------------------------------------- tracker vs PyTorch's MemTracker
def test_categories_agree_with_pytorch_memtracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    def run(kind):
        torch.manual_seed(0)
        model = memlab.MLP(128, 256, 3, 10)
        opt = torch.optim.Adam(model.parameters())
        x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))
        snaps = {}
        if kind == "memlab":
            tr = memlab.MemoryTracker(model, opt)
            tr.watch(tensors=[x, y])
            with tr:
                with memlab.phase("forward"):
                    loss = F.cross_entropy(model(x), y)
                with memlab.phase("backward"):
                    snaps["fwd"] = tr.breakdown()
                    loss.backward()
                snaps["bwd"] = tr.breakdown()
                opt.step()
                snaps["step"] = tr.breakdown()
            return snaps, tr.peak
        mt = MemTracker()
        mt.track_external(model, opt, x, y)
        with mt:
            loss = F.cross_entropy(model(x), y)
            snaps["fwd"] = dict(mt.get_tracker_snapshot()[torch.device("cpu")])
            loss.backward()
            snaps["bwd"] = dict(mt.get_tracker_snapshot()[torch.device("cpu")])
            opt.step()
            snaps["step"] = dict(mt.get_tracker_snapshot()[torch.device("cpu")])
        peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        return snaps, peak

    ours, our_peak = run("memlab")
    theirs, their_peak = run("torch")

    def near(a, b, what):
        assert abs(a - b) <= 0.01 * max(b, 1), f"{what}: memlab {a} vs MemTracker {b}"

    snap = {k: {getattr(kk, "value", kk): vv for kk, vv in v.items()} for k, v in theirs.items()}
    key = lambda d, name: d[name]  # noqa: E731
    near(ours["step"]["parameters"], key(snap["step"], "Parameter"), "parameters")
    near(ours["bwd"]["gradients"], key(snap["bwd"], "Gradient"), "gradients after backward")
    near(ours["step"]["optimizer"], key(snap["step"], "Optstate"), "optimizer state after step")
    # MemTracker calls everything the forward made "activations"; memlab splits off what dies young
    near(ours["fwd"]["activations"] + ours["fwd"]["temporaries"] - 64 * 128 * 4 - 64 * 8,
         key(snap["fwd"], "Activation"), "forward activations")
    near(our_peak, their_peak, "peak")


# ----------------------------------------------------------------------------- devices: meta and fake
def _phased_sgd_step(device="cpu"):
    """Build a small MLP and SGD inside the active tracker(s) and run one phased step."""
    torch.manual_seed(0)
    with torch.device(device):                 # build in place: .to() cannot swap tracked parameters
        model = memlab.MLP(32, 64, 2, 5)
        x = torch.randn(16, 32)
        y = torch.randint(0, 5, (16,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    memlab.watch(model, opt)
    with memlab.phase("forward"):
        loss = F.cross_entropy(model(x), y)
    with memlab.phase("backward"):
        loss.backward()
    with memlab.phase("step"):
        opt.step()


def test_meta_and_fake_tensors_measure_the_same_bytes():
    peaks = {}
    for device in ("cpu", "meta"):
        tr = memlab.MemoryTracker(device=device)
        with tr:
            _phased_sgd_step(device)
        peaks[device] = tr.peak
    assert peaks["cpu"] == peaks["meta"]

    run = memlab.VirtualGPU(capacity_gb=1).run(_phased_sgd_step)
    # the virtual GPU rounds each storage to 512 bytes like the CUDA caching allocator
    tr = memlab.MemoryTracker(device="cpu", round_to=512)
    with tr:
        _phased_sgd_step()
    assert run.fits and run.peak == tr.peak
    assert peaks["cpu"] < run.peak


# ----------------------------------------------------------------------------- virtual GPU at full size
def _llama_step(foreach=True, B=1, T=512):
    cfg = memlab.GPTConfig.llama_7b()
    model = memlab.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    memlab.watch(model, opt)
    x = torch.randint(0, cfg.vocab_size, (B, T))
    memlab.train_step(model, opt, x, x)
    return E.gpt_param_count(cfg)


def test_7b_adam_step_runs_on_a_laptop_and_needs_20_bytes_per_param():
    run = memlab.VirtualGPU(capacity_gb=1000).run(_llama_step)
    n = run.value
    assert 6.7e9 < n < 6.8e9, n
    assert run.peak_phase == "step"
    # fp32 weights + grads + Adam's two moments = 16 B/param; foreach AdamW adds a 4 B/param sqrt buffer
    assert 19.9 < run.peak / n < 20.1, run.peak / n
    assert run.peak_breakdown["optimizer"] > 8 * n


def test_7b_does_not_fit_an_a100_80gb_and_says_why():
    with pytest.raises(torch.OutOfMemoryError) as e:
        memlab.VirtualGPU("A100-80GB").run(_llama_step)
    msg = str(e.value)
    assert "CUDA out of memory" in msg and "Tried to allocate" in msg
    assert "parameters" in msg and "gradients" in msg
    run = memlab.VirtualGPU("A100-80GB").run(_llama_step, catch_oom=True)
    assert not run.fits and run.headroom < 0 and run.oom_message


# ----------------------------------------------------------------------------- estimator vs tracker: the zoo
@pytest.mark.parametrize("first_step", [False, True], ids=["steady", "first-step"])
@pytest.mark.parametrize("entry", zoo.ZOO, ids=zoo.label)
def test_estimate_within_2_percent_of_the_tracker(entry, first_step):
    measured, est, _ = zoo.measure(entry, first_step)
    err = (est.peak - measured) / measured
    assert abs(err) < 0.02, \
        f"{zoo.label(entry)}: predicted {est.peak}, measured {measured} ({100 * err:+.2f}%) {est.candidates}"


def test_formulas_agree_with_their_sources():
    # ZeRO paper, Figure 1: 7.5B parameters on 64 GPUs
    psi, n = 7.5e9, 64
    got = [E.zero_model_state_bytes(int(psi), n, s) / 1e9 for s in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]
    # GPT-2 small has 124M parameters (tied embedding)
    assert 124e6 < E.gpt_param_count(memlab.GPTConfig.gpt2_small()) < 125e6
    assert E.gpt_param_count(memlab.GPTConfig.tiny()) == memlab.GPT(memlab.GPTConfig.tiny()).num_params()
    assert E.korthikanti_activation_bytes(2048, 1, 4096, 32) == 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert E.BYTES_PER_PARAM[("fp32", "adam")] == 16 and E.BYTES_PER_PARAM[("bf16", "adam")] == 8


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call, exc, words", [
    (lambda: memlab.VirtualGPU("V100-32GB"), ValueError, "preset"),
    (lambda: memlab.VirtualGPU(capacity_gb=0), ValueError, "capacity_gb"),
    (lambda: memlab.VirtualGPU(capacity_gb="big"), TypeError, "capacity_gb"),
    (lambda: memlab.VirtualGPU(), ValueError, "preset"),
    (lambda: memlab.VirtualGPU("T4-16GB").run(42), TypeError, "step"),
    (lambda: memlab.MemoryTracker(capacity=-1), ValueError, "capacity"),
    (lambda: memlab.MemoryTracker(model="mlp"), TypeError, "model"),
    (lambda: memlab.MemoryTracker(optimizer=3), TypeError, "optimizer"),
    (lambda: memlab.MemoryTracker(round_to=0), ValueError, "round_to"),
    (lambda: memlab.MemoryTracker().watch(category="weights"), ValueError, "category"),
    (lambda: memlab.phase(""), ValueError, "phase"),
    (lambda: memlab.pick_device("tpu"), ValueError, "prefer"),
    (lambda: memlab.format_bytes("1"), TypeError, "n"),
    (lambda: memlab.GPTConfig(n_embd=100, n_head=3), ValueError, "n_embd"),
    (lambda: memlab.GPTConfig(attn="flash"), ValueError, "attn"),
    (lambda: memlab.MLP(depth=0), ValueError, "depth"),
    (lambda: E.model_state_bytes(10, "fp8", "adam"), ValueError, "precision"),
    (lambda: E.model_state_bytes(10, "fp32", "lion"), ValueError, "optimizer"),
    (lambda: E.model_state_bytes(0), ValueError, "n_params"),
    (lambda: E.mlp_peak_bytes(0, 1, 1, 1, 1), ValueError, "batch"),
    (lambda: E.gpt_activation_bytes(memlab.GPTConfig(attn="math"), 1, 1), ValueError, "attn"),
    (lambda: E.zero_model_state_bytes(10, 2, 4), ValueError, "stage"),
    (lambda: breakdown_bar({}), ValueError, "breakdowns"),
    (lambda: breakdown_bar({"a": {}}, unit="MB"), ValueError, "unit"),
    (lambda: calculator_rows(-1, "fp32", "adam"), ValueError, "billions"),
])
def test_bad_input_names_the_argument(call, exc, words):
    with pytest.raises(exc, match=words):
        result = call()
        if words == "phase":        # memlab.phase checks its name when the block is entered
            with result:
                pass


def test_one_validation_module_names_the_argument_and_what_is_allowed():
    from memlab.core import validate as V
    for call, exc, msg in [
        (lambda: V.pos_int("batch", 0), ValueError, "batch must be a positive int, got 0"),
        (lambda: V.pos_int("batch", True), ValueError, "batch must be a positive int, got True"),
        (lambda: V.pos_int("batch", 2.0), ValueError, "batch must be a positive int, got 2.0"),
        (lambda: V.pos_int("bucket", -1, zero_ok=True), ValueError, "bucket must be a non-negative int, got -1"),
        (lambda: V.int_at_least("steps", 1, 2), ValueError, "steps must be an int >= 2, got 1"),
        (lambda: V.pos_float("timeout", float("nan")), ValueError, "timeout must be a positive number, got nan"),
        (lambda: V.pos_float("bw", float("inf"), finite=True), ValueError, "bw must be a positive finite number"),
        (lambda: V.number_in("headroom", 1, 0, 1), ValueError, r"headroom must be a number in \[0, 1\), got 1"),
        (lambda: V.number_type("capacity", "1"), TypeError, "capacity must be a number, got str"),
        (lambda: V.flag("fused", 1), TypeError, "fused must be a bool, got int"),
        (lambda: V.one_of("stage", 4, (0, 1, 2, 3)), ValueError, r"stage must be one of \(0, 1, 2, 3\), got 4"),
        (lambda: V.one_of("stage", True, (0, 1, 2, 3)), ValueError, "stage must be one of"),
        (lambda: V.one_of("unit", [], ("GiB",)), ValueError, "unit must be one of"),
    ]:
        with pytest.raises(exc, match=msg):
            call()
    assert V.pos_int("n", 3) == 3 and V.pos_int("n", 0, zero_ok=True) == 0 and V.number_in("p", 0, 0, 1) == 0
    assert V.number_in("s", 10, 0, 10, hi_open=False) == 10 and V.one_of("q", None, (None, "nf4")) is None
    assert V.pos_float("t", 0.5) == 0.5 and V.flag("f", False) is False


def test_one_dtype_size_function():
    from memlab import attention
    from memlab.hardware import hierarchy
    from memlab.core.dtypes import dtype_bytes
    assert attention.dtype_bytes is hierarchy.dtype_bytes is dtype_bytes
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        assert dtype_bytes(dt) == torch.empty((), dtype=dt).element_size()
    assert [dtype_bytes(n) for n in ("fp32", "float32", "tf32", "bf16", "bfloat16", "fp16", "fp8", "int8")] == \
        [4, 4, 4, 2, 2, 2, 1, 1]
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("fp13")
    with pytest.raises(TypeError, match="dtype"):
        dtype_bytes(torch.int32)


# ----------------------------------------------------------------------------- the rest of the kit
def test_plots_and_calculator():
    torch.manual_seed(0)
    model = memlab.MLP(16, 32, 2, 4)
    tr = _mlp_step(model, torch.optim.Adam(model.parameters()), lambda: (torch.randn(8, 16), torch.randint(0, 4, (8,))))
    assert len(timeline(tr).collections) >= 1
    ax = breakdown_bar({"step": tr.peak_breakdown}, capacity=2 * tr.peak)
    assert len(ax.patches) >= 3
    assert len(tradeoff([1, 2], {"measured": [1, 2], "predicted": [1, 2]}, "x", "y").lines) == 2
    rows = calculator_rows(7, "fp32", "adam")
    assert any("16 B/param" in r for r in rows)
    assert any("A100-80GB" in r and "NOT fit" in r for r in rows)


def test_device_summary_on_this_machine():
    info = memlab.describe()
    assert info.type in ("cpu", "cuda", "mps")
    assert info.type in str(info) and "bf16" in str(info)
    assert memlab.on_colab() is False


def test_importing_memlab_allocates_nothing():
    import subprocess
    import sys
    code = ("import torch, memlab, sys; "
            "sys.exit(1 if torch.cuda.is_available() and torch.cuda.is_initialized() else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tracker_matches_the_cuda_allocator():
    torch.manual_seed(0)
    model = memlab.MLP(1024, 2048, 4, 10).cuda()
    opt = torch.optim.Adam(model.parameters())
    torch.cuda.synchronize()
    tr = memlab.MemoryTracker(model, opt, round_to=512)
    with tr:
        x, y = torch.randn(512, 1024, device="cuda"), torch.randint(0, 10, (512,), device="cuda")
        memlab.train_step(model, opt, x, y)
    base = tr.cuda_stats["allocated_at_enter"]
    allocator_peak = tr.cuda_stats["max_allocated"] - base + tr.peak_breakdown["parameters"]
    # the allocator also holds cuBLAS workspaces; the tracker must be within 5% of it
    assert abs(tr.peak - allocator_peak) <= 0.05 * allocator_peak, (tr.peak, allocator_peak, tr.cuda_stats)


# ============================================================================= memlab.clinic.run_as_cuda (lesson 04)
# The virtual GPU's OOM, worded as PyTorch's CUDA allocator words it, so that accelerate's back-off recognises it.
def _hold_mib(batch_size, phase_name="forward"):
    """A stand-in step for the virtual GPU: holds batch_size MiB inside a memlab phase."""
    with memlab.phase(phase_name):
        return torch.empty(batch_size, 2**20, dtype=torch.uint8).nbytes


def test_run_as_cuda_rewords_the_virtual_oom_for_accelerate():
    from accelerate.utils.memory import should_reduce_batch_size
    from memlab.clinic import run_as_cuda
    gpu = memlab.VirtualGPU(capacity_gb=10 / 1024)                    # 10 MiB
    with pytest.raises(torch.OutOfMemoryError) as raw:
        gpu.run(_hold_mib, 16)
    assert raw.value.args[0].startswith("CUDA out of memory during phase 'forward'.")
    assert not should_reduce_batch_size(raw.value), "the reason run_as_cuda exists"
    with pytest.raises(torch.OutOfMemoryError) as worded:
        run_as_cuda(gpu, _hold_mib, 16, phase_name="backward")
    first, *rest = worded.value.args[0].splitlines()
    assert first.startswith("CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 (custom-")
    assert first.endswith("(memlab: during phase 'backward')")
    assert rest == raw.value.args[0].splitlines()[1:]                  # the live breakdown is kept
    assert len(worded.value.args) == 1 and should_reduce_batch_size(worded.value)
    assert worded.value.__context__ is None                            # raised outside the except block
    run = run_as_cuda(gpu, _hold_mib, 8)                               # fits: the VirtualRun comes back
    assert run.fits and run.value == 8 * 2**20


def test_run_as_cuda_outside_a_phase_and_with_catch_oom():
    from accelerate.utils.memory import should_reduce_batch_size
    from memlab.clinic import run_as_cuda
    gpu = memlab.VirtualGPU(capacity_gb=10 / 1024)
    with pytest.raises(torch.OutOfMemoryError) as idle:               # no phase: already CUDA's words, unchanged
        run_as_cuda(gpu, lambda: torch.empty(16, 2**20, dtype=torch.uint8))
    assert idle.value.args[0].startswith("CUDA out of memory. Tried") and should_reduce_batch_size(idle.value)
    assert "memlab: during phase" not in idle.value.args[0]
    assert run_as_cuda(gpu, _hold_mib, 16, catch_oom=True).fits is False


def test_run_as_cuda_checks_its_gpu():
    from memlab.clinic import run_as_cuda
    with pytest.raises(TypeError, match="gpu must be a memlab.VirtualGPU, got str"):
        run_as_cuda("T4-16GB", _hold_mib, 1)


def test_accelerate_back_off_on_the_virtual_gpu_stops_where_its_sequence_first_fits():
    from accelerate.utils import find_executable_batch_size
    from memlab.clinic import run_as_cuda
    gpu = memlab.VirtualGPU(capacity_gb=10 / 1024)                    # holds 10 MiB
    for start, rule, expected in ((16, None, [16, 14, 12, 10]), (64, lambda b: b // 2, [64, 32, 16, 8])):
        tried = []

        def train(batch_size):
            tried.append(batch_size)
            return run_as_cuda(gpu, _hold_mib, batch_size).value

        kw = {} if rule is None else {"reduce_batch_size_fn": lambda: rule(tried[-1])}
        assert find_executable_batch_size(train, starting_batch_size=start, **kw)() == expected[-1] * 2**20
        assert tried == expected
