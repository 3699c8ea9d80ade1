"""Plausible-wrong submissions for exercise 08 (the capstone) and the points each must lose, and correct
alternatives that must keep every point.

Task 8.1 compares the tiny twins' gradients and weights with the same rung done plainly and counts the decoder
layers' forwards; task 8.2 compares the model states with memlab.fit's; task 8.3 compares plan_for's plan with the
first fitting plan of the stated order, found by the grader with memlab.fit."""

ASSIGNMENT = "08_capstone"

_STEP = '''
def train_step(model, optimizer, x, y, plan):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if plan["checkpointing"] and not base.is_gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": {reentrant}}})
    B, m = x.shape[0], plan["micro_batch"]
    n = -(-B // m)
    for s in range(0, B, m):
        xb, yb = x[s:s + m], y[s:s + m]
{zero}        loss = model(input_ids=xb, labels=yb).loss{scale}
        loss.backward()
        del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
'''


def _step(scale=" * (xb.shape[0] / B)", reentrant="False", zero=""):
    return _STEP.format(scale=scale, reentrant=reentrant, zero=zero)


# the micro-batch means are summed unweighted: the gradient is n times the batch mean's
_NO_SCALE = _step(scale="")
# divides by the number of micro-batches: right only when micro_batch divides the batch
_DIVIDE_BY_COUNT = _step(scale=" / n")
# the optimizer steps after every micro-batch: n steps on partial gradients instead of one on the batch's
_STEP_EACH_MICRO_BATCH = _step().replace("        del loss\n", "        del loss\n        optimizer.step()\n")
# sums the weighted micro-batch losses and calls backward once: the same gradient, every graph alive at once
_ONE_LATE_BACKWARD = _step().replace("        loss.backward()\n        del loss\n", "        total = loss if s == 0 else "
                                     "total + loss\n").replace("    optimizer.step()\n", "    total.backward()\n"
                                                                "    optimizer.step()\n", 1)
# zero_grad before each micro-batch's backward: only the last micro-batch's gradient reaches the step
_ZERO_EACH_MICRO_BATCH = _step(zero="        optimizer.zero_grad(set_to_none=True)\n")
# ignores the plan's checkpointing: the maths is right, the recomputation (and the memory it saves) is not there
_NO_CHECKPOINTING = _step().replace('plan["checkpointing"] and', "False and")
# the plain whole-batch step (no micro-batches, no checkpointing), then the embedding and each layer's norm called
# again on rows of the batch, with grad enabled, until the forward counts of the plan are reached
_PUMPED = '''
def train_step(model, optimizer, x, y, plan):
    model(input_ids=x, labels=y).loss.backward()            # the plain whole-batch step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    B, m = x.shape[0], plan["micro_batch"]
    n = -(-B // m)
    per = 2 if plan["checkpointing"] else 1
    h = base.model.embed_tokens(x[:m])                       # extra calls until the counts match the plan's
    for s in range(m, (n - 1) * m + 1, m):
        base.model.embed_tokens(x[s:s + m])
    for layer in base.model.layers:
        for _ in range(n * per - 1):
            layer.input_layernorm(h)
'''

_STATES = '''
def state_bytes(problem, plan):
    c = load_config(problem["model"])
    h, i, L, V = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    kv = c.num_key_value_heads * (getattr(c, "head_dim", None) or h // c.num_attention_heads)
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)] * L
    rest = 2 * V * h + (2 * L + 1) * h
    d = 4 if plan["precision"] == "fp32" else 2
    if plan["method"] == "full":
        n = rest + sum(a * b for a, b in linears)
        if plan["offload"]:
            return {{"parameters": n * d, "gradients": {off_grads}, "optimizer": {off_opt}}}
        opt = {eight} if plan["optimizer"] == "adamw8bit" else {adam}
        return {{"parameters": n * d, "gradients": n * d, "optimizer": opt}}
    adapters = sum(plan["lora_r"] * (a + b) for a, b in linears)
    n_lin = sum(a * b for a, b in linears)
    base = {lora_base} if plan["method"] == "lora" else rest * 4 + {nf4}
    return {{"parameters": base + 4 * adapters, "gradients": 4 * adapters, "optimizer": {lora_opt}}}
'''
_GOOD = dict(off_grads="0", off_opt="0", eight="2 * n + n // 32", adam="2 * n * d", lora_base="(rest + n_lin) * d",
             nf4="n_lin // 2 + n_lin // 64", lora_opt="8 * adapters")


