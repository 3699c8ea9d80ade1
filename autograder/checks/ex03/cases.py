"""Exercise 03's cases (trusted side, plain data); the inputs both sides rebuild from them are in inputs.py. The
plans of task3_1 are built with memlab.kit.ex03.make_plan, the format the notebook's driver (drive_scaler) reads.

Hidden cases cover every branch of each task's spec in every run:
- task3_1: two or three parameter groups in every hidden plan (a NaN injected into a later group, a -inf into
  group 0), one plan with a low scale (no natural overflow) laid out so that the scale grows after
  growth_interval clean steps, backs off after an injected NaN that follows growth_interval - 1 clean
  steps (a count that is not reset grows too early), grows again and twice more in a long clean tail;
  one plan with a scale so high that the first steps overflow by themselves (skipped first step);
  inf, -inf and NaN each injected, into several parameters; explicit unscale_ on a clean and on a
  skipped step; unscale_ twice, and after step(), must raise.
- task3_2: fp16 and bf16; one micro-batch and 2-4; clipping on and off; a first step that overflows; in every
  case the dtype and device type the forward really ran in, on the CPU and with the model and the micro-batches on
  a CUDA device (as if: run.amp_on_cuda); a large-batch case whose step peak is measured, and a larger one whose
  peak is also seen from outside the learner's process (the watched case).
- task3_3: no autocast, fp16 and bf16 autocast; a bf16 model; Adam and SGD with momentum; MLP and GPT.
"""

from __future__ import annotations

from memlab.kit.ex03 import VISIBLE_PLAN, make_plan

CATEGORY_KEYS = ("parameters", "gradients", "optimizer", "activations")
N_PARAMS = 6                      # MLP(depth=2): three Linear layers, weight and bias each


# ----------------------------------------------------------------------------- task3_1
def _grow_and_back_off(r):
    """Low scale, a layout that exercises growth, backoff and the reset of the clean-step count."""
    g = r.randint(2, 5)
    inj1 = g - 1                          # g - 1 clean steps, then a NaN: the count must restart at 0
    inj2 = inj1 + g + 2                   # g + 1 clean steps: growth after exactly g of them
    steps = inj2 + 1 + 2 * g + 1          # a clean tail long enough to grow twice
    groups = r.choice([2, 3])
    first = N_PARAMS // groups            # parameters 0 .. first - 1 form group 0 (memlab.kit.ex03.param_groups)
    inject = [(inj1, "nan", r.randrange(first, N_PARAMS - 1), r.randrange(10**6)),   # a later group, not the last
              (inj2, "-inf", r.randrange(first), r.randrange(10**6))]               # group 0, not the last group
    explicit = {inj1 + 1, inj2, steps - 1}
    return make_plan(r.randrange(2**31), dims=(r.randint(16, 48), r.randint(17, 80), 2, r.randint(3, 13)),
                      batch=r.randint(5, 24), steps=steps, init_scale=2.0 ** r.randint(6, 10), growth_factor=4.0,
                      backoff_factor=0.5, growth_interval=g, inject=inject, explicit=explicit, groups=groups)


def _overflow_first(r):
    """A scale so high that the first steps overflow in fp16 by themselves: skipped first step."""
    steps = r.randint(12, 16)
    inj = r.randint(6, steps - 2)
    return make_plan(r.randrange(2**31), dims=(r.randint(16, 48), r.randint(17, 80), 2, r.randint(3, 13)),
                      batch=r.randint(5, 24), steps=steps, x_scale=r.choice([0.5, 1.0, 2.0]),
                      init_scale=2.0 ** r.randint(22, 24), growth_factor=2.0, backoff_factor=0.25,
                      growth_interval=r.randint(2, 3), inject=[(inj, "inf", r.randrange(N_PARAMS), r.randrange(10**6))],
                      explicit={0, inj, r.randrange(1, steps)}, groups=r.choice([2, 3]))


def scaler_cases(hidden, r):
    guard = {"kind": "guard", "init_scale": 2.0 ** 10, "growth_factor": 2.0, "backoff_factor": 0.5,
             "growth_interval": 5}
    if not hidden:
        return [VISIBLE_PLAN, guard]
    return [_grow_and_back_off(r), _overflow_first(r), guard]


# ----------------------------------------------------------------------------- task3_2
def _amp(seed, *, kind="mlp", dtype="float16", micro=2, batch=8, steps=4, max_norm=None, init_scale=2.0 ** 16,
         memory=False):
    return {"seed": seed, "kind": kind, "dtype": dtype, "micro": micro, "batch": batch, "steps": steps,
            "max_norm": max_norm, "init_scale": init_scale, "memory": memory}


