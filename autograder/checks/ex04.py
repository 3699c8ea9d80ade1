"""Checks for exercise 04, "The OOM clinic", and the clinic's kit.

The kit (`build_gpt`, `random_tokens`, the four original scripts) is imported by
the exercise notebook, so the learner's scripts and the grader build exactly the
same models. Each original script runs out of memory at full size on a named
virtual GPU; at "tiny" size the same code runs on real CPU tensors.

A fix is graded on both halves:
1. it fits: at full size on the virtual GPU, in steady state (from the second
   step on, AdamW's state is alive during forward and backward too), with at
   least `HEADROOM` to spare, and it still does the original's work (same model,
   same number of sequences, one AdamW step with a gradient for every parameter);
2. it trains the same model: on a tiny instance with fresh random data, the
   gradients the optimizer receives, its hyperparameters and the updated
   parameters (or the returned losses) equal those of the original script.

Each `check_task4_M(student, *, hidden)` raises AssertionError with a message
that says what was expected and the likely mistake.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.optim.optimizer as _optimizer_module
from torch.nn.modules.module import register_module_forward_pre_hook

import memlab
from memlab.models import GPT, GPTConfig
from memlab.track import active_trackers

from .common import mb, rng, torch_seed

__all__ = ["MODELS", "SEQ_LEN", "HEADROOM", "CASES", "build_gpt", "random_tokens", "run_full_size", "train_big_batch",
           "evaluate", "train_accumulated", "train_1b3", "check_task4_1", "check_task4_2", "check_task4_3",
           "check_task4_4", "check_task4_5", "check_task4_6"]

# ----------------------------------------------------------------------------- the clinic kit
_TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=32)
MODELS = {   # name -> {"full": real shapes, "tiny": a stand-in that runs on a CPU in milliseconds}
    "gpt2-small": {"full": GPTConfig.gpt2_small(), "tiny": GPTConfig.tiny(**_TINY)},
    "gpt2-medium": {"full": GPTConfig.gpt2_medium(), "tiny": GPTConfig.tiny(**_TINY)},
    "gpt-1.3b": {"full": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=2048),
                 "tiny": GPTConfig.tiny(n_layer=2, n_head=4, n_embd=64, vocab_size=64, block_size=32)},
}
SEQ_LEN = {"full": 1024, "tiny": 16}     # tokens per sequence
HEADROOM = 512 * 2**20                   # left free for the CUDA context and allocator rounding (not modelled)


def _check_size(size) -> str:
    if size not in SEQ_LEN:
        raise ValueError(f"size must be 'full' or 'tiny', got {size!r}")
    return size


def build_gpt(name: str, size: str) -> GPT:
    """The model a clinic script trains: real shapes at size="full" (build it inside a virtual GPU run: fake
    tensors), a tiny stand-in at size="tiny". Its initial weights come from torch's global random generator."""
    if name not in MODELS:
        raise ValueError(f"name must be one of {sorted(MODELS)}, got {name!r}")
    return GPT(MODELS[name][_check_size(size)])


def random_tokens(name: str, size: str, n: int, generator: torch.Generator | None = None):
    """(x, y): n random sequences of token ids and next-token targets, each of shape (n, SEQ_LEN[size])."""
    cfg = MODELS[name][_check_size(size)]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    shape = (n, SEQ_LEN[size])
    x = torch.randint(0, cfg.vocab_size, shape, generator=generator)
    y = torch.randint(0, cfg.vocab_size, shape, generator=generator)
    return x, y


# ----------------------------------------------------------------------------- the four patients
def train_big_batch(size="full", data=None):
    """One AdamW step of GPT-2 medium on a batch of 16 sequences of 1024 tokens.
    Runs out of memory on a T4-16GB."""
    model = build_gpt("gpt2-medium", size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)     # foreach=True: the CUDA default
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 16)   # (16, T) ids and targets
    with memlab.phase("forward"):
        loss = model(x, y)                                                  # mean over 16 x T tokens
    with memlab.phase("backward"):
        loss.backward()
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def evaluate(size="full", data=None):
    """The mean loss of each of 3 evaluation batches of 16 sequences (GPT-2 medium).
    Runs out of memory on a T4-16GB."""
    model = build_gpt("gpt2-medium", size)
    memlab.watch(model)
    model.eval()
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 48)   # (48, T)
    losses = []
    for i in range(0, 48, 16):
        with memlab.phase("forward"):
            losses.append(model(x[i:i + 16], y[i:i + 16]))                  # one batch of 16
    return torch.stack(losses)                                              # (3,) mean loss per batch


