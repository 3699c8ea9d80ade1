"""Plausible-wrong submissions for exercise 04 (the OOM clinic) and the points each must lose.

Every wrong fix of a clinic script either still runs out of memory or fits by
training something else; the grader checks both halves (fits at full size,
same maths on a tiny instance)."""

from . import edit, solution_cells

ASSIGNMENT = "04_oom_clinic"

# fits: 4 optimizer steps on batches of 4 instead of one step on all 16 (a smaller batch, no accumulation)
_SMALLER_BATCH = '''
def train_big_batch_fixed(size="full", data=None):
    model = build_gpt("gpt2-medium", size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 16)
    for i in range(0, 16, 4):
        with memlab.phase("forward"):
            loss = model(x[i:i + 4], y[i:i + 4])
        with memlab.phase("backward"):
            loss.backward()
        del loss
        with memlab.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model
'''

# fits and takes one step, but the accumulated gradient is 4x the mean's
_NO_DIVIDE = '''
def train_big_batch_fixed(size="full", data=None):
    model = build_gpt("gpt2-medium", size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 16)
    for i in range(0, 16, 4):
        with memlab.phase("forward"):
            loss = model(x[i:i + 4], y[i:i + 4])
        with memlab.phase("backward"):
            loss.backward()
        del loss
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model
'''

# fits, because nothing is recorded for backward -- and so nothing is learned
_NO_GRAD = '''
def train_big_batch_fixed(size="full", data=None):
    model = build_gpt("gpt2-medium", size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 16)
    with torch.no_grad():                       # "saves the activations"
        with memlab.phase("forward"):
            loss = model(x, y)
    if loss.requires_grad:                      # it does not: there is nothing to backpropagate
        loss.backward()
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model
'''

# detach() drops each graph right away, but one batch of 16 with autograd on still does not fit
_DETACH_NOT_NO_GRAD = '''
def evaluate_fixed(size="full", data=None):
    model = build_gpt("gpt2-medium", size)
    memlab.watch(model)
    model.eval()
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 48)
    losses = []
    for i in range(0, 48, 16):
        with memlab.phase("forward"):
            losses.append(model(x[i:i + 16], y[i:i + 16]).detach())
    return torch.stack(losses)
'''

# backward per micro-batch (fits), but the 1/4 of the original got lost on the way
_ACCUMULATE_NO_DIVIDE = '''
def train_accumulated_fixed(size="full", data=None):
    model = build_gpt("gpt2-small", size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-small", size, 32)
    for i in range(0, 32, 8):
        with memlab.phase("forward"):
            loss = model(x[i:i + 8], y[i:i + 8])
        with memlab.phase("backward"):
            loss.backward()
        del loss
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model
'''

# fits (SGD keeps no state), but it is a different optimizer: a different training run
_SWITCH_TO_SGD = '''
def train_1b3_fixed(size="full", data=None):
    model = build_gpt("gpt-1.3b", size)
    opt = torch.optim.SGD(model.parameters(), lr=2e-4, foreach=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt-1.3b", size, 1)
    with memlab.phase("forward"):
        loss = model(x, y)
    with memlab.phase("backward"):
        loss.backward()
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model
'''

# empty_cache() frees no live tensor: the step still runs out
_EMPTY_CACHE_ONLY = '''
def train_1b3_fixed(size="full", data=None):
    model = build_gpt("gpt-1.3b", size)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, foreach=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt-1.3b", size, 1)
    with memlab.phase("forward"):
        loss = model(x, y)
    with memlab.phase("backward"):
        loss.backward()
    torch.cuda.empty_cache()                    # "free some memory before the step"
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model
'''

# bisection that returns hi (the first batch that failed) instead of lo
_BISECT_ONE_TOO_LARGE = '''
def find_max_batch_size(step_fn, gpu, limit=4096):
    def fits(batch):
        return gpu.fits(step_fn, batch)
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    if hi > limit:
        if lo == limit or fits(limit):
            return limit
        hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return hi
'''

