"""Plausible-wrong submissions for exercise 03 and the points each must lose."""

ASSIGNMENT = "03_mixed_precision"

# A complete scaler with three switchable mistakes. {SKIP} / {GROW} / {UNSCALE} are filled in below.
_SCALER = '''
class DynamicLossScaler:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._clean_steps = 0
        self._unscaled = False
        self._found_inf = False

    def get_scale(self):
        return self._scale

    def scale(self, loss):
        return loss * self._scale

    def unscale_(self, optimizer):
        {GUARD}
        inv = 1.0 / self._scale
        found = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(inv)
                        {CHECK}
        self._found_inf = found
        self._unscaled = True

    def step(self, optimizer, *args, **kwargs):
        {UNSCALE}
        {SKIP}

    def update(self):
        if self._found_inf:
            {BACKOFF}
        else:
            self._clean_steps += 1
            {GROW}
        self._unscaled = self._found_inf = False
'''

_GUARD = '''if self._unscaled:
            raise RuntimeError("unscale_() has already been called since the last update()")'''
_UNSCALE_ONCE = "if not self._unscaled:\n            self.unscale_(optimizer)"
_STEP_IF_FINITE = "return None if self._found_inf else optimizer.step(*args, **kwargs)"
_CHECK = "found = found or not bool(torch.isfinite(p.grad).all())"
_BACKOFF = "self._scale *= self.backoff_factor\n            self._clean_steps = 0"
_GROWS = '''if self._clean_steps == self.growth_interval:
                self._scale *= self.growth_factor
                self._clean_steps = 0'''


def _scaler(guard=_GUARD, unscale=_UNSCALE_ONCE, skip=_STEP_IF_FINITE, grow=_GROWS, check=_CHECK,
            backoff=_BACKOFF):
    return (_SCALER.replace("{GUARD}", guard).replace("{UNSCALE}", unscale).replace("{SKIP}", skip)
            .replace("{GROW}", grow).replace("{CHECK}", check).replace("{BACKOFF}", backoff))


# steps even when the gradients hold inf/NaN (the scale still backs off)
_NO_SKIP = _scaler(skip="optimizer.step()")
# calls optimizer.step() without step's extra arguments: a closure passed to scaler.step never runs
_DROPS_STEP_ARGUMENTS = _scaler(skip="return None if self._found_inf else optimizer.step()")
# steps and skips right but returns nothing (GradScaler returns what optimizer.step returned)
_STEP_RETURNS_NOTHING = _scaler(skip="if not self._found_inf:\n            optimizer.step(*args, **kwargs)")
# divides the gradients into new tensors instead of in place: a reference to the old .grad still holds scaled values
_UNSCALE_OUT_OF_PLACE = _scaler().replace("p.grad.mul_(inv)", "p.grad = p.grad * inv")
# backs off but never grows the scale again
_NEVER_GROWS = _scaler(grow="pass")
# step() always unscales, even after an explicit unscale_() (and unscale_ has no guard)
_UNSCALES_TWICE = _scaler(guard="pass", unscale="self.unscale_(optimizer)")
# torch.isinf finds inf and -inf but not NaN: a NaN gradient goes into the weights
_ISINF_MISSES_NAN = _scaler(check="found = found or bool(torch.isinf(p.grad).any())")
# the flag is overwritten by each parameter: only the last parameter's gradient decides
_ONLY_LAST_PARAM = _scaler(check="found = not bool(torch.isfinite(p.grad).all())")
# backs off but keeps counting clean steps across the overflow: grows too early after it
_COUNT_NOT_RESET = _scaler(backoff="self._scale *= self.backoff_factor")
# grows by a hard-coded 2 instead of growth_factor
_GROWS_BY_TWO = _scaler(grow=_GROWS.replace("self.growth_factor", "2.0"))
# correct, written differently: one isfinite over all gradients at once, count compared with >=
_SCALER_ALT = _scaler(check="pass", grow=_GROWS.replace("==", ">=")).replace(
    "        self._found_inf = found\n",
    "        grads = [p.grad.flatten() for g in optimizer.param_groups for p in g['params'] if p.grad is not None]\n"
    "        self._found_inf = not bool(torch.isfinite(torch.cat(grads)).all())\n")

