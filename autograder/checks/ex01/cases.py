"""Exercise 01's cases (trusted side): what each task's inputs are drawn from, and the result keys the judge
and the references share. The models, optimizers and batches both sides rebuild from a case are in inputs.py."""

from __future__ import annotations

PHASES = ("forward", "backward", "step")
CATEGORY_KEYS = ("parameters", "gradients", "optimizer", "activations")


# ----------------------------------------------------------------------------- task1_1
def _live_cases(hidden, r):
    if not hidden:
        return [{"n1": 1000, "dtype": "float32", "sort_n": 300, "stream": [], "n_detach": 250, "strided": [10, 100]}]
    stream, live = [], []
    first = ["float32", "float16", "int8"]
    r.shuffle(first)                                # every itemsize in every run
    for i in range(40):
        if live and i >= 3 and r.random() < 0.4:
            stream.append(["free", live.pop(r.randrange(len(live)))])
        else:
            stream.append(["alloc", r.randrange(1, 4000), first[i] if i < 3 else r.choice(first)])
            live.append(i)
    return [{"n1": r.randrange(100, 5000), "dtype": r.choice(["float16", "float64", "int64"]),
             "sort_n": r.randrange(1, 700), "stream": stream, "n_detach": r.randrange(100, 3000),
             "strided": [r.randrange(3, 40), r.randrange(20, 200)]}]       # a storage far larger than the tensor


# ----------------------------------------------------------------------------- task1_2
def _phase_cases(hidden, r):
    if not hidden:
        return [{"kind": "mlp", "dims": [64, 128, 2, 10], "B": 32, "opt": "adam", "seed": 12}]
    mlp = lambda opt: {"kind": "mlp", "dims": [r.randint(16, 200), r.randint(32, 300), r.randint(1, 4),  # noqa: E731
                                               r.randint(2, 20)], "B": r.randint(8, 300), "opt": opt,
                       "seed": r.randrange(2**31)}
    gpt = {"kind": "gpt", "dims": [r.randint(1, 2), 32 * r.randint(1, 3), r.choice([64, 128]), r.randint(2, 6),
                                   r.choice([16, 32])], "opt": r.choice(["adam", "momentum"]),
           "seed": r.randrange(2**31)}
    return [mlp("adam"), mlp("momentum"), gpt]     # Adam's lazy state, SGD's momentum, a transformer


# ----------------------------------------------------------------------------- task1_3
def _saved_cases(hidden, r):
    if not hidden:
        return [{"act": a, "dims": [32, 64, 2, 10], "B": 16, "seed": 13} for a in ("relu", "gelu")]
    depths = [1, r.randint(2, 4), r.randint(2, 4)]   # a single hidden layer in every run
    r.shuffle(depths)
    return [{"act": a, "dims": [r.randint(8, 200), r.randint(8, 300), d, r.randint(2, 30)], "B": r.randint(1, 200),
             "seed": r.randrange(2**31)} for a, d in zip(("relu", "gelu", "tanh"), depths)]


# ----------------------------------------------------------------------------- task1_4
def _breakdown_cases(hidden, r):
    if not hidden:
        return [{"opt": "adam", "act": "relu", "dims": [64, 128, 2, 10], "B": 32, "seed": 14}]
    acts = ["relu", "tanh", "gelu"]
    r.shuffle(acts)                                  # each optimizer and each activation in every run
    return [{"opt": o, "act": a, "dims": [r.randint(8, 200), r.randint(16, 300), r.randint(1, 4), r.randint(2, 20)],
             "B": r.randint(4, 256), "seed": r.randrange(2**31)} for o, a in zip(("adam", "momentum", "sgd"), acts)]


# ----------------------------------------------------------------------------- task1_5
def _estimate_cases(hidden, r):
    if not hidden:
        return [[2048, 128, 256, 3, 10, "sgd", False], [16, 256, 512, 3, 10, "adam", False]]
    # Adam's state in both phases of both steps, in every run: each of the first step and the steady state is
    # paired once with a small, state-heavy batch (the optimizer step is the peak) and once with a large,
    # activation-heavy one (forward + backward is the peak, and Adam's state is 20-45% of it), so a wrong state
    # term in either phase of either step moves the estimate by 15% or more.
    def state_heavy(first):
        return [r.randint(4, 32), r.randint(128, 512), r.randint(256, 512), r.randint(2, 4), r.randint(2, 20), "adam",
                first]

    # the first Adam step: activations dominate and Adam's state (which does not exist yet) would add over 20%
    depth, width = r.randint(3, 4), r.randint(128, 256)
    batch = round(r.uniform(4, 5.5) * width * (depth - 1) / (depth + 2))
    # a steady Adam step whose forward + backward is the peak by 15% or more, with Adam's state 20% or more of it
    d2, w2 = r.randint(3, 4), r.randint(128, 256)
    # late in the backward pass every gradient but the first Linear's exists beside the first ReLU's output and two
    # (batch, width) gradients: a narrow batch on a wide, deep MLP makes that the peak (without it, 10-20% low)
    wl = r.randint(320, 448)
    late = [round(r.uniform(0.35, 0.6) * wl), r.randint(48, 128), wl, r.randint(3, 4), r.randint(2, 20), "sgd", True]
    # then activation-heavy SGD, SGD's first step, then Adam: steady and first step, state- and activation-heavy
    return [late] + [
        [r.randint(1024, 3072), r.randint(64, 256), r.randint(128, 384), r.randint(2, 4), r.randint(2, 20), "sgd",
         False],
        [r.randint(256, 1024), r.randint(64, 256), r.randint(128, 384), r.randint(2, 4), r.randint(2, 20), "sgd",
         True],
        state_heavy(False),
        [round(r.uniform(1.8, 3.2) * w2), r.randint(32, 96), w2, d2, r.randint(2, 20), "adam", False],
        state_heavy(True),
        [batch, r.randint(32, 96), width, depth, r.randint(2, 20), "adam", True],
    ]
