"""Plausible-wrong submissions for exercise 08 (Make it fit) and the points each must lose.

A plan is graded on three halves: it fits (steady state, headroom), it trains the same model as the recipe
(tiny instance against plain full-batch AdamW), and it costs no more than needed (the grader's brute force)."""

ASSIGNMENT = "08_capstone"

_STEP_HEAD = '''
def train_step(model, optimizer, x, y, plan):
    B, T = x.shape
    rope = (model.rope_cos[:T], model.rope_sin[:T]) if model.cfg.pos == "rope" else None
    n = -(-B // plan["micro_batch"])
    for s in range(0, B, plan["micro_batch"]):
        xb, yb = x[s:s + plan["micro_batch"]], y[s:s + plan["micro_batch"]]
        h = model.wte(xb)
        if model.wpe is not None:
            h = h + model.wpe(torch.arange(T))
        for i, block in enumerate(model.blocks):
            h = checkpoint(block, h, rope, use_reentrant=False) if i < plan["checkpoint"] else block(h, rope)
        logits = model.head(model.ln_f(h))
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), yb.reshape(-1))
'''
_STEP_TAIL = '''
        del h, logits, loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
'''

# accumulates the micro-batch means without scaling: the gradient is n times the batch mean's
_NO_DIVIDE = _STEP_HEAD + "        loss.backward()" + _STEP_TAIL

# divides by the number of micro-batches: right only when the micro-batch divides the batch
_DIVIDE_BY_COUNT = _STEP_HEAD + "        (loss / n).backward()" + _STEP_TAIL

# "saves memory" by freezing the token embedding, which the recipe trains
_FROZEN_EMBEDDING = '''
def train_step(model, optimizer, x, y, plan):
    model.wte.weight.requires_grad_(False)
''' + _STEP_HEAD.split("\n", 2)[2] + "        (loss * (xb.shape[0] / B)).backward()" + _STEP_TAIL

# sums the micro-batch losses and calls backward once: the same maths, every graph alive at once
_ONE_LATE_BACKWARD = '''
def train_step(model, optimizer, x, y, plan):
    B, T = x.shape
    rope = (model.rope_cos[:T], model.rope_sin[:T]) if model.cfg.pos == "rope" else None
    total = 0.0
    for s in range(0, B, plan["micro_batch"]):
        xb, yb = x[s:s + plan["micro_batch"]], y[s:s + plan["micro_batch"]]
        h = model.wte(xb)
        if model.wpe is not None:
            h = h + model.wpe(torch.arange(T))
        for i, block in enumerate(model.blocks):
            h = checkpoint(block, h, rope, use_reentrant=False) if i < plan["checkpoint"] else block(h, rope)
        logits = model.head(model.ln_f(h))
        total = total + F.cross_entropy(logits.reshape(-1, logits.size(-1)), yb.reshape(-1)) * (xb.shape[0] / B)
    total.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
'''

_SEARCH = '''
def plan_for(problem):
    B, L = problem["batch"], kit.MODELS[problem["model"]]["full"].n_layer
    for n in range(1, B + 1):
        for k in {ks}:
            for mb in {mbs}:
                if -(-B // mb) == n:
                    plan = {{"micro_batch": mb, "checkpoint": k, "optimizer": "{opt}"}}
                    if fits(problem, plan):
                        return plan
    raise ValueError("no plan fits")
'''


def _fits(test):
    return f'''
def fits(problem, plan):
    gpu = memlab.VirtualGPU(problem["gpu"])
    run, steady, _ = run_full_size(kit.make_step(problem, plan, train_step), gpu)
    return {test}
''' + _SEARCH.format(ks="range(L + 1)", mbs="range(B, 0, -1)", opt="fused")


# the first step's peak: AdamW's state, created inside that step, is missing from forward and backward
_FIRST_STEP_ONLY = _fits('run.fits and run.peak <= gpu.capacity * (1 - problem["headroom"])')

# steady state, but up to the last byte: no room for the CUDA context
_NO_HEADROOM = _fits("run.fits and steady <= gpu.capacity")

_GOOD_FITS = '''
def fits(problem, plan):
    gpu = memlab.VirtualGPU(problem["gpu"])
    run, steady, _ = run_full_size(kit.make_step(problem, plan, train_step), gpu)
    return run.fits and steady <= gpu.capacity * (1 - problem["headroom"])
'''

# checkpoints every block, whatever fits
_ALWAYS_ALL_BLOCKS = _GOOD_FITS + _SEARCH.format(ks="[L]", mbs="range(B, 0, -1)", opt="fused")

# one sequence per micro-batch, whatever fits
_ALWAYS_ONE_SEQUENCE = _GOOD_FITS + _SEARCH.format(ks="range(L + 1)", mbs="[1]", opt="fused")

# only micro-batches that divide the batch: misses an uneven split that fits with fewer micro-batches
_ONLY_DIVISORS = _GOOD_FITS + _SEARCH.format(ks="range(L + 1)", mbs="[d for d in range(B, 0, -1) if B % d == 0]",
                                             opt="fused")