# measures growth from before the first step: the optimizer's lazily created state looks like a leak
_LEAK_FROM_BEFORE_FIRST_STEP = '''
def detect_leak(step_fn, model, optimizer, n_steps=5):
    tracker = memlab.MemoryTracker(model, optimizer)
    with tracker:
        before = tracker.breakdown()
        for _ in range(n_steps):
            step_fn()
        after = tracker.breakdown()
    growth = {c: after[c] - before[c] for c in memlab.CATEGORIES}
    cat = max(growth, key=growth.get)
    return (cat, growth[cat] // n_steps) if growth[cat] > 0 else None
'''

_KEEP_OTHERS = ["task4_2_eval_no_grad_hidden", "task4_5_find_max_batch_size_hidden", "task4_6_leak_detector_hidden"]

WRONG = {
    "smaller_batch_without_accumulation": {
        "replace": {"task4_1_big_batch": _SMALLER_BATCH},
        "must_lose": ["task4_1_big_batch_visible", "task4_1_big_batch_hidden"],
        "must_keep": _KEEP_OTHERS},
    "accumulation_without_dividing_the_loss": {
        "replace": {"task4_1_big_batch": _NO_DIVIDE},
        "must_lose": ["task4_1_big_batch_visible", "task4_1_big_batch_hidden"],
        "must_keep": _KEEP_OTHERS},
    "training_under_no_grad": {
        "replace": {"task4_1_big_batch": _NO_GRAD},
        "must_lose": ["task4_1_big_batch_visible", "task4_1_big_batch_hidden"],
        "must_keep": _KEEP_OTHERS},
    "eval_detach_instead_of_no_grad": {
        "replace": {"task4_2_eval_no_grad": _DETACH_NOT_NO_GRAD},
        "must_lose": ["task4_2_eval_no_grad_visible", "task4_2_eval_no_grad_hidden"],
        "must_keep": ["task4_1_big_batch_hidden", "task4_5_find_max_batch_size_hidden"]},
    "per_micro_batch_backward_without_dividing": {
        "replace": {"task4_3_accumulated_loss": _ACCUMULATE_NO_DIVIDE},
        "must_lose": ["task4_3_accumulated_loss_visible", "task4_3_accumulated_loss_hidden"],
        "must_keep": ["task4_4_optimizer_step_hidden", "task4_6_leak_detector_hidden"]},
    "switch_to_sgd": {
        "replace": {"task4_4_optimizer_step": _SWITCH_TO_SGD},
        "must_lose": ["task4_4_optimizer_step_visible", "task4_4_optimizer_step_hidden"],
        "must_keep": ["task4_1_big_batch_hidden", "task4_3_accumulated_loss_hidden"]},
    "empty_cache_only": {
        "replace": {"task4_4_optimizer_step": _EMPTY_CACHE_ONLY},
        "must_lose": ["task4_4_optimizer_step_visible", "task4_4_optimizer_step_hidden"],
        "must_keep": ["task4_2_eval_no_grad_hidden", "task4_5_find_max_batch_size_hidden"]},
    "bisection_returns_one_too_large": {
        "replace": {"task4_5_find_max_batch_size": _BISECT_ONE_TOO_LARGE},
        "must_lose": ["task4_5_find_max_batch_size_visible", "task4_5_find_max_batch_size_hidden"],
        "must_keep": ["task4_4_optimizer_step_hidden", "task4_6_leak_detector_hidden"]},
    "leak_measured_from_before_the_first_step": {
        "replace": {"task4_6_leak_detector": _LEAK_FROM_BEFORE_FIRST_STEP},
        "must_lose": ["task4_6_leak_detector_visible", "task4_6_leak_detector_hidden"],
        "must_keep": ["task4_1_big_batch_hidden", "task4_5_find_max_batch_size_hidden"]},
}