def train_accumulated(size="full", data=None):
    """One AdamW step of GPT-2 small on 32 sequences, as 4 micro-batches of 8.
    Runs out of memory on a T4-16GB, although one micro-batch alone fits."""
    model = build_gpt("gpt2-small", size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-small", size, 32)    # (32, T)
    total = 0.0
    for i in range(0, 32, 8):
        with memlab.phase("forward"):
            total = total + model(x[i:i + 8], y[i:i + 8]) / 4               # mean over the 32 sequences
    with memlab.phase("backward"):
        total.backward()
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def train_1b3(size="full", data=None):
    """One AdamW step of a 1.3B-parameter GPT (24 layers, width 2048) on 2 sequences of 1024 tokens.
    Forward and backward fit on an L4-24GB; the first optimizer step does not."""
    model = build_gpt("gpt-1.3b", size)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, foreach=True)     # foreach=True: the CUDA default
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt-1.3b", size, 2)       # (2, T)
    with memlab.phase("forward"):
        loss = model(x, y)
    with memlab.phase("backward"):
        loss.backward()
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@dataclass(frozen=True)
class Case:
    task: str
    original: Callable
    fixed_name: str          # the name of the learner's function
    gpu: str                 # virtual GPU preset it must fit
    model: str               # key of MODELS
    rows: int                # sequences the script pushes through the model
    trains: bool             # True: returns the model after one AdamW step; False: returns losses
    hint_oom: str            # what to try when it still runs out


CASES = {
    "task4_1": Case("task4_1", train_big_batch, "train_big_batch_fixed", "T4-16GB", "gpt2-medium", 16, True,
                    "A batch of 16 does not fit in one forward pass: split it into micro-batches and accumulate "
                    "the gradients (dividing each micro-batch loss so the sum is the mean over all 16)."),
    "task4_2": Case("task4_2", evaluate, "evaluate_fixed", "T4-16GB", "gpt2-medium", 48, False,
                    "Evaluation needs no backward: run the forward passes under torch.no_grad() (or "
                    "torch.inference_mode()) so autograd saves nothing."),
    "task4_3": Case("task4_3", train_accumulated, "train_accumulated_fixed", "T4-16GB", "gpt2-small", 32, True,
                    "Summing the micro-batch losses into one tensor keeps all four graphs alive until the single "
                    "backward: call backward on each micro-batch's loss (divided by 4) as soon as it is computed."),
    "task4_4": Case("task4_4", train_1b3, "train_1b3_fixed", "L4-24GB", "gpt-1.3b", 2, True,
                    "The OOM is in the optimizer step: AdamW creates its state there and, with foreach=True, "
                    "also a temporary as large as all the parameters. Keep AdamW (and its maths): what does "
                    "foreach=False change?"),
}