# a headroom hard-coded to the visible problem's 5% instead of the problem's own
_FIXED_HEADROOM = _fits("run.fits and steady <= gpu.capacity * 0.95")

# a train_step that does nothing: nothing trains, and every plan "fits"
_DOES_NOTHING = '''
def train_step(model, optimizer, x, y, plan):
    pass
'''

_T1 = ["task8_1_train_step_visible", "task8_1_train_step_hidden"]
_T2 = ["task8_2_make_it_fit_visible", "task8_2_make_it_fit_hidden"]
_T3 = ["task8_3_cheapest_plan_visible", "task8_3_cheapest_plan_hidden"]

WRONG = {
    "micro_batches_without_dividing_the_loss": {
        "replace": {"task8_1_train_step": _NO_DIVIDE}, "must_lose": _T1},
    "dividing_by_the_count_of_uneven_micro_batches": {
        "replace": {"task8_1_train_step": _DIVIDE_BY_COUNT}, "must_lose": _T1},
    "frozen_embedding": {
        "replace": {"task8_1_train_step": _FROZEN_EMBEDDING}, "must_lose": _T1 + _T2},
    "one_late_backward": {
        "replace": {"task8_1_train_step": _ONE_LATE_BACKWARD}, "must_lose": _T1},
    "first_step_peak_only": {
        "replace": {"task8_2_make_it_fit": _FIRST_STEP_ONLY}, "must_lose": _T2 + ["task8_3_cheapest_plan_hidden"],
        "must_keep": _T1},
    "no_headroom": {
        "replace": {"task8_2_make_it_fit": _NO_HEADROOM}, "must_lose": ["task8_2_make_it_fit_hidden"],
        "must_keep": _T1},
    "checkpoint_every_block": {
        "replace": {"task8_2_make_it_fit": _ALWAYS_ALL_BLOCKS}, "must_lose": _T3, "must_keep": _T1 + _T2},
    "headroom_hard_coded_5_percent": {
        "replace": {"task8_2_make_it_fit": _FIXED_HEADROOM},
        "must_lose": ["task8_2_make_it_fit_hidden", "task8_3_cheapest_plan_hidden"],
        "must_keep": _T1 + ["task8_2_make_it_fit_visible", "task8_3_cheapest_plan_visible"],
        "alone": True},   # plan_for measures with train_step: not in a notebook with a wrong train_step
    "train_step_does_nothing": {
        "replace": {"task8_1_train_step": _DOES_NOTHING}, "must_lose": _T1 + _T2 + _T3},
    "one_sequence_per_micro_batch": {
        "replace": {"task8_2_make_it_fit": _ALWAYS_ONE_SEQUENCE}, "must_lose": ["task8_3_cheapest_plan_hidden"],
        "must_keep": _T1},
}

RIGHT = {
    # zeroes the gradients in place after the step, then frees them: the step saw the right gradients
    "zero_in_place_after_the_step": {"replace": {"task8_1_train_step": '''
def train_step(model, optimizer, x, y, plan):
    B = x.shape[0]
    for s in range(0, B, plan["micro_batch"]):
        xb, yb = x[s:s + plan["micro_batch"]], y[s:s + plan["micro_batch"]]
        h, rope = model.embed(xb)
        for i, block in enumerate(model.blocks):
            h = checkpoint(block, h, rope, use_reentrant=False) if i < plan["checkpoint"] else block(h, rope)
        loss = model.loss(model.ln_f(h), yb) * (xb.shape[0] / B)
        del h
        loss.backward()
        del loss
    optimizer.step()
    for p in model.parameters():
        p.grad.zero_()
    optimizer.zero_grad(set_to_none=True)
'''}},
    # less recomputation first, then fewer micro-batches: another plan that nothing beats on both counts
    "recompute_least_first": {"replace": {"task8_2_make_it_fit": _GOOD_FITS + '''
def plan_for(problem):
    B, L = problem["batch"], kit.MODELS[problem["model"]]["full"].n_layer
    for k in range(L + 1):
        for n in range(1, B + 1):
            for mb in [m for m in range(B, 0, -1) if -(-B // m) == n]:
                if fits(problem, {"micro_batch": mb, "checkpoint": k, "optimizer": "fused"}):
                    return {"micro_batch": mb, "checkpoint": k, "optimizer": "fused"}
    raise ValueError("no plan fits")
'''}},
    # checkpointing by wrapping blocks, then the model's own forward (and its mean loss)
    "wrapped_blocks": {"replace": {"task8_1_train_step": '''
class _Ckpt(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.inner = block
    def forward(self, h, rope=None):
        return checkpoint(self.inner, h, rope, use_reentrant=False)


def train_step(model, optimizer, x, y, plan):
    blocks = list(model.blocks)
    for i in range(plan["checkpoint"]):
        model.blocks[i] = _Ckpt(blocks[i])
    try:
        B = x.shape[0]
        for xb, yb in zip(x.split(plan["micro_batch"]), y.split(plan["micro_batch"])):
            loss = model(xb, yb) * xb.shape[0] / B
            loss.backward()
            del loss
    finally:
        for i in range(plan["checkpoint"]):
            model.blocks[i] = blocks[i]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
'''}},
}