# doubling stops past a limit that is not a power of two and returns the last power of two that fit
_DOUBLING_IGNORES_LIMIT = '''
def find_max_batch_size(step_fn, gpu, limit=4096):
    def fits(batch):
        return gpu.fits(step_fn, batch)
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    if hi > limit:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
'''

# looks for growth in the activations only: kept gradients or kept input batches go unnoticed
_LEAK_ACTIVATIONS_ONLY = '''
def detect_leak(step_fn, model, optimizer, n_steps=5):
    tracker = memlab.MemoryTracker(model, optimizer)
    after = []
    with tracker:
        for _ in range(n_steps):
            step_fn()
            after.append(tracker.breakdown()["activations"])
    if all(b > a for a, b in zip(after[1:], after[2:])):
        return ("activations", (after[-1] - after[0]) // (n_steps - 1))
    return None
'''

# correct, written differently: 8 micro-batches of 2 sequences
_EIGHT_MICRO_BATCHES = '''
def train_big_batch_fixed(size="full", data=None):
    model = build_gpt("gpt2-medium", size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 16)
    for i in range(0, 16, 2):
        with memlab.phase("forward"):
            loss = model(x[i:i + 2], y[i:i + 2]) / 8
        with memlab.phase("backward"):
            loss.backward()
        del loss
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model
'''

# correct, written differently: torch.inference_mode instead of no_grad
_INFERENCE_MODE = '''
def evaluate_fixed(size="full", data=None):
    model = build_gpt("gpt2-medium", size)
    memlab.watch(model)
    model.eval()
    x, y = data if data is not None else random_tokens("gpt2-medium", size, 48)
    with torch.inference_mode():
        losses = [model(x[i:i + 16], y[i:i + 16]) for i in range(0, 48, 16)]
    return torch.stack(losses)
'''

# correct, written differently: the fused AdamW kernel (one kernel, no foreach copy of the parameters)
_FUSED_ADAMW = '''
def train_1b3_fixed(size="full", data=None):
    model = build_gpt("gpt-1.3b", size)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, fused=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt-1.3b", size, 1)
    with memlab.phase("forward"):
        loss = model(x, y)
    with memlab.phase("backward"):
        loss.backward()
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model
'''

# peaks taken as affine in the batch: extrapolated from two probes, then a walk to the edge (right for a plain
# training step; a contrastive loss's (B, B) logits make the guess far off and the walk long)
_EXTRAPOLATES_AS_IF_AFFINE = """
def find_max_batch_size(step_fn, gpu, limit=4096):
    def fits(batch):
        return gpu.fits(step_fn, batch)
    if not fits(1):
        return 0
    lo, hi = min(16, limit), min(32, limit)
    p1, p2 = gpu.run(step_fn, lo, catch_oom=True).peak, gpu.run(step_fn, hi, catch_oom=True).peak
    per = max((p2 - p1) // max(hi - lo, 1), 1)
    b = max(1, min(limit, lo + (gpu.capacity - p1) // per))
    while b < limit and fits(b + 1):
        b += 1
    while b > 1 and not fits(b):
        b -= 1
    return b
"""

# of the leaking categories, the one with the most bytes at the end, not the one that grows fastest
_LEAK_LARGEST_TOTAL = edit(solution_cells(ASSIGNMENT)["task4_6_leak_detector"],
                           "return max(leaks, key=lambda leak: leak[1]) if leaks else None",
                           "return max(leaks, key=lambda leak: after[-1][leak[0]]) if leaks else None")

