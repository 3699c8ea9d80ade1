"""Plausible-wrong submissions for exercise 00 and the points each must lose, and correct
alternatives that must keep every point. Each is the solution with one mistake made in it."""

from __future__ import annotations

from . import both, edit, solution_cells

ASSIGNMENT = "00_memory_hierarchy"
_CELLS = solution_cells(ASSIGNMENT)
S1, S2, S3, S4 = "task0_1_op_cost", "task0_2_roofline", "task0_3_copy_bandwidth", "task0_4_new_storage_bytes"
COST, ROOF, BW, STORE = (_CELLS[k] for k in (S1, S2, S3, S4))


ALL1, ALL2, ALL3, ALL4 = both(S1), both(S2), both(S3), both(S4)


def _only(task, lose):
    """must_lose `lose`, must_keep every cell of the other tasks."""
    others = [c for t in (S1, S2, S3, S4) if t != task for c in both(t)]
    return {"must_lose": lose, "must_keep": others}


# a learner who classifies each call by its name, with reshape in the list of views
_BY_NAME = '''from torch.overrides import TorchFunctionMode

VIEWS = {"view", "reshape", "transpose", "t", "__getitem__", "expand", "detach", "unsqueeze", "squeeze",
         "chunk", "split", "narrow", "permute", "__get__"}


class _Made(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.made = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") not in VIEWS:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.made.add(t.untyped_storage().data_ptr())
        return out


def new_storage_bytes(fn, *inputs):
    owned = {x.untyped_storage().data_ptr() for x in inputs}
    with _Made() as mode:
        out = fn(*inputs)
    new = {}
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        st = t.untyped_storage()
        if st.data_ptr() in mode.made and st.data_ptr() not in owned:
            new[st.data_ptr()] = st.nbytes()
    return sum(new.values())'''

# a learner who counts every new storage any op makes, intermediates included
_ALL_ALLOCATIONS = '''from torch.utils._python_dispatch import TorchDispatchMode


class _Allocs(TorchDispatchMode):
    def __init__(self, owned):
        super().__init__()
        self.seen, self.total = set(owned), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(t.untyped_storage().data_ptr())
                self.total += t.untyped_storage().nbytes()
        return out


def new_storage_bytes(fn, *inputs):
    with _Allocs({x.untyped_storage().data_ptr() for x in inputs}) as mode:
        fn(*inputs)
    return mode.total'''