# ----------------------------------------------------------------------------- recording what a script does
class _Recorder:
    """Global hooks that watch every GPT forward and every optimizer step while active.

    clone=False (full size, fake tensors): count only. clone=True (tiny): keep the
    initial weights, and at each step the gradients and hyperparameters, by name.
    Inside a memlab tracker (the virtual GPU) it also notes the peak reached
    before each step and the bytes of optimizer state after it: from the second
    step on, that state is alive during forward and backward too."""

    def __init__(self, clone: bool):
        self.clone = clone
        self.rows = 0
        self.configs: list[GPTConfig] = []
        self.model: GPT | None = None
        self.initial: list[tuple[str, torch.Tensor]] = []
        self.steps: list[dict] = []
        self.pre_step_peak: list[int] = []
        self.state_bytes: list[int] = []
        self._handles = []

    def __enter__(self):
        self._handles = [register_module_forward_pre_hook(self._forward),
                         _optimizer_module.register_optimizer_step_pre_hook(self._step),
                         _optimizer_module.register_optimizer_step_post_hook(self._after_step)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return False

    def _forward(self, module, args):
        if not isinstance(module, GPT):
            return None
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1:
            self.rows += int(args[0].shape[0])
        if module.cfg not in self.configs:
            self.configs.append(module.cfg)
        if self.model is None:
            self.model = module
            if self.clone:
                self.initial = [(n, p.detach().clone()) for n, p in module.named_parameters()]
        return None

    def _step(self, opt, args, kwargs):
        # parameters are matched by their position in model.named_parameters(), which wrapping blocks (e.g. for
        # checkpointing) keeps, while it changes their names; the reference's names are used in messages
        index = {}
        if self.model is not None:
            index = {id(p): (i, n) for i, (n, p) in enumerate(self.model.named_parameters())}
        rec = {"optimizer": type(opt).__name__, "missing": [], "grads": {}, "hyper": {}}
        for group in opt.param_groups:
            hyper = {k: group.get(k) for k in ("lr", "betas", "eps", "weight_decay", "momentum", "amsgrad",
                                               "maximize", "nesterov", "dampening")}
            for p in group["params"]:
                key = index.get(id(p), (f"?{len(rec['hyper'])}", "a parameter outside the model"))
                rec["hyper"][key[0]] = hyper
                if p.grad is None:
                    rec["missing"].append(key[1])
                elif self.clone:
                    rec["grads"][key[0]] = p.grad.detach().clone()
        self.steps.append(rec)
        if active_trackers():
            self.pre_step_peak.append(active_trackers()[-1].peak)
        return None

    def _after_step(self, opt, args, kwargs):
        seen, total = set(), 0
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    st = v.untyped_storage()
                    if st._cdata not in seen:
                        seen.add(st._cdata)
                        total += -(-st.nbytes() // 512) * 512      # rounded as the virtual GPU rounds
        self.state_bytes.append(total)
        return None


# ----------------------------------------------------------------------------- half 1: it fits
def _check_callable(fn, name):
    if not callable(fn):
        raise AssertionError(f"{name} must be a function taking (size='full', data=None), got {type(fn).__name__}")


def run_full_size(script, gpu):
    """Run a clinic script at full size on a virtual GPU, catching the OOM.

    Returns (VirtualRun, steady-state peak in bytes, recorder). The steady state is the larger of this first
    step's peak and the peak reached before the optimizer step plus the optimizer state that step created:
    from the second step on, that state is alive before the step too. It does not rely on phase marks."""
    rec = _Recorder(clone=False)
    with rec:
        run = gpu.run(script, "full", catch_oom=True)
    steady = run.peak
    if run.fits and rec.pre_step_peak and rec.state_bytes:
        steady = max(run.peak, rec.pre_step_peak[0] + rec.state_bytes[0])
    return run, steady, rec


def _run_full(case: Case, fixed):
    gpu = memlab.VirtualGPU(case.gpu)
    try:
        run, steady, rec = run_full_size(fixed, gpu)
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - report any failure of the learner's code as a teaching message
        raise AssertionError(f"{case.fixed_name}('full') raised {type(e).__name__}: {e}. At full size it runs on the "
                             f"virtual GPU's fake tensors: build the model, optimizer and data inside the function "
                             f"(build_gpt, random_tokens) and do not read tensor values (.item(), print(tensor)).")
    return gpu, rec, run, steady


def _check_fits(case: Case, fixed) -> str:
    gpu, rec, run, steady = _run_full(case, fixed)
    name = case.fixed_name
    if not run.fits:
        raise AssertionError(f"{name}('full') still runs out of memory on the {case.gpu}:\n{run.oom_message}\n"
                             f"{case.hint_oom}")
    want_cfg = MODELS[case.model]["full"]
    assert rec.configs == [want_cfg], (
        f"{name}('full') must train the original model, {case.model} (build_gpt({case.model!r}, size)); it ran "
        f"{len(rec.configs)} different GPT configuration(s): {rec.configs}. Fix the memory, not the model.")
    assert rec.rows == case.rows, (
        f"{name}('full') pushed {rec.rows} sequences through the model; the original processes {case.rows}. "
        + ("Shrinking the batch fits, but trains on fewer samples: keep all of them (accumulate gradients "
           "over micro-batches)." if rec.rows < case.rows else
           "Every sequence should go through the model exactly once."))
    if case.trains:
        assert len(rec.steps) == 1, (
            f"{name}('full') took {len(rec.steps)} optimizer steps; the original takes exactly one (accumulation "
            f"calls optimizer.step() once, after all micro-batches).")
        step = rec.steps[0]
        assert step["optimizer"] == "AdamW", (
            f"{name}('full') steps a {step['optimizer']} optimizer; the original trains with AdamW. Switching "
            f"optimizers is a different training run, not a memory fix: keep AdamW.")
        assert not step["missing"], (
            f"at full size the optimizer stepped while {len(step['missing'])} parameters had no gradient (e.g. "
            f"{step['missing'][:3]}): did you run the forward under torch.no_grad()/inference_mode(), or detach "
            f"the loss? Then nothing is trained.")
    else:
        assert not rec.steps, f"{name}('full') is an evaluation: it must not step an optimizer"
    limit = gpu.capacity - HEADROOM
    if steady > limit:
        extra = ""
        if steady > run.peak:
            extra = (f" This first step peaks at {mb(run.peak)}, but from the second step on AdamW's "
                     f"{mb(rec.state_bytes[0])} of state is alive during forward and backward too.")
        raise AssertionError(
            f"{name}('full') peaks at {mb(steady)} in steady state on the {case.gpu} ({mb(gpu.capacity)}), "
            f"leaving {mb(gpu.capacity - steady)}: keep at least {mb(HEADROOM)} free for the CUDA context and "
            f"allocator rounding, which the virtual GPU does not model.{extra} {case.hint_oom}")
    return (f"{name}('full') fits the {case.gpu}: steady-state peak {mb(steady)}, headroom "
            f"{mb(gpu.capacity - steady)}")


# ----------------------------------------------------------------------------- half 2: same maths
def _norm(t: torch.Tensor) -> float:
    return t.double().norm().item()


def _run_tiny(fn, name, data, seed):
    rec = _Recorder(clone=True)
    torch.manual_seed(seed)
    try:
        with rec:
            out = fn("tiny", data=(data[0].clone(), data[1].clone()))
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{name}('tiny', data=...) raised {type(e).__name__}: {e}. At size 'tiny' it must run "
                             f"on real CPU tensors, on the (x, y) batch given as `data`.")
    return rec, out


def _compare_grads(case, ref_step, stu_step, k_hint, names):
    name = case.fixed_name
    assert not stu_step["missing"], (
        f"on the tiny instance the optimizer stepped while {len(stu_step['missing'])} parameters had no gradient "
        f"(e.g. {stu_step['missing'][:3]}): training under torch.no_grad()/inference_mode() or on a detached loss "
        f"computes nothing to learn from.")
    assert stu_step["optimizer"] == ref_step["optimizer"], (
        f"{name} steps a {stu_step['optimizer']} optimizer; the original uses {ref_step['optimizer']}. A different "
        f"optimizer trains a different model: keep {ref_step['optimizer']} and fix the memory another way.")
    assert set(stu_step["hyper"]) == set(ref_step["hyper"]), (
        f"{name}'s optimizer updates different parameters than the original's: give it every parameter of the "
        f"model, once")
    for i, h in ref_step["hyper"].items():
        assert stu_step["hyper"][i] == h, (
            f"{name}'s optimizer hyperparameters for {names[i]} are {stu_step['hyper'][i]}; the original uses {h}. "
            f"Keep the learning rate, betas, eps and weight decay: the fix must not change the maths.")
    g_ref = torch.cat([ref_step["grads"][i].flatten() for i in sorted(ref_step["hyper"])])
    g_stu = torch.cat([stu_step["grads"][i].flatten() for i in sorted(ref_step["hyper"])])
    err = _norm(g_stu - g_ref) / max(_norm(g_ref), 1e-30)
    if err > 1e-4:
        ratio = _norm(g_stu) / max(_norm(g_ref), 1e-30)
        cos = (g_stu.double() @ g_ref.double()).item() / max(_norm(g_stu) * _norm(g_ref), 1e-30)
        if cos > 0.9999:
            why = (f"Your gradient points the same way but is {ratio:.3g}x the original's: a loss scale is off. "
                   f"{k_hint}")
        else:
            why = (f"Your gradient points elsewhere (cosine {cos:.4f} with the original's): it was computed from "
                   f"different samples or a different loss. Every sequence of the batch must contribute, each "
                   f"weighted as in the original's mean — a smaller batch without accumulation trains a "
                   f"different model.")
        raise AssertionError(f"on a tiny instance with fresh random data, the gradient {name} hands to the optimizer "
                             f"differs from the original's by {err:.2e} (relative). {why}")


def _check_same_maths(case: Case, fixed, hidden: bool) -> str:
    r = rng(hidden, 400 + int(case.task[-1]))
    seed = torch_seed(r)
    gen = torch.Generator().manual_seed(r.randrange(2**31))
    data = random_tokens(case.model, "tiny", case.rows, generator=gen)
    ref_rec, ref_out = _run_tiny(case.original, case.original.__name__, data, seed)
    stu_rec, stu_out = _run_tiny(fixed, case.fixed_name, data, seed)
    name = case.fixed_name
    assert stu_rec.configs == ref_rec.configs, (
        f"{name}('tiny') ran a different model ({stu_rec.configs}) than the original ({ref_rec.configs}): use "
        f"build_gpt({case.model!r}, size)")
    names = [n for n, _ in ref_rec.initial]
    same_start = len(stu_rec.initial) == len(ref_rec.initial) and all(
        a.shape == b.shape and torch.equal(a, b) for (_, a), (_, b) in zip(stu_rec.initial, ref_rec.initial))
    assert same_start, (
        f"{name}('tiny') starts from different weights than the original. Build the model first, with "
        f"build_gpt({case.model!r}, size), before drawing any random numbers, and keep all its parameters.")
    if not case.trains:
        if not isinstance(stu_out, torch.Tensor):
            raise AssertionError(f"{name} must return the losses as a tensor of shape {tuple(ref_out.shape)} "
                                 f"(like the original), got {type(stu_out).__name__}")
        assert stu_out.shape == ref_out.shape, (
            f"{name} returned losses of shape {tuple(stu_out.shape)}; the original returns {tuple(ref_out.shape)} "
            f"(the mean loss of each batch of 16)")
        assert torch.allclose(stu_out.detach().float(), ref_out.detach().float(), rtol=1e-5, atol=1e-6), (
            f"{name} returned losses {stu_out.detach().tolist()} but the original computes {ref_out.detach().tolist()} "
            f"on the same data: keep the batches of 16 and the per-batch mean.")
        return f"{name}('tiny') returns the original's losses"
    assert len(stu_rec.steps) == len(ref_rec.steps) == 1, (
        f"{name}('tiny') took {len(stu_rec.steps)} optimizer steps; the original takes one")
    k_hint = ("Divide each micro-batch's loss by the number of micro-batches, so that the accumulated gradient is "
              "the gradient of the mean over the whole batch.")
    _compare_grads(case, ref_rec.steps[0], stu_rec.steps[0], k_hint, names)
    if not isinstance(stu_out, torch.nn.Module):
        raise AssertionError(f"{name} must return the trained model (like the original), got "
                             f"{type(stu_out).__name__}")
    ref_params = list(ref_out.named_parameters())
    stu_params = [p for _, p in stu_out.named_parameters()]
    assert len(stu_params) == len(ref_params) and all(a.shape == b.shape for a, (_, b) in zip(stu_params, ref_params)), (
        f"{name} returned a model with different parameters than the original: return the model you trained")
    # Adam's first step is about lr * g / (|g| + eps): where a gradient is as small as eps, float rounding in g
    # (micro-batches add in another order) moves that weight by up to 2 lr. So: almost every weight must agree to
    # 5% of a step, and none may be further apart than Adam's largest possible disagreement.
    lr = next(iter(ref_rec.steps[0]["hyper"].values()))["lr"]
    off, total, worst = 0, 0, (0.0, "")
    for got, (pname, w) in zip(stu_params, ref_params):
        diff = (got.detach() - w.detach()).abs()
        off += int((diff > 0.05 * lr).sum())
        total += diff.numel()
        if diff.max().item() > worst[0]:
            worst = (diff.max().item(), pname)
    assert off <= 1e-3 * total and worst[0] <= 2.5 * lr, (
        f"the gradients match, but after the step {off} of {total} weights differ from the original's by more "
        f"than 5% of the learning rate ({lr}); the largest difference is {worst[0]:.2e} in {worst[1]}. Step the "
        f"optimizer exactly once, after all micro-batches, and return the model it updated.")
    return f"{name}('tiny') computes the original's gradients and update"


def _check_script(task: str, fixed, hidden: bool) -> None:
    case = CASES[task]
    _check_callable(fixed, case.fixed_name)
    print(_check_fits(case, fixed))
    print(_check_same_maths(case, fixed, hidden))


def check_task4_1(train_big_batch_fixed, *, hidden: bool) -> None:
    """train_big_batch_fixed(size, data): fits a T4 at full size and takes the original's AdamW step."""
    _check_script("task4_1", train_big_batch_fixed, hidden)


def check_task4_2(evaluate_fixed, *, hidden: bool) -> None:
    """evaluate_fixed(size, data): fits a T4 at full size and returns the original's losses."""
    _check_script("task4_2", evaluate_fixed, hidden)


def check_task4_3(train_accumulated_fixed, *, hidden: bool) -> None:
    """train_accumulated_fixed(size, data): fits a T4 at full size and takes the original's AdamW step."""
    _check_script("task4_3", train_accumulated_fixed, hidden)


def check_task4_4(train_1b3_fixed, *, hidden: bool) -> None:
    """train_1b3_fixed(size, data): fits an L4 at full size and takes the original's AdamW step."""
    _check_script("task4_4", train_1b3_fixed, hidden)


# ----------------------------------------------------------------------------- task4_5
_ROUND = 512   # the virtual GPU rounds every storage up to 512 bytes, as the CUDA caching allocator does


def _round(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


def _staircase(fixed_bytes: int, per_sample: int):
    """A step whose memory is known exactly: a fixed buffer plus per_sample bytes per batch element."""
    def step(batch):
        state = torch.empty(fixed_bytes, dtype=torch.uint8)               # like model states
        acts = torch.empty(per_sample * batch, dtype=torch.uint8)         # like activations
        return state, acts
    return step


def _staircase_answer(gpu, fixed_bytes, per_sample, limit) -> int:
    room = gpu.capacity - _round(fixed_bytes)
    best = 0
    if room >= 0:
        best = min(limit, room // per_sample)
        while best > 0 and _round(per_sample * best) > room:               # rounding may cost one
            best -= 1
    return best


def _sequence_mlp_step(width):
    """One AdamW step of a 2-layer MLP over (batch, 1024, width) activations: cheap on fake tensors."""
    def step(batch):
        model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                    torch.nn.Linear(4 * width, width))
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        memlab.watch(model, opt)
        x = torch.randn(batch, 1024, width)
        with memlab.phase("forward"):
            loss = model(x).pow(2).mean()
        with memlab.phase("backward"):
            loss.backward()
        with memlab.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def _bisect_reference(gpu, step, limit) -> int:
    if not gpu.fits(step, 1):
        return 0
    if gpu.fits(step, limit):
        return limit
    lo, hi = 1, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if gpu.fits(step, mid) else (lo, mid)
    return lo


def check_task4_5(find_max_batch_size, *, hidden: bool) -> None:
    """find_max_batch_size(step_fn, gpu, limit=4096) -> the largest batch in [1, limit] that fits, 0 if none."""
    r = rng(hidden, 45)
    cases = []
    if hidden:
        for _ in range(6):
            cap = r.choice([4, 8, 12, 16, 24, 40])
            gpu = memlab.VirtualGPU(capacity_gb=cap)
            limit = r.choice([256, 1000, 4096, 5000])
            target = r.choice([1, 2, r.randint(3, limit - 1), 2 ** r.randint(2, 8), 2 ** r.randint(2, 8) - 1,
                               2 ** r.randint(2, 8) + 1])
            target = min(target, limit - 1)
            fixed = r.randrange(0, gpu.capacity // 2)
            per = max(1, (gpu.capacity - _round(fixed)) // target - r.randrange(0, 64))
            cases.append((gpu, fixed, per, limit))
        gpu = memlab.VirtualGPU(capacity_gb=r.choice([8, 16]))             # nothing fits
        cases.append((gpu, gpu.capacity + r.randrange(1, 10**6), 1000, 4096))
        gpu = memlab.VirtualGPU(capacity_gb=r.choice([8, 16]))             # everything up to the limit fits
        cases.append((gpu, r.randrange(0, 10**6), r.randrange(1, 10**4), r.choice([64, 4096])))
    else:
        cases.append((memlab.VirtualGPU("T4-16GB"), 6 * 2**30, 300 * 2**20, 4096))   # answer 34
        cases.append((memlab.VirtualGPU("T4-16GB"), 17 * 2**30, 2**20, 4096))        # nothing fits
    for gpu, fixed, per, limit in cases:
        want = _staircase_answer(gpu, fixed, per, limit)
        desc = (f"a step needing {mb(fixed)} + batch x {mb(per)} on a {mb(gpu.capacity)} virtual GPU, limit={limit}")
        _expect_max_batch(find_max_batch_size, gpu, _staircase(fixed, per), limit, want, desc)
    if not hidden:                                    # a real training step (a small MLP over long sequences)
        gpu = memlab.VirtualGPU("T4-16GB")
        step = _sequence_mlp_step(1024)
        want = _bisect_reference(gpu, step, 4096)
        _expect_max_batch(find_max_batch_size, gpu, step, 4096, want,
                          "one AdamW step of a width-1024 MLP over (batch, 1024, 1024) inputs on the T4-16GB")


def _expect_max_batch(find_max_batch_size, gpu, step, limit, want, desc):
    calls = []

    def counted(batch, *args, **kwargs):
        calls.append(batch)
        return step(batch, *args, **kwargs)

    try:
        got = find_max_batch_size(counted, gpu, limit=limit)
    except torch.OutOfMemoryError as e:
        raise AssertionError(f"find_max_batch_size let a torch.OutOfMemoryError escape ({desc}): probe with "
                             f"gpu.fits(step_fn, b) or catch the error — an OOM is an answer, not a crash. "
                             f"({str(e).splitlines()[0]})")
    if isinstance(got, bool) or not isinstance(got, int):
        raise AssertionError(f"find_max_batch_size must return a Python int, got {type(got).__name__}: {got!r}")
    budget = 2 * math.ceil(math.log2(limit)) + 3
    bad = [b for b in calls if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= limit]
    assert not bad, f"probe batch sizes must be ints in [1, limit={limit}]; you tried {bad[:5]} ({desc})"
    if got != want:
        if got == want + 1:
            hint = (f"one too large: batch {got} does not fit (it raises out-of-memory). When bisecting, return the "
                    f"largest batch you have SEEN fit (lo), not the first one that failed (hi).")
        elif got == want - 1:
            hint = f"one too small: batch {want} fits. Check the end of your search: probe until hi - lo == 1."
        elif want == 0:
            hint = "even batch 1 does not fit here: return 0."
        elif want == limit:
            hint = f"every batch up to limit={limit} fits: return limit."
        else:
            hint = "search by doubling until a batch fails, then bisect between the last fit and the first failure."
        raise AssertionError(f"{desc}: the largest batch that fits is {want}, you returned {got}: {hint}")
    assert len(calls) <= budget, (
        f"{desc}: you found {got} but ran {len(calls)} probe steps; a binary search needs at most about "
        f"2*log2(limit) = {budget} (double until it fails, then bisect). Each probe is a full training step.")


# ----------------------------------------------------------------------------- task4_6
def _leak_scenario(kind: str, batch: int, width: int, d_in: int, seed: int):
    """A fresh (step_fn, model, optimizer) whose training step leaks (or not) in a known way."""
    torch.manual_seed(seed)
    d_out = 10
    model = memlab.MLP(d_in, width, 2, d_out)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if kind == "none_sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = []
    g = torch.Generator().manual_seed(seed)
    xv, yv = torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g)
    if kind == "hook":
        model.layers[1].register_forward_hook(lambda mod, inp, out: kept.append(out))   # (B, width) per step

    def step():
        x, y = torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g)
        with memlab.phase("forward"):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
        with memlab.phase("backward"):
            loss.backward()
        if kind == "grads":
            kept.append([p.grad for p in model.parameters()])             # keeps every step's gradients
        with memlab.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        if kind == "outputs":
            kept.append(out)                                              # keeps a (B, d_out) output per step
        elif kind == "inputs":
            kept.append(x)                                                # keeps each input batch
        elif kind == "eval":
            with memlab.phase("forward"):                                 # evaluation with autograd on
                kept.append(model(xv, yv))

    return step, model, opt


def _reference_leak(step_fn, model, opt, n_steps):
    tracker = memlab.MemoryTracker(model, opt)
    rows = []
    with tracker:
        for _ in range(n_steps):
            step_fn()
            rows.append(tracker.breakdown())
    best = None
    for c in memlab.CATEGORIES:
        if all(rows[i][c] > rows[i - 1][c] for i in range(1, n_steps)):
            per = (rows[-1][c] - rows[0][c]) // (n_steps - 1)
            if best is None or per > best[1]:
                best = (c, per)
    return best


def check_task4_6(detect_leak, *, hidden: bool) -> None:
    """detect_leak(step_fn, model, optimizer, n_steps=5) -> (category, bytes per step) or None."""
    r = rng(hidden, 46)
    if hidden:      # three of the five leaks and one of the two traps (state created in the first step), shuffled
        kinds = r.sample(["outputs", "grads", "inputs", "eval", "hook"], 3) + [r.choice(["none_adam", "none_sgd"])]
        r.shuffle(kinds)
    else:
        kinds = ["outputs", "none_adam"]
    what = {"outputs": "the step keeps its outputs in a list", "grads": "the step keeps every step's gradients",
            "inputs": "the step keeps its input batches", "eval": "an evaluation with autograd on keeps its loss",
            "hook": "a forward hook keeps a block's output", "none_adam": "no leak (AdamW creates its state in step 1)",
            "none_sgd": "no leak (SGD creates its momentum in step 1)"}
    for kind in kinds:
        batch, width, d_in = (r.randint(2, 64), r.randint(8, 128), r.randint(4, 64)) if hidden else (16, 64, 32)
        n_steps = r.randint(3, 5) if hidden else 5
        seed = r.randrange(2**31)
        want = _reference_leak(*_leak_scenario(kind, batch, width, d_in, seed), n_steps)
        step_fn, model, opt = _leak_scenario(kind, batch, width, d_in, seed)
        try:
            got = detect_leak(step_fn, model, opt, n_steps=n_steps)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"detect_leak raised {type(e).__name__}: {e} (scenario: {what[kind]})")
        desc = f"{what[kind]}, batch {batch}, width {width}, {n_steps} steps"
        if want is None:
            assert got is None, (
                f"{desc}: nothing grows from step to step, but you reported {got!r}. The optimizer state (or "
                f"momentum) appears once, inside the first step: compare only steps after the first, and require "
                f"growth on every one of them.")
            continue
        if got is None or not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"{desc}: {want[0]} grows by {want[1]} bytes every step; you returned {got!r} "
                                 f"(expected a tuple (category, bytes_per_step))")
        cat, per = got
        assert cat == want[0], (
            f"{desc}: the category that grows every step is {want[0]!r} (+{want[1]} B per step); you reported "
            f"{cat!r}. Read tracker.breakdown() after each step inside ONE tracker and compare consecutive steps.")
        if isinstance(per, bool) or not isinstance(per, (int, float)) or not math.isfinite(per):
            raise AssertionError(f"{desc}: bytes_per_step must be a number, got {per!r}")
        assert abs(per - want[1]) <= max(16, 0.01 * want[1]), (
            f"{desc}: {want[0]} grows by {want[1]} bytes per step; you reported {per}. Average the growth over the "
            f"steps after the first: (after last step - after first step) / (n_steps - 1).")