WRONG.update({
    "leak_reported_by_largest_total": {
        "replace": {"task4_6_leak_detector": _LEAK_LARGEST_TOTAL},
        "must_lose": ["task4_6_leak_detector_hidden"],
        "must_keep": ["task4_6_leak_detector_visible", "task4_5_find_max_batch_size_hidden"]},
    "extrapolates_as_if_memory_were_affine_in_the_batch": {
        "replace": {"task4_5_find_max_batch_size": _EXTRAPOLATES_AS_IF_AFFINE},
        "must_lose": ["task4_5_find_max_batch_size_hidden"],
        "must_keep": ["task4_5_find_max_batch_size_visible", "task4_6_leak_detector_hidden"]},
    "doubling_ignores_a_limit_that_is_not_a_power_of_two": {
        "replace": {"task4_5_find_max_batch_size": _DOUBLING_IGNORES_LIMIT},
        "must_lose": ["task4_5_find_max_batch_size_hidden"],
        "must_keep": ["task4_6_leak_detector_hidden"]},
    "leak_looked_for_in_activations_only": {
        "replace": {"task4_6_leak_detector": _LEAK_ACTIVATIONS_ONLY},
        "must_lose": ["task4_6_leak_detector_hidden"],
        "must_keep": ["task4_5_find_max_batch_size_hidden"]},
    # correct alternatives keep their points; each is paired with a mistake in another task, which loses
    "eight_micro_batches_inference_mode_fused_adamw": {
        "replace": {"task4_1_big_batch": _EIGHT_MICRO_BATCHES, "task4_2_eval_no_grad": _INFERENCE_MODE,
                    "task4_4_optimizer_step": _FUSED_ADAMW, "task4_6_leak_detector": _LEAK_FROM_BEFORE_FIRST_STEP},
        "must_lose": ["task4_6_leak_detector_visible", "task4_6_leak_detector_hidden"],
        "must_keep": ["task4_1_big_batch_visible", "task4_1_big_batch_hidden", "task4_2_eval_no_grad_visible",
                      "task4_2_eval_no_grad_hidden", "task4_4_optimizer_step_visible",
                      "task4_4_optimizer_step_hidden"]},
})

# the detector of the spec with one mistake each (task 4.6)
_LEAK_DETECTOR = '''
def detect_leak(step_fn, model, optimizer, n_steps=5):
    tracker = memlab.MemoryTracker(model, optimizer)
    after = []
    with tracker:
        for _ in range(n_steps):
            step_fn()
            after.append(tracker.breakdown())
    leaks = []
    for cat in memlab.CATEGORIES:
        if {GROWS}:
            leaks.append((cat, (after[-1][cat] - after[0][cat]) // (n_steps - 1)))
    return {PICK} if leaks else None
'''
_EVERY_STEP = "all(after[i][cat] > after[i - 1][cat] for i in range(1, n_steps))"
_LARGEST = "max(leaks, key=lambda leak: leak[1])"
# compares only the first and the last step: growth that starts late, or goes up and down, counts as a leak
_LEAK_FIRST_VS_LAST = _LEAK_DETECTOR.replace("{GROWS}", "after[-1][cat] > after[0][cat]").replace("{PICK}", _LARGEST)
# returns the first leaking category in memlab.CATEGORIES' order, not the one that grows the most
_LEAK_FIRST_FOUND = _LEAK_DETECTOR.replace("{GROWS}", _EVERY_STEP).replace("{PICK}", "leaks[0]")
# returns the last leaking category found
_LEAK_LAST_FOUND = _LEAK_DETECTOR.replace("{GROWS}", _EVERY_STEP).replace("{PICK}", "leaks[-1]")
# correct, written differently: consecutive differences, the largest total growth, a float per step
_LEAK_ALT = '''
def detect_leak(step_fn, model, optimizer, n_steps=5):
    levels = []
    with memlab.MemoryTracker(model, optimizer) as tracker:
        for _ in range(n_steps):
            step_fn()
            levels.append(dict(tracker.breakdown()))
    best = None
    for cat in memlab.CATEGORIES:
        deltas = [b[cat] - a[cat] for a, b in zip(levels[1:], levels[2:])] + [levels[1][cat] - levels[0][cat]]
        if min(deltas) > 0 and (best is None or sum(deltas) > best[1]):
            best = (cat, sum(deltas))
    return None if best is None else (best[0], best[1] / (n_steps - 1))
'''