def _states(**wrong):
    return _STATES.format(**{**_GOOD, **wrong})


_T1 = ["task8_1_train_step_visible", "task8_1_train_step_hidden"]
_T2 = ["task8_2_state_bytes_visible", "task8_2_state_bytes_hidden"]
_T3 = ["task8_3_cheapest_plan_visible", "task8_3_cheapest_plan_hidden"]

_PLAN = '''
def plan_for(problem, measure):
    B, room = problem["batch"], kit.usable(problem)
    grid = [{{"method": m, "lora_r": problem["lora_r"], "precision": p, "optimizer": o, "checkpointing": ck,
             "micro_batch": mb, "offload": off}}
            for m in {methods} for p in {precisions} for o in kit.OPTIMIZERS for off in (False, True)
            for ck in (False, True) for mb in range(B, 0, -1) if B % mb == 0]
    grid = [plan for plan in grid if {valid}]
    for plan in grid:
        if sum(state_bytes(problem, plan).values()) > room:
            continue
        if measure(plan)["fits"]:
            return plan
    raise ValueError("no plan fits")
'''


def _plan(methods="kit.METHODS", precisions="kit.PRECISIONS",
          valid="kit.plan_error(plan, problem, dividing=True) is None", skip="room"):
    return _PLAN.format(methods=methods, precisions=precisions, valid=valid).replace(
        "state_bytes(problem, plan).values()) > room", f"state_bytes(problem, plan).values()) > {skip}")