# The watched case: a step large enough to be seen from outside the learner's process. The harness runs each case
# inside a memory window (the sandbox cgroup's high-water mark, reset as the case starts and read as it ends), and
# `corroborate` (judge.py) sets it beside the peak growth memlab's tracker measured in the learner's process. A
# wide one-hidden-layer MLP on narrow inputs keeps the work small and the bf16 graph large: one micro-batch's step
# grows the tracker's count by about 160 MiB (the ReLU's bf16 output and the backward's gradients of it), a step in
# fp32 by twice that (tests/test_checks_ex03.py), and the inputs are about 5 MiB; two micro-batches, half a second
# of one CPU core to run and as much to judge.
WATCHED_DIMS, WATCHED_BATCH, WATCHED_MICRO = [4, 256, 1, 6], 110_000, 2
NOISE_BYTES = 64 * 2**20             # what a window may hold beyond the tracker's count (allocator, code pages)


def watched_case(r):
    return dict(_amp(r.randrange(2**31), dtype="bfloat16", micro=WATCHED_MICRO, batch=WATCHED_BATCH, steps=1,
                     init_scale=2.0 ** 8, memory=True), dims=list(WATCHED_DIMS), watched=True)


def input_bytes(case) -> int:
    """Bytes of the micro-batches `run` builds for a case (fp32 x, int64 y), before the step allocates anything."""
    d_in = (case.get("dims") or [24])[0]
    return case["steps"] * case["micro"] * case["batch"] * (4 * d_in + 8)


def amp_cases(hidden, r):
    if not hidden:
        return [_amp(1, micro=2), _amp(2, micro=2, max_norm=0.05), _amp(4, micro=2, dtype="bfloat16"),
                _amp(3, micro=4, batch=320, steps=2, memory=True)]
    s = lambda: r.randrange(2**31)  # noqa: E731
    return [
        _amp(s(), micro=r.randint(2, 4), batch=r.randint(3, 13), init_scale=2.0 ** r.randint(8, 14)),
        _amp(s(), micro=1, batch=r.randint(3, 13), max_norm=r.choice([0.02, 0.05, 0.1]), steps=6,
             init_scale=2.0 ** 21),                                            # the first steps overflow
        _amp(s(), micro=3, batch=r.randint(3, 13), max_norm=r.choice([0.02, 0.05]), steps=5,
             init_scale=2.0 ** r.randint(10, 14)),
        _amp(s(), kind="gpt", dtype="bfloat16", micro=r.randint(2, 3), batch=r.randint(1, 3), max_norm=0.5,
             steps=3),                                                         # bf16: fp16 is slow on CPUs
        _amp(s(), dtype="bfloat16", micro=r.randint(2, 3), batch=r.randint(3, 13)),
        # the step's memory: 3-4 micro-batches whose graphs dominate the model states (one graph alive at a time)
        _amp(s(), dtype=r.choice(["float16", "bfloat16"]), micro=r.randint(3, 4), batch=r.randint(256, 512), steps=2,
             max_norm=r.choice([None, 0.1]), init_scale=2.0 ** r.randint(8, 12), memory=True),
        watched_case(r),                                     # the same, large enough to be seen from outside
    ]


# ----------------------------------------------------------------------------- task3_3
def _report(seed, *, kind="mlp", dims=(64, 128, 2, 10), batch=32, dtype="float16", model_dtype="float32",
            optimizer="adam"):
    return {"seed": seed, "kind": kind, "dims": list(dims), "batch": batch, "dtype": dtype,
            "model_dtype": model_dtype, "optimizer": optimizer}


def report_cases(hidden, r):
    if not hidden:
        return [_report(0, dtype=None), _report(0, dtype="float16")]
    s = lambda: r.randrange(2**31)  # noqa: E731
    dims = lambda: (r.randint(8, 96), r.randint(9, 128), r.randint(1, 3), r.randint(2, 16))  # noqa: E731
    return [
        _report(s(), dims=dims(), batch=r.randint(3, 64), dtype="float16", optimizer="adam"),
        _report(s(), dims=dims(), batch=r.randint(3, 64), dtype="bfloat16", optimizer="sgd"),
        _report(s(), dims=dims(), batch=r.randint(3, 64), dtype=None, optimizer="sgd"),
        _report(s(), dims=dims(), batch=r.randint(3, 64), dtype=None, model_dtype="bfloat16", optimizer="adam"),
        _report(s(), kind="gpt", batch=r.randint(1, 4), dtype=None, optimizer="adam"),
        _report(s(), kind="gpt", batch=r.randint(1, 4), dtype=r.choice(["float16", "bfloat16"]), optimizer="sgd"),
    ]