WRONG.update({
    "leak_compares_first_and_last_step_only": {
        "replace": {"task4_6_leak_detector": _LEAK_FIRST_VS_LAST},
        "must_lose": ["task4_6_leak_detector_hidden"],
        "must_keep": ["task4_6_leak_detector_visible", "task4_5_find_max_batch_size_hidden"]},
    "leak_returns_the_first_leaking_category": {
        "replace": {"task4_6_leak_detector": _LEAK_FIRST_FOUND},
        "must_lose": ["task4_6_leak_detector_hidden"],
        "must_keep": ["task4_6_leak_detector_visible", "task4_5_find_max_batch_size_hidden"]},
    "leak_returns_the_last_leaking_category": {
        "replace": {"task4_6_leak_detector": _LEAK_LAST_FOUND},
        "must_lose": ["task4_6_leak_detector_hidden"],
        "must_keep": ["task4_6_leak_detector_visible"]},
})

RIGHT = {
    "leak_detector_written_differently": {"replace": {"task4_6_leak_detector": _LEAK_ALT}},
}

# 4.4: foreach=False fits one step, but the gradients zeroed in place stay alive through the next forward and
# backward: two real steps run out of memory on the L4
_ZEROED_IN_PLACE = '''
def train_1b3_fixed(size="full", data=None):
    model = build_gpt("gpt-1.3b", size)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, foreach=False)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt-1.3b", size, 1)
    with memlab.phase("forward"):
        loss = model(x, y)
    with memlab.phase("backward"):
        loss.backward()
    del loss
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=False)
    return model
'''
# 4.4, correct, written differently: the optimizer step in backward (lesson 04): one AdamW per parameter, stepped by
# a hook as soon as the parameter's gradient is complete, which then frees it
_STEP_IN_BACKWARD = '''
def train_1b3_fixed(size="full", data=None):
    model = build_gpt("gpt-1.3b", size)
    opts = {p: torch.optim.AdamW([p], lr=2e-4, foreach=False) for p in model.parameters()}
    def step_now(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    memlab.watch(model, list(opts.values()))
    x, y = data if data is not None else random_tokens("gpt-1.3b", size, 1)
    with memlab.phase("forward"):
        loss = model(x, y)
    with memlab.phase("backward"):
        loss.backward()
    return model
'''
# 4.3, correct, written differently: backward per micro-batch, each micro-batch's forward checkpointed (recomputed
# in backward: the same sequences, pushed once)
_ACCUMULATED_CHECKPOINTED = '''
def train_accumulated_fixed(size="full", data=None):
    model = build_gpt("gpt2-small", size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    memlab.watch(model, opt)
    x, y = data if data is not None else random_tokens("gpt2-small", size, 32)
    for i in range(0, 32, 8):
        with memlab.phase("forward"):
            loss = torch.utils.checkpoint.checkpoint(model, x[i:i + 8], y[i:i + 8], use_reentrant=False) / 4
        with memlab.phase("backward"):
            loss.backward()
        del loss
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model
'''

WRONG.update({
    "gradients_zeroed_in_place": {
        "replace": {"task4_4_optimizer_step": _ZEROED_IN_PLACE},
        "must_lose": ["task4_4_optimizer_step_visible", "task4_4_optimizer_step_hidden"],
        "must_keep": ["task4_6_leak_detector_hidden"]},
})
RIGHT.update({
    "optimizer_step_in_backward": {"replace": {"task4_4_optimizer_step": _STEP_IN_BACKWARD}},
    "accumulation_with_checkpointed_micro_batches": {"replace": {"task4_3_accumulated_loss": _ACCUMULATED_CHECKPOINTED}},
})