WRONG = {
    # task 0.1 --------------------------------------------------------------
    "matmul_no_factor_2": {"replace": {S1: edit(COST, "return 2 * batch * m * n * k,", "return batch * m * n * k,")},
                           **_only(S1, ALL1)},
    "bytes_without_inputs": {"replace": {S1: edit(edit(COST, "(math.prod(a) + math.prod(b) + batch * m * n) * size",
                                                         "batch * m * n * size"),
                                                   "(sum(math.prod(s) for s in shapes) + out) * size", "out * size")},
                             **_only(S1, ALL1)},
    "matmul_b_always_2d": {"replace": {S1: edit(COST, "math.prod(a) + math.prod(b) +", "math.prod(a) + k * n +")},
                           **_only(S1, ALL1)},
    "broadcast_inputs_read_at_output_size": {
        "replace": {S1: edit(COST, "(sum(math.prod(s) for s in shapes) + out) * size", "(len(shapes) + 1) * out * size")},
        **_only(S1, ALL1)},
    "layer_norm_without_weight_and_bias": {"replace": {S1: edit(COST, "(2 * n + 2 * x[-1]) * size", "2 * n * size")},
                                           **_only(S1, ALL1)},
    # bytes per element from a table of the common training dtypes (float8 and float64 read as 2 bytes)
    "itemsize_table_of_training_dtypes": {
        "replace": {S1: edit(COST, "size = dtype.itemsize",
                             "size = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}.get(dtype, 2)")},
        **_only(S1, [f"{S1}_hidden"])},
    # task 0.2 --------------------------------------------------------------
    "ridge_from_vector_peak": {"replace": {S2: edit(ROOF, "ridge = peak / bw", "ridge = gpu['vector_flops'] / bw")},
                               **_only(S2, ALL2)},
    "vector_peak_always": {"replace": {S2: edit(ROOF, 'if op == "matmul" and name in gpu["tensor_flops"]:',
                                                 "if False:")},
                           **_only(S2, ALL2)},
    "tensor_peak_for_every_op": {"replace": {S2: edit(ROOF, 'if op == "matmul" and name in gpu["tensor_flops"]:',
                                                       'if name in gpu["tensor_flops"]:')},
                                 **_only(S2, ALL2)},
    # the GPU looked up by its name among the three presets: no figure read from the dict it was given
    "gpu_looked_up_among_the_presets": {
        "replace": {S2: "from memlab.kit.ex00 import GPUS as _PRESETS\n\n" + edit(
            ROOF, '    name = str(dtype).split(".")[-1]\n',
            '    name = str(dtype).split(".")[-1]\n    gpu = next(g for g in _PRESETS.values() if g["name"] == gpu["name"])\n')},
        **_only(S2, [f"{S2}_hidden"])},
    # task 0.3 --------------------------------------------------------------
    "cold_first_run": {"replace": {S3: edit(BW, "    for _ in range(warmup):\n        dst.copy_(src)\n", "")},
                       **_only(S3, ALL3)},
    "mean_of_times": {"replace": {S3: edit(BW, "statistics.median(times)", "statistics.mean(times)")},
                      **_only(S3, ALL3)},
    "one_timer_around_all_repeats": {"replace": {S3: edit(BW, '''    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * n_bytes / statistics.median(times) / 1e9''', '''    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync()
    return 2 * n_bytes * repeats / (time.perf_counter() - t0) / 1e9''')}, **_only(S3, ALL3)},
    "bytes_counted_once": {"replace": {S3: edit(BW, "return 2 * n_bytes /", "return n_bytes /")},
                           **_only(S3, ALL3)},
    # a "copy" into the source itself (or a view of it): copy_ returns at once and moves no bytes
    "copy_onto_itself": {"replace": {S3: edit(BW, "dst = torch.empty_like(src)", "dst = src")}, **_only(S3, ALL3)},
    "copy_onto_a_view_of_itself": {"replace": {S3: edit(BW, "dst = torch.empty_like(src)", "dst = src[:]")},
                                   **_only(S3, ALL3)},
    # task 0.4 --------------------------------------------------------------
    # a returned list is taken for a tensor (the task allows a tuple or a list)
    "tuple_results_only": {"replace": {S4: edit(STORE, "isinstance(out, (tuple, list))", "isinstance(out, tuple)")},
                           **_only(S4, ALL4)},
    "reshape_always_free": {"replace": {S4: _BY_NAME}, **_only(S4, ALL4)},
    "views_counted_as_copies": {"replace": {S4: edit(STORE, "if st.data_ptr() not in owned:",
                                                      "if not any(t is x for x in inputs):")},
                                **_only(S4, ALL4)},
    "tensor_nbytes_not_storage": {"replace": {S4: edit(STORE, "new[st.data_ptr()] = st.nbytes()",
                                                        "new[st.data_ptr()] = t.nbytes")},
                                  **_only(S4, [f"{S4}_hidden"])},
    "counts_intermediates": {"replace": {S4: _ALL_ALLOCATIONS}, **_only(S4, [f"{S4}_hidden"])},
    "uses_the_tracker": {"replace": {S4: '''def new_storage_bytes(fn, *inputs):
    with memlab.MemoryTracker() as t:
        out = fn(*inputs)
    return t.current'''}, **_only(S4, ALL4)},
}

# correct alternatives: every point kept
RIGHT = {
    # perf_counter imported by name, the lower median of a tensor of times
    "timer_imported_by_name_torch_median": {"replace": {S3: "from time import perf_counter\n\n" + edit(edit(edit(
        BW, "t0 = time.perf_counter()", "t0 = perf_counter()"), "times.append(time.perf_counter() - t0)",
        "times.append(perf_counter() - t0)"), "statistics.median(times)",
        "torch.tensor(times, dtype=torch.float64).median().item()")}},
    # the tensor-core peak looked up with .get
    "peak_with_get": {"replace": {S2: edit(ROOF, 'if op == "matmul" and name in gpu["tensor_flops"]:\n'
                                                        '        peak = gpu["tensor_flops"][name]\n    else:\n'
                                                        '        peak = gpu["vector_flops"]',
                                                  'peak = gpu["tensor_flops"].get(name, gpu["vector_flops"]) '
                                                  'if op == "matmul" else gpu["vector_flops"]')}},
}