_AMP = '''
def amp_step(model, optimizer, scaler, micro_batches, *, dtype=torch.float16, max_norm=None):
    {CAST}
    k = len(micro_batches)
    total = 0.0
    for x, y in micro_batches:
        {FORWARD}
        scaler.scale(loss).backward()
        total += loss.item()
    if max_norm is not None:
        {CLIP}
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total
'''
_AUTOCAST_FORWARD = '''with torch.autocast(x.device.type, dtype=dtype):
            loss = model(x, y) / k'''
_UNSCALE_THEN_CLIP = '''scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)'''


def _amp(cast="pass", forward=_AUTOCAST_FORWARD, clip=_UNSCALE_THEN_CLIP):
    return _AMP.replace("{CAST}", cast).replace("{FORWARD}", forward).replace("{CLIP}", clip)


# clips the scaled gradients, so the threshold is really max_norm / scale
_CLIP_BEFORE_UNSCALE = _amp(clip="torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")
# "fewer bits" taken literally: the parameters themselves become 16-bit
_PARAMS_TO_16BIT = _amp(cast="model.to(dtype)",
                        forward='loss = model(x.to(dtype) if x.is_floating_point() else x, y) / k')
# steps the optimizer itself when clipping: a step with inf/NaN gradients is no longer skipped
_CLIP_THEN_OPTIMIZER_STEP = _AMP.replace('''    scaler.step(optimizer)
    scaler.update()''', '''    else:
        scaler.step(optimizer)
    scaler.update()''').replace("{CAST}", "pass").replace("{FORWARD}", _AUTOCAST_FORWARD).replace(
    "{CLIP}", _UNSCALE_THEN_CLIP + "\n        optimizer.step()")
# correct, written differently: always unscale_ before the step (clip only with max_norm)
_ALWAYS_UNSCALE = _AMP.replace('''    if max_norm is not None:
        {CLIP}''', '''    scaler.unscale_(optimizer)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)''').replace("{CAST}", "pass").replace(
    "{FORWARD}", _AUTOCAST_FORWARD)
# sums the micro-batch losses instead of averaging them
_NO_MEAN = _amp(forward='''with torch.autocast(x.device.type, dtype=dtype):
            loss = model(x, y)''')

_REPORT = '''
def dtype_report(model, optimizer, x, y, *, dtype=None):
    report = {"parameters": {}, "gradients": {}, "optimizer": {}, "activations": {}}
    def add(category, t, n):
        report[category][t.dtype] = report[category].get(t.dtype, 0) + n
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    inputs = {x.untyped_storage()._cdata, y.untyped_storage()._cdata}
    seen = set()
    def pack(t):
        st = t.untyped_storage()
        {PACK}
        return t
    for p in model.parameters():
        add("parameters", p, p.untyped_storage().nbytes())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(x, y)
    loss.backward()
    for p in model.parameters():
        add("gradients", p.grad, p.grad.untyped_storage().nbytes())
    optimizer.step()
    for s in optimizer.state.values():
        for v in s.values():
            if torch.is_tensor(v):
                add("optimizer", v, v.untyped_storage().nbytes())
    optimizer.zero_grad(set_to_none=True)
    return report
'''
# counts a Linear's saved weight (a parameter) as an activation
_PARAMS_AS_ACTIVATIONS = _REPORT.replace("{PACK}", '''if st._cdata not in inputs and st._cdata not in seen:
            seen.add(st._cdata)
            add("activations", t, st.nbytes())''')
# adds t.nbytes for every saved tensor: a tensor saved twice counts twice, a view counts its own size
_NO_DEDUP = _REPORT.replace("{PACK}", '''if st._cdata not in params and st._cdata not in inputs:
            add("activations", t, t.nbytes)''')

# counts only Adam's state (exp_avg, exp_avg_sq, step): SGD's momentum buffer is missed
_ADAM_KEYS_ONLY = _REPORT.replace("{PACK}", '''if st._cdata not in params and st._cdata not in inputs and st._cdata not in seen:
            seen.add(st._cdata)
            add("activations", t, st.nbytes())''').replace(
    "for v in s.values():", "for v in [s[k] for k in (\"exp_avg\", \"exp_avg_sq\", \"step\") if k in s]:")