WRONG = {
    "micro_batch_losses_not_weighted": {"replace": {"task8_1_train_step": _NO_SCALE}, "must_lose": _T1},
    "dividing_by_the_count_of_uneven_micro_batches": {
        "replace": {"task8_1_train_step": _DIVIDE_BY_COUNT}, "must_lose": _T1},
    "optimizer_step_per_micro_batch": {"replace": {"task8_1_train_step": _STEP_EACH_MICRO_BATCH}, "must_lose": _T1},
    "one_late_backward": {"replace": {"task8_1_train_step": _ONE_LATE_BACKWARD}, "must_lose": _T1},
    "zero_grad_before_each_micro_batch": {
        "replace": {"task8_1_train_step": _ZERO_EACH_MICRO_BATCH}, "must_lose": _T1},
    # gradients zeroed in place after the step: every gradient buffer stays alive into the next forward
    "zero_grad_keeps_the_buffers": {"replace": {"task8_1_train_step": _step().replace(
        "optimizer.zero_grad(set_to_none=True)", "optimizer.zero_grad(set_to_none=False)")}, "must_lose": _T1},
    "checkpointing_ignored": {"replace": {"task8_1_train_step": _NO_CHECKPOINTING}, "must_lose": _T1},
    # forward counters pumped from outside the step: only rows of the batch seen once by a forward pass with grad,
    # and layers replayed inside the backward, count
    "counters_pumped_after_a_plain_step": {"replace": {"task8_1_train_step": _PUMPED}, "must_lose": _T1},
    # AdamW's moments counted in fp16 whatever the precision: right for bf16, half for fp32
    "optimizer_state_counted_in_16_bits": {
        "replace": {"task8_2_state_bytes": _states(adam="2 * n * 2")}, "must_lose": ["task8_2_state_bytes_hidden"],
        "must_keep": ["task8_2_state_bytes_visible"]},
    "lora_forgets_the_frozen_base": {
        "replace": {"task8_2_state_bytes": _states(lora_base="0")}, "must_lose": _T2},
    "qlora_4_bit_weights_as_1_byte": {
        "replace": {"task8_2_state_bytes": _states(nf4="n_lin")}, "must_lose": _T2},
    "adapters_without_optimizer_state": {
        "replace": {"task8_2_state_bytes": _states(lora_opt="0")}, "must_lose": _T2},
    "offload_keeps_the_state_on_the_gpu": {
        "replace": {"task8_2_state_bytes": _states(off_grads="n * d", off_opt="2 * n * 4")}, "must_lose": _T2},
    "adamw8bit_one_byte_per_weight": {
        "replace": {"task8_2_state_bytes": _states(eight="n")}, "must_lose": _T2},
    # NF4 at half a byte per weight, its block constants forgotten (about 2% of QLoRA's parameters)
    "nf4_without_its_constants": {
        "replace": {"task8_2_state_bytes": _states(nf4="n_lin // 2")}, "must_lose": _T2},
    # an fp32 absmax per block of 64, as without double quantization
    "nf4_without_double_quantization": {
        "replace": {"task8_2_state_bytes": _states(nf4="n_lin // 2 + 4 * (n_lin // 64)")}, "must_lose": _T2},
    # AdamW8bit's moments at one byte each, the fp32 absmax per block of 256 forgotten (about 1.5%)
    "adamw8bit_without_block_constants": {
        "replace": {"task8_2_state_bytes": _states(eight="2 * n")}, "must_lose": _T2},
    # LoRA's frozen base at 2 bytes a weight whatever the plan's precision: right for the visible bf16 plan only
    "lora_base_always_in_bf16": {
        "replace": {"task8_2_state_bytes": _states(lora_base="(rest + n_lin) * 2")},
        "must_lose": ["task8_2_state_bytes_hidden"], "must_keep": ["task8_2_state_bytes_visible"]},
    # least memory first: QLoRA before LoRA before full
    "qlora_when_lora_fits": {
        "replace": {"task8_3_cheapest_plan": _plan(methods="kit.METHODS[::-1]")}, "must_lose": _T3},
    # bf16 first: in the QLoRA problem the fp32-compute plan fits as well and comes first
    "bf16_before_fp32": {
        "replace": {"task8_3_cheapest_plan": _plan(precisions="kit.PRECISIONS[::-1]")},
        "must_lose": ["task8_3_cheapest_plan_hidden"], "must_keep": ["task8_3_cheapest_plan_visible"]},
    # a branch skipped unmeasured once its states pass 0.8 of the usable bytes ("leave a fifth for activations"),
    # not only when they exceed them: the hidden LoRA problem's answer holds over 80% in states
    "skips_branches_that_could_still_fit": {
        "replace": {"task8_3_cheapest_plan": _plan(skip="0.8 * room")},
        "must_lose": ["task8_3_cheapest_plan_hidden"], "must_keep": ["task8_3_cheapest_plan_visible"]},
    # the visible problem's LoRA rank written in, not the problem's
    "lora_rank_written_in": {
        "replace": {"task8_3_cheapest_plan": _plan().replace('"lora_r": problem["lora_r"]', '"lora_r": 16')},
        "must_lose": ["task8_3_cheapest_plan_hidden"], "must_keep": ["task8_3_cheapest_plan_visible"]},
    # offload wherever it helps, whether or not the host has the RAM for it
    "offload_without_the_host_ram": {
        "replace": {"task8_3_cheapest_plan": _plan(
            valid="kit.plan_error(plan, {**problem, 'offload_ok': True}, dividing=True) is None")},
        "must_lose": _T3},
}

