"""The OOM clinic of lesson and exercise 04: the models, the data, the four patients as they came in, and
`run_full_size`, the steady-state peak of a script on a virtual GPU (exercises 04 and 08, the benchmarks).

Exercise 04's notebook imports `MODELS`, `SEQ_LEN`, `build_gpt` and `random_tokens` from here, so the
learner's scripts, the grader and benchmarks/bench_oom_clinic.py build exactly the same models. Each original
script runs out of memory at full size on a named virtual GPU; at "tiny" size the same code runs on real CPU
tensors. The originals are the grader's reference for the maths of each fix (they are the patients, not
solutions); what each task asks of its fix lives with exercise 04's checks (autograder/checks/ex04/).
"""

from __future__ import annotations

import re

import torch
import torch.optim.optimizer as _optimizer_module

from .core.models import GPT, GPTConfig
from .core.track import active_trackers, phase, watch
from .core.virtual_gpu import VirtualGPU

__all__ = ["MODELS", "SEQ_LEN", "build_gpt", "random_tokens", "run_full_size", "steady_peak", "StepRecorder",
           "train_big_batch", "evaluate", "train_accumulated", "train_1b3", "run_as_cuda"]

# ----------------------------------------------------------------------------- the clinic kit
_TINY = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=32)
MODELS = {   # name -> {"full": real shapes, "tiny": a stand-in that runs on a CPU in milliseconds}
    "gpt2-small": {"full": GPTConfig.gpt2_small(), "tiny": GPTConfig.tiny(**_TINY)},
    "gpt2-medium": {"full": GPTConfig.gpt2_medium(), "tiny": GPTConfig.tiny(**_TINY)},
    "gpt-1.3b": {"full": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=2048),
                 "tiny": GPTConfig.tiny(n_layer=2, n_head=4, n_embd=64, vocab_size=64, block_size=32)},
}
SEQ_LEN = {"full": 1024, "tiny": 16}     # tokens per sequence


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
    watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 16)   # (16, T) ids and targets
    with phase("forward"):
        loss = model(x, y)                                                  # mean over 16 x T tokens
    with phase("backward"):
        loss.backward()
    with phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def evaluate(size="full", data=None):
    """The mean loss of each of 3 evaluation batches of 16 sequences (GPT-2 medium).
    Runs out of memory on a T4-16GB."""
    model = build_gpt("gpt2-medium", size)
    watch(model)
    model.eval()
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 48)   # (48, T)
    losses = []
    for i in range(0, 48, 16):
        with phase("forward"):
            losses.append(model(x[i:i + 16], y[i:i + 16]))                  # one batch of 16
    return torch.stack(losses)                                              # (3,) mean loss per batch


def train_accumulated(size="full", data=None):
    """One AdamW step of GPT-2 small on 32 sequences, as 4 micro-batches of 8.
    Runs out of memory on a T4-16GB, although one micro-batch alone fits."""
    model = build_gpt("gpt2-small", size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-small", size, 32)    # (32, T)
    total = 0.0
    for i in range(0, 32, 8):
        with phase("forward"):
            total = total + model(x[i:i + 8], y[i:i + 8]) / 4               # mean over the 32 sequences
    with phase("backward"):
        total.backward()
    with phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def train_1b3(size="full", data=None):
    """One AdamW step of a 1.3B-parameter GPT (24 layers, width 2048) on 1 sequence of 1024 tokens.
    Forward and backward fit on an L4-24GB; the first optimizer step does not."""
    model = build_gpt("gpt-1.3b", size)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, foreach=True)     # foreach=True: the CUDA default
    watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt-1.3b", size, 1)       # (1, T)
    with phase("forward"):
        loss = model(x, y)
    with phase("backward"):
        loss.backward()
    with phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


# ----------------------------------------------------------------------------- the steady state of a script
class StepRecorder:
    """Global hooks on every optimizer step while active. Inside a memlab tracker (the virtual GPU) it notes
    the peak reached before each step and the bytes of optimizer state after it: from the second step on,
    that state is alive during forward and backward too."""

    def __init__(self):
        self.pre_step_peak: list[int] = []
        self.state_bytes: list[int] = []
        self._handles = []

    def _register(self) -> list:
        return [_optimizer_module.register_optimizer_step_pre_hook(self._step),
                _optimizer_module.register_optimizer_step_post_hook(self._after_step)]

    def __enter__(self):
        self._handles = self._register()
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return False

    def _step(self, opt, args, kwargs):
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


def run_full_size(script, gpu):
    """Run a clinic script at full size on a virtual GPU, catching the OOM.

    Returns (VirtualRun, steady-state peak in bytes, the StepRecorder). The steady state is the larger of this first
    step's peak and the peak reached before the optimizer step plus the optimizer state that step created:
    from the second step on, that state is alive before the step too. It does not rely on phase marks."""
    rec = StepRecorder()
    with rec:
        run = gpu.run(script, "full", catch_oom=True)
    return run, steady_peak(run.fits, run.peak, rec.pre_step_peak, rec.state_bytes), rec


def steady_peak(fits: bool, peak: int, pre_step_peak: list, state_bytes: list) -> int:
    if fits and pre_step_peak and state_bytes:
        return max(peak, pre_step_peak[0] + state_bytes[0])
    return peak


# ----------------------------------------------------------------------------- an OOM in CUDA's words
_PHASE_IN_OOM = re.compile(r"^CUDA out of memory during phase '([^']*)'\. ")


def run_as_cuda(gpu, step, *args, **kwargs):
    """`gpu.run(step, *args, **kwargs)` on a memlab.VirtualGPU, with its out-of-memory error re-raised in the words
    of PyTorch's CUDA caching allocator: "CUDA out of memory. Tried to allocate ..." (c10/cuda/
    CUDACachingAllocator.cpp). The virtual GPU names the phase inside that first sentence ("CUDA out of memory
    during phase 'forward'."), and tools that recognise an OOM by its text miss it: accelerate's
    `should_reduce_batch_size` looks for " out of memory." (accelerate/utils/memory.py). Here the phase moves to
    the end of the first line; the type stays torch.OutOfMemoryError, a RuntimeError with one argument, which is
    what that check also requires. Returns the VirtualRun when the step fits."""
    if not isinstance(gpu, VirtualGPU):
        raise TypeError(f"gpu must be a memlab.VirtualGPU, got {type(gpu).__name__}")
    try:
        return gpu.run(step, *args, **kwargs)
    except torch.OutOfMemoryError as e:
        first, newline, rest = str(e).partition("\n")
    # raised outside the except block: the new error does not keep the old one (nor its traceback) alive
    found = _PHASE_IN_OOM.match(first)
    if found:
        first = f"CUDA out of memory. {first[found.end():]} (memlab: during phase '{found.group(1)}')"
    raise torch.OutOfMemoryError(first + newline + rest)