# correct, written differently: storages told apart by data_ptr(), not _cdata
_REPORT_ALT = _REPORT.replace("{PACK}", '''key = st.data_ptr()
        if key not in {q.untyped_storage().data_ptr() for q in model.parameters()} and \\
                key not in (x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()) and key not in seen:
            seen.add(key)
            add("activations", t, st.nbytes())''')

# unscales and checks only the first parameter group (optimizer.param_groups[0]): the other groups keep their
# scaled gradients and an inf/NaN there goes unseen
_FIRST_GROUP_ONLY = _scaler().replace("for group in optimizer.param_groups:", "for group in optimizer.param_groups[:1]:")
# the found-inf flag restarts for each parameter group: only the last group decides
_LAST_GROUP_DECIDES = _scaler().replace("                for p in group[\"params\"]:",
                                        "                found = False\n                for p in group[\"params\"]:")
# "accumulation" by summing the micro-batch losses and calling backward once: the same gradients, but the graphs of
# every micro-batch are alive together until that backward (the bug lesson 04 teaches)
_ONE_BACKWARD_ON_SUMMED_LOSS = _AMP.replace('''    total = 0.0
    for x, y in micro_batches:
        {FORWARD}
        scaler.scale(loss).backward()
        total += loss.item()''', '''    total = 0.0
    summed = 0
    for x, y in micro_batches:
        {FORWARD}
        summed = summed + loss
        total += loss.item()
    scaler.scale(summed).backward()''').replace("{CAST}", "pass").replace("{FORWARD}", _AUTOCAST_FORWARD).replace(
    "{CLIP}", _UNSCALE_THEN_CLIP)
# ignores the dtype argument: always fp16 (on a bf16 call the forward runs in the wrong format)
_ALWAYS_FP16 = _amp(forward=_AUTOCAST_FORWARD.replace("dtype=dtype", "dtype=torch.float16"))
# device_type hard-coded to "cuda": on any other device autocast is off and the forward runs in fp32
_CUDA_AUTOCAST = _amp(forward=_AUTOCAST_FORWARD.replace("x.device.type", '"cuda"'))
# device_type hard-coded to "cpu": right on the CPU, but on a GPU autocast("cpu") leaves the CUDA ops in fp32
_CPU_AUTOCAST = _amp(forward=_AUTOCAST_FORWARD.replace("x.device.type", '"cpu"'))
# device_type from the notebook's own `device` (memlab.pick_device(): the machine, not the inputs)
_NOTEBOOK_DEVICE_AUTOCAST = _amp(forward=_AUTOCAST_FORWARD.replace("x.device.type", "device.type"))
# correct, written differently: each micro-batch moved to the parameters' device first (a no-op where it already
# is) and autocast on the device it then is on
_MOVED_TO_THE_MODEL = _amp(forward='''on = next(model.parameters()).device
        x, y = x.to(on), y.to(on)
        with torch.autocast(x.device.type, dtype=dtype):
            loss = model(x, y) / k''')
# correct, written differently: the step's memory freed by hand (del the loss after its backward), autocast's
# device read from the model's parameters
_DEL_LOSS = _amp(forward='''with torch.autocast(next(model.parameters()).device.type, dtype=dtype):
            loss = model(x, y) / k''').replace("        total += loss.item()\n",
                                                 "        total += loss.item()\n        del loss\n")

# every row starts with all three dtypes at 0 bytes: the dtypes that are not there stay in the report
_KEEPS_ZERO_ENTRIES = _REPORT_ALT.replace(
    '    report = {"parameters": {}, "gradients": {}, "optimizer": {}, "activations": {}}',
    '    report = {c: {torch.float32: 0, torch.float16: 0, torch.bfloat16: 0}\n'
    '              for c in ("parameters", "gradients", "optimizer", "activations")}')