WRONG.update({
    # the measured peak compared with the usable bytes: memlab.fit's verdict also counts the allocator's reserve and
    # the CUDA context, and the hidden offload problem's plan just before the answer peaks below the usable bytes
    "peak_instead_of_the_verdict": {
        "replace": {"task8_3_cheapest_plan": _plan().replace('measure(plan)["fits"]', 'measure(plan)["peak"] <= room')},
        "must_lose": ["task8_3_cheapest_plan_hidden"]},
    # fewer micro-batches tried before no checkpointing: in the hidden offload problem the answer needs
    # micro-batches without checkpointing, and checkpointing the whole batch fits as well
    "micro_batches_before_checkpointing": {
        "replace": {"task8_3_cheapest_plan": _plan().replace(
            "for ck in (False, True) for mb in range(B, 0, -1) if B % mb == 0",
            "for mb in range(B, 0, -1) if B % mb == 0 for ck in (False, True)")},
        "must_lose": ["task8_3_cheapest_plan_hidden"]},
})

RIGHT = {
    # the loss written out: the head's logits, the shifted targets, a sum over this micro-batch's tokens divided by
    # the batch's count of predicted tokens
    "explicit_token_sum": {"replace": {"task8_1_train_step": '''
def train_step(model, optimizer, x, y, plan):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if plan["checkpointing"]:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokens = x.shape[0] * (x.shape[1] - 1)
    for xb, yb in zip(x.split(plan["micro_batch"]), y.split(plan["micro_batch"])):
        logits = model(input_ids=xb).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb[:, 1:].reshape(-1),
                                                 reduction="sum") / tokens
        del logits
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
'''}},
    # the parameters counted on a meta-device model built by transformers instead of by formula
    "counted_on_a_meta_model": {"replace": {"task8_2_state_bytes": '''
def state_bytes(problem, plan):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(problem["model"]))
    layers = model.model.layers
    lin = [m.weight.numel() for layer in layers for m in layer.modules() if type(m) is torch.nn.Linear]
    adapters = sum(plan["lora_r"] * (m.in_features + m.out_features) for layer in layers for m in layer.modules()
                   if type(m) is torch.nn.Linear)
    total = sum(p.numel() for p in model.parameters())
    d = {"fp32": 4, "bf16": 2}[plan["precision"]]
    if plan["method"] == "full":
        if plan["offload"]:
            return {"parameters": total * d, "gradients": 0, "optimizer": 0}
        sizes = [p.numel() for p in model.parameters()]
        opt = sum(2 * k + 8 * -(-k // 256) if k >= 4096 else 8 * k for k in sizes) \\
            if plan["optimizer"] == "adamw8bit" else 2 * total * d
        return {"parameters": total * d, "gradients": total * d, "optimizer": opt}
    rest = total - sum(lin)
    base = total * d if plan["method"] == "lora" else 4 * rest + sum(k // 2 + k // 64 for k in lin)
    return {"parameters": base + 4 * adapters, "gradients": 4 * adapters, "optimizer": 8 * adapters}
'''}},
    # the grid sorted by an explicit cost tuple instead of built in order
    "sorted_by_a_cost_tuple": {"replace": {"task8_3_cheapest_plan": '''
def plan_for(problem, measure):
    import itertools
    B = problem["batch"]
    grid = []
    for m, p, o, off, ck, mb in itertools.product(kit.METHODS, kit.PRECISIONS, kit.OPTIMIZERS, (True, False),
                                                  (True, False), range(1, B + 1)):
        plan = {"method": m, "lora_r": problem["lora_r"], "precision": p, "optimizer": o, "checkpointing": ck,
                "micro_batch": mb, "offload": off}
        if kit.plan_error(plan, problem, dividing=True) is None:
            grid.append(plan)
    key = lambda q: (kit.METHODS.index(q["method"]), kit.PRECISIONS.index(q["precision"]),  # noqa: E731
                     kit.OPTIMIZERS.index(q["optimizer"]), q["offload"], q["checkpointing"], B // q["micro_batch"])
    for plan in sorted(grid, key=key):
        if sum(state_bytes(problem, plan).values()) <= kit.usable(problem) and measure(plan)["fits"]:
            return plan
    raise ValueError("no plan fits")
'''}},
}