_SCALER_LOSES = ["task3_1_loss_scaler_visible", "task3_1_loss_scaler_hidden"]
_AMP_LOSES = ["task3_2_amp_step_visible", "task3_2_amp_step_hidden"]
_REPORT_LOSES = ["task3_3_dtype_report_visible", "task3_3_dtype_report_hidden"]

WRONG = {
    "unscales_only_the_first_param_group": {"replace": {"task3_1_loss_scaler": _FIRST_GROUP_ONLY},
                                            "must_lose": ["task3_1_loss_scaler_hidden"],
                                            "must_keep": ["task3_1_loss_scaler_visible", "task3_2_amp_step_hidden"]},
    "found_inf_reset_per_param_group": {"replace": {"task3_1_loss_scaler": _LAST_GROUP_DECIDES},
                                        "must_lose": ["task3_1_loss_scaler_hidden"],
                                        "must_keep": ["task3_1_loss_scaler_visible", "task3_3_dtype_report_hidden"]},
    "one_backward_on_the_summed_micro_batch_losses": {"replace": {"task3_2_amp_step": _ONE_BACKWARD_ON_SUMMED_LOSS},
                                                      "must_lose": _AMP_LOSES,
                                                      "must_keep": ["task3_1_loss_scaler_hidden"]},
    "autocast_dtype_hard_coded_fp16": {"replace": {"task3_2_amp_step": _ALWAYS_FP16},
                                       "must_lose": _AMP_LOSES,
                                       "must_keep": ["task3_3_dtype_report_hidden"]},
    "autocast_device_type_hard_coded_cuda": {"replace": {"task3_2_amp_step": _CUDA_AUTOCAST},
                                             "must_lose": _AMP_LOSES,
                                             "must_keep": ["task3_1_loss_scaler_hidden"]},
    "autocast_device_type_hard_coded_cpu": {"replace": {"task3_2_amp_step": _CPU_AUTOCAST},
                                            "must_lose": _AMP_LOSES,
                                            "must_keep": ["task3_3_dtype_report_hidden"]},
    "autocast_on_the_notebooks_device": {"replace": {"task3_2_amp_step": _NOTEBOOK_DEVICE_AUTOCAST},
                                         "must_lose": _AMP_LOSES,
                                         "must_keep": ["task3_1_loss_scaler_hidden"]},
    "no_skip_on_overflow": {"replace": {"task3_1_loss_scaler": _NO_SKIP},
                            "must_lose": _SCALER_LOSES,
                            "must_keep": ["task3_2_amp_step_hidden", "task3_3_dtype_report_hidden"]},
    "unscales_out_of_place": {"replace": {"task3_1_loss_scaler": _UNSCALE_OUT_OF_PLACE},
                              "must_lose": _SCALER_LOSES,
                              "must_keep": ["task3_2_amp_step_hidden"]},
    "report_keeps_dtypes_with_zero_bytes": {"replace": {"task3_3_dtype_report": _KEEPS_ZERO_ENTRIES},
                                            "must_lose": _REPORT_LOSES,
                                            "must_keep": ["task3_1_loss_scaler_hidden"]},
    "step_drops_its_extra_arguments": {"replace": {"task3_1_loss_scaler": _DROPS_STEP_ARGUMENTS},
                                       "must_lose": _SCALER_LOSES,
                                       "must_keep": ["task3_2_amp_step_hidden"]},
    "step_returns_nothing": {"replace": {"task3_1_loss_scaler": _STEP_RETURNS_NOTHING},
                             "must_lose": _SCALER_LOSES,
                             "must_keep": ["task3_3_dtype_report_hidden"]},
    "never_grows": {"replace": {"task3_1_loss_scaler": _NEVER_GROWS},
                    "must_lose": _SCALER_LOSES,
                    "must_keep": ["task3_2_amp_step_hidden"]},
    "unscales_twice": {"replace": {"task3_1_loss_scaler": _UNSCALES_TWICE},
                       "must_lose": _SCALER_LOSES,
                       "must_keep": ["task3_3_dtype_report_hidden"]},
    "isinf_misses_nan": {"replace": {"task3_1_loss_scaler": _ISINF_MISSES_NAN},
                         "must_lose": ["task3_1_loss_scaler_hidden"],
                         "must_keep": ["task3_2_amp_step_hidden"]},
    "found_inf_overwritten_by_each_parameter": {"replace": {"task3_1_loss_scaler": _ONLY_LAST_PARAM},
                                                "must_lose": ["task3_1_loss_scaler_hidden"],
                                                "must_keep": ["task3_3_dtype_report_hidden"]},
    "clean_count_not_reset_on_overflow": {"replace": {"task3_1_loss_scaler": _COUNT_NOT_RESET},
                                          "must_lose": ["task3_1_loss_scaler_hidden"],
                                          "must_keep": ["task3_2_amp_step_hidden"]},
    "grows_by_two_not_growth_factor": {"replace": {"task3_1_loss_scaler": _GROWS_BY_TWO},
                                       "must_lose": ["task3_1_loss_scaler_hidden"],
                                       "must_keep": ["task3_3_dtype_report_hidden"]},
    # correct alternatives must keep their points; each is paired with a mistake in another task, which loses
    "scaler_written_differently": {"replace": {"task3_1_loss_scaler": _SCALER_ALT, "task3_3_dtype_report": _NO_DEDUP},
                                   "must_lose": _REPORT_LOSES,
                                   "must_keep": _SCALER_LOSES},
    "clip_then_optimizer_step_directly": {"replace": {"task3_2_amp_step": _CLIP_THEN_OPTIMIZER_STEP},
                                          "must_lose": ["task3_2_amp_step_hidden"],
                                          "must_keep": ["task3_1_loss_scaler_hidden"]},
    "always_unscale_before_step": {"replace": {"task3_2_amp_step": _ALWAYS_UNSCALE,
                                               "task3_1_loss_scaler": _NEVER_GROWS},
                                   "must_lose": _SCALER_LOSES,
                                   "must_keep": _AMP_LOSES},
    "optimizer_state_adam_keys_only": {"replace": {"task3_3_dtype_report": _ADAM_KEYS_ONLY},
                                       "must_lose": ["task3_3_dtype_report_hidden"],
                                       "must_keep": ["task3_3_dtype_report_visible", "task3_2_amp_step_hidden"]},
    "report_keyed_by_data_ptr": {"replace": {"task3_3_dtype_report": _REPORT_ALT,
                                             "task3_2_amp_step": _CLIP_BEFORE_UNSCALE},
                                 "must_lose": _AMP_LOSES,
                                 "must_keep": _REPORT_LOSES},
    "clip_before_unscale": {"replace": {"task3_2_amp_step": _CLIP_BEFORE_UNSCALE},
                            "must_lose": _AMP_LOSES,
                            "must_keep": ["task3_1_loss_scaler_hidden", "task3_3_dtype_report_hidden"]},
    "parameters_cast_to_16bit": {"replace": {"task3_2_amp_step": _PARAMS_TO_16BIT},
                                 "must_lose": _AMP_LOSES,
                                 "must_keep": ["task3_1_loss_scaler_hidden"]},
    "sum_not_mean_over_micro_batches": {"replace": {"task3_2_amp_step": _NO_MEAN},
                                        "must_lose": _AMP_LOSES,
                                        "must_keep": ["task3_3_dtype_report_hidden"]},
    "parameters_as_activations": {"replace": {"task3_3_dtype_report": _PARAMS_AS_ACTIVATIONS},
                                  "must_lose": _REPORT_LOSES,
                                  "must_keep": ["task3_1_loss_scaler_hidden", "task3_2_amp_step_hidden"]},
    "saved_tensors_not_deduplicated": {"replace": {"task3_3_dtype_report": _NO_DEDUP},
                                       "must_lose": _REPORT_LOSES,
                                       "must_keep": ["task3_2_amp_step_hidden"]},
}

# correct alternatives: every cell of the tasks they change must keep its points
RIGHT = {
    "del_loss_and_device_from_parameters": {"replace": {"task3_2_amp_step": _DEL_LOSS}},
    "micro_batches_moved_to_the_model": {"replace": {"task3_2_amp_step": _MOVED_TO_THE_MODEL}},
}
