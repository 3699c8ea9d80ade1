"""The cheapest ways to make a model fit (`fit_search`); the `memlab-fit` command line is in cli.py.

The search tries the course's techniques on top of a request and keeps the plans that fit, cheapest
first; see `fit_search` for the cost model.
"""

from __future__ import annotations

import time

from .config import check_config, read_config
from .optimizers import trainer_default
from .plan import CHOICES, FitResult, auto_precision, fit
from ..core.gpus import HEADROOM
from ..core.track import format_bytes
from ..core.validate import is_int, pos_int

__all__ = ["fit_search", "extra_seconds", "extras_of", "EXTRAS", "main"]

_METHOD_RANK = {"full": 0, "lora": 1, "qlora": 2}


def _sheet(gpu_name: str):
    """The data sheet of a preset (memlab.core.gpus.GPU_SPECS); L4-24GB's for any other GPU."""
    from ..core.gpus import GPU_SPECS
    return next((v for k, v in GPU_SPECS.items() if gpu_name.startswith(k)), GPU_SPECS["L4-24GB"])


# The host's memory bandwidth the CPU AdamW step of ZeRO-Offload is charged at when none is given: two channels of
# DDR4-3200, 2 x 3200 MT/s x 8 bytes = 51.2 GB/s (JEDEC JESD79-4 data rates), a common workstation; pass the one
# measured on your host (memlab.copy_bandwidth on "cpu"; lesson 08 does) to extra_seconds.
HOST_BANDWIDTH = 51.2e9


def extra_seconds(r: FitResult, parts: bool = False, host_bandwidth: float = HOST_BANDWIDTH):
    """The search's cost model: extra seconds per optimizer step a plan spends beside a plain step, from
    the data sheet of the GPU (`memlab.core.gpus`; L4-24GB's figures for a GPU not listed there):

      recompute_flops / dense 16-bit tensor-core FLOP/s (fp32 precision: TF32, or FP32 without TF32)
      + offload_bytes / PCIe bandwidth of one direction (the data sheet's figure, both directions, / 2)
      + host_step_bytes / host_bandwidth (ZeRO-Offload's AdamW step on the CPU: the bytes it must read and write
        in host memory, `memlab.fitting.run.plan_cost`; host_bandwidth in bytes/s, HOST_BANDWIDTH by default)
      + comm_bytes / NVLink bandwidth of one direction (PCIe where the card has no NVLink)
      + (steps_per_batch - 1) * 3 * weight bytes / DRAM bandwidth (each extra micro-batch reads the
        weights again in forward, backward and the gradient accumulation)
      + dequant_bytes / DRAM bandwidth (QLoRA's dequantization of its 4-bit base before each use)
    Peak rates: real runs are slower, so these are lower bounds, good for ranking, not for timing.
    With parts=True: {"recompute", "offload", "host_step", "comm", "micro_batches", "dequant"} seconds instead of
    their sum.
    """
    if not (isinstance(host_bandwidth, (int, float)) and not isinstance(host_bandwidth, bool) and host_bandwidth > 0):
        raise ValueError(f"host_bandwidth must be a positive number of bytes/s, got {host_bandwidth!r}")
    s = _sheet(r.gpu)
    flops = (s.tf32_tensor or s.fp32) if r.plan["precision"] == "fp32" else (s.bf16_tensor or s.fp16_tensor)
    link = (s.nvlink_bandwidth or s.pcie_bandwidth) / 2
    c = r.cost
    weights = r.model_states.get("parameters", 0) * r.plan["gpus"] if r.plan["zero"] == 3 else \
        r.model_states.get("parameters", 0)
    out = {"recompute": c["recompute_flops"] / flops, "offload": c["offload_bytes"] / (s.pcie_bandwidth / 2),
           "host_step": c.get("host_step_bytes", 0) / host_bandwidth,
           "comm": c["comm_bytes"] / link, "micro_batches": (c["steps_per_batch"] - 1) * 3 * weights / s.dram_bandwidth,
           "dequant": c.get("dequant_bytes", 0) / s.dram_bandwidth}
    return out if parts else sum(out.values())


def _divisors_desc(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


# What practitioners turn on when the plain plan does not fit, cheapest first: each adds to the one before. The first
# two cost no time: QLoRA's non-quantized parts (embeddings, norms, head) in 16 bits, as the QLoRA authors' script
# casts them (QLoRA plans only), and the chunked loss (the same FLOPs in another order); they are tried at every
# checkpointing level (FREE). The step in backward costs none either but leaves no room for gradient accumulation,
# ZeRO or clipping by the global norm, so it is tried only with full checkpointing, whole batches and one GPU; paged
# optimizer state costs its PCIe traffic when the driver evicts it (fit counts it in offload_bytes); activation
# offloading comes last: it sends every saved activation over PCIe twice a step.
EXTRAS = ({}, {"qlora_rest": "16bit"}, {"qlora_rest": "16bit", "loss": "chunked"},
          {"qlora_rest": "16bit", "loss": "chunked", "step_in_backward": True},
          {"qlora_rest": "16bit", "loss": "chunked", "step_in_backward": True, "paged": True},
          {"qlora_rest": "16bit", "loss": "chunked", "step_in_backward": True, "paged": True,
           "activation_offload": True})
FREE = 3                      # EXTRAS[:FREE] cost no time: tried at every checkpointing level
# ZeRO-Offload runs DeepSpeed's CPU Adam on the host: only the AdamW optimizers can be offloaded (fit refuses others)
OFFLOADABLE = ("adamw", "adamw_fused", "adamw_forloop")


def _extras_for(method: str, xs) -> list[dict]:
    """The extras that mean something for `method` (the 16-bit rest is QLoRA's), without repeats, in order."""
    out = []
    for x in xs:
        x = {k: v for k, v in x.items() if k != "qlora_rest" or method == "qlora"}
        if x not in out:
            out.append(x)
    return out


def extras_of(plan: dict) -> str:
    """The practitioner's options a plan turns on, as the search's table names them ("-" for none)."""
    on = [name for key, name in (("qlora_rest", "16bit-rest"), ("loss", "chunked-loss"),
                                 ("step_in_backward", "step-in-bwd"), ("paged", "paged"),
                                 ("activation_offload", "act-offload"))
          if plan.get(key) not in (None, False, "full", "fp32") and (key != "qlora_rest" or plan["method"] == "qlora")]
    return ",".join(on) or "-"


def fit_search(model, gpu="L4-24GB", *, batch: int = 1, seq: int = 512, mode: str = "train",
               precision: str = "auto", methods=("full", "lora", "qlora"), optimizers=("auto", "adamw8bit"),
               gpus=(1,), offload: bool = True, extras: bool = True, attention: str = "sdpa", lora_r: int = 16,
               target_seq: int | None = None, headroom: float = HEADROOM, context: int | None = None,
               limit: int = 10, progress=None) -> list[FitResult]:
    """The cheapest combinations of techniques under which `model` fits on `gpu`, best first.

    Searched: method in `methods`, optimizer in `optimizers` (full fine-tuning only: LoRA adapters are
    small, they keep AdamW; "auto" is the Hugging Face Trainer's pick, fused AdamW on torch >= 2.8),
    checkpointing none/selective/full, micro-batches (gradient accumulation, every divisor of `batch`), and for
    each number of GPUs in `gpus` ZeRO stage 0-3, with and without optimizer offload (`offload=True`; only for
    the AdamW optimizers, which DeepSpeed's CPU Adam runs; on one GPU ZeRO is only tried with offload). With
    `extras=True`, a plan that does not fit is tried again with what practitioners add to it (`EXTRAS`, in order):
    at every checkpointing level the ones that cost no time (QLoRA's non-quantized parts in 16 bits, the chunked
    loss), with full checkpointing also the optimizer step in backward, paged optimizer state and activation
    offloading; the least-memory plan of a branch is the least of these.
    `precision` is kept as asked; `context` as fit takes it (None: a recording of the card, else the cited figure).
    Each result's `cost["extra_seconds"]` is `extra_seconds` (the cost model).

    Order: methods that change WHAT is trained come last - every full fine-tuning plan first, then LoRA,
    then QLoRA (pass methods= to choose) - then fewer GPUs, then the lower extra_seconds.
    Pruning: each (method, optimizer) branch first runs its least-memory plan (full checkpointing,
    micro-batch 1, every sharding) and is skipped if that does not fit; then the runs go from cheap to dear
    (checkpointing none -> selective -> full, micro-batch from `batch` down); a branch stops at its first plan
    that fits, and a stronger checkpointing only tries micro-batches larger than the largest that fitted with a
    weaker one. For mode="inference" the methods are compared as they are (lora serves like full; qlora serves
    a 4-bit base).
    Returns at most `limit` plans (an empty list: nothing searched fits). `progress`, if given, is called with
    one line per branch and per plan tried (memlab-fit prints them).
    """
    pos_int("limit", limit)
    if not isinstance(extras, bool):
        raise ValueError(f"extras must be True or False, got {extras!r}")
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be None or a function of one str, got {type(progress).__name__}")
    t0 = time.perf_counter()

    def say(line):
        if progress is not None:
            progress(f"[{time.perf_counter() - t0:5.0f} s] {line}")
    if not isinstance(optimizers, str):
        optimizers = tuple(trainer_default() if o == "auto" else o for o in optimizers)
    for name, vals, allowed in (("methods", methods, CHOICES["method"]),
                                ("optimizers", optimizers, CHOICES["optimizer"])):
        if isinstance(vals, str) or not vals or any(v not in allowed for v in vals):
            raise ValueError(f"{name} must be a non-empty list from {allowed}, got {vals!r}")
    if is_int(gpus):
        gpus = (gpus,)
    if not gpus or not all(is_int(n) and n >= 1 for n in gpus):
        raise ValueError(f"gpus must be a positive int or a list of them, got {gpus!r}")
    cfg = check_config(read_config(model))       # the plain config.json dict: every fit below reads it as is
    name = model if isinstance(model, str) else cfg["model_type"]
    precision = auto_precision(gpu) if precision == "auto" else precision
    base = dict(batch=batch, seq=seq, precision=precision, attention=attention, lora_r=lora_r, headroom=headroom,
                mode=mode, target_seq=target_seq, context=context)
    found: list[FitResult] = []

    def keep(r):
        r.model = str(name)
        r.cost["extra_seconds"] = extra_seconds(r)
        found.append(r)

    if mode == "inference":
        for m in methods:
            r = fit(cfg, gpu, method=m, **base)
            if r.fits:
                keep(r)
    else:
        for m in methods:
            if m == "qlora" and precision == "mixed":
                continue
            paged_out = False                  # a full branch whose least plan, its state paged away, did not fit
            for opt in (optimizers if m == "full" else (trainer_default(),)):
                least = dict(base, method=m, optimizer=opt, checkpointing="full")
                # each extra lowers the peak: the least plans are the last one without the step in backward
                # (micro-batches of 1) and the last one of all (whole batches); with a batch of 1 the last one
                # holds less than the other, so it alone decides
                leasts = _extras_for(m, ([EXTRAS[FREE - 1]] if batch > 1 else []) + [EXTRAS[-1]] if extras
                                     else EXTRAS[:1])
                if paged_out or not any(_shardings(cfg, gpu, gpus, offload,
                                                   dict(least, micro_batch=_least_micro(x, batch), **x))
                                        for x in leasts):
                    # with the optimizer's state paged off the card, what is left (weights, one gradient at a time,
                    # activations) is the same for every optimizer without step scratch: the next ones fail too
                    paged_out = paged_out or (m == "full" and extras and batch == 1)
                    say(f"{m}, {opt}: even full checkpointing with micro-batches of 1 does not fit; skipped")
                    continue                   # not even its least-memory plan fits: skip the branch
                say(f"{m}, {opt}: its least-memory plan fits; looking for a cheaper one")
                fitted_micro = 0               # the largest micro-batch that fitted with weaker checkpointing
                free = _extras_for(m, EXTRAS[:FREE] if extras else EXTRAS[:1])
                # weaker checkpointing keeps more: when full checkpointing with the free extras does not fit the
                # smallest micro-batch, neither does no or selective checkpointing (that run is needed below anyway)
                strong = _shardings(cfg, gpu, gpus, offload, dict(least, micro_batch=None if batch == 1 else 1,
                                                                  **free[-1]))
                for ckpt in ("none", "selective", "full"):
                    if ckpt != "full" and not strong:
                        continue
                    xs = _extras_for(m, EXTRAS) if extras and ckpt == "full" else free

                    def attempt(micro):
                        mb = None if micro == batch else micro
                        plan = dict(base, method=m, optimizer=opt, checkpointing=ckpt, micro_batch=mb)
                        # no gradient accumulation with the step in backward
                        hits = _first_fitting([x for x in xs if not (x.get("step_in_backward") and micro != batch)],
                                              lambda x: _shardings(cfg, gpu, gpus, offload, dict(plan, **x)))
                        say(f"{m}, {opt}, checkpointing {ckpt}, micro-batch {micro}: "
                            + ("does not fit" if not hits else "fits" if extras_of(hits[0].plan) == "-"
                               else f"fits with {extras_of(hits[0].plan)}"))
                        return hits
                    micros = [d for d in _divisors_desc(batch) if d > fitted_micro]
                    # a plan's peak grows with its micro-batch: when the smallest does not fit, no larger one does
                    # (the step in backward breaks this: it needs whole batches)
                    in_bwd = any(x.get("step_in_backward") for x in xs)
                    if not in_bwd and len(micros) > 1 and not attempt(micros[-1]):
                        continue
                    for micro in micros:
                        hits = attempt(micro)
                        for r in hits:
                            keep(r)
                        if hits:
                            fitted_micro = micro
                            break
                    if fitted_micro == batch:
                        break
    found.sort(key=lambda r: (_METHOD_RANK[r.plan["method"]], r.plan["gpus"], r.cost["extra_seconds"]))
    return found[:limit]


def _first_fitting(xs: list, hits_of) -> list:
    """The hits of the first of `xs` that fits, each x adding to the one before (so each holds less): the first
    alone when it fits, nothing when the last does not, else a bisection between them (a few runs, not one per x)."""
    if not xs:
        return []
    seen = {}

    def h(i):
        if i not in seen:
            seen[i] = hits_of(xs[i])
        return seen[i]
    if h(0) or len(xs) == 1:
        return h(0)
    if not h(len(xs) - 1):
        return []
    lo, hi = 1, len(xs) - 1                      # h(hi) fits, h(lo - 1) does not
    while lo < hi:
        mid = (lo + hi) // 2
        if h(mid):
            hi = mid
        else:
            lo = mid + 1
    return h(lo)


def _least_micro(extra: dict, batch: int) -> int | None:
    """The smallest micro-batch a plan with `extra` may use: 1, or the whole batch with the step in backward (it
    updates the weights after every backward, so it allows no gradient accumulation)."""
    return None if extra.get("step_in_backward") or batch == 1 else 1


def _shardings(cfg, gpu, gpus, offload, kw) -> list[FitResult]:
    """For each number of GPUs, the cheapest sharding that fits (ZeRO 0-3, with/without offload); these
    reuse one measured run (fit caches it). The step in backward and paged state run on one GPU without ZeRO."""
    out = []
    alone = kw.get("step_in_backward") or kw.get("paged")
    for n in sorted(set(gpus)):
        if alone and n > 1:
            continue
        options = [(0, False)] if n == 1 else [(z, False) for z in (0, 1, 2, 3)]
        if offload and not alone and kw.get("optimizer") in OFFLOADABLE:
            options += [(z, True) for z in (1, 2, 3)]
        best = None
        for z, off in options:
            r = fit(cfg, gpu, zero=z, gpus=n, offload=off, **kw)
            if r.fits:
                r.cost["extra_seconds"] = extra_seconds(r)
                if best is None or r.cost["extra_seconds"] < best.cost["extra_seconds"]:
                    best = r
        if best is not None:
            out.append(best)
    return out


def format_plans(plans: list[FitResult]) -> str:
    """A table of `fit_search` results."""
    if not plans:
        return "no combination searched fits"
    head = (f"{'#':>2} {'method':<6} {'optim':<9} {'ckpt':<9} {'micro':>5} {'gpus':>4} {'zero':>4} {'offl':>4} "
            f"{'extras':<30} {'peak':>11} {'extra s/step':>12}")
    rows = [head]
    for i, r in enumerate(plans, 1):
        p = r.plan
        rows.append(f"{i:>2} {p['method']:<6} {p['optimizer']:<9} {p['checkpointing']:<9} "
                    f"{p['micro_batch'] or p['batch']:>5} {p['gpus']:>4} {p['zero']:>4} "
                    f"{'yes' if p['offload'] else '-':>4} {extras_of(p):<30} "
                    f"{format_bytes(r.peak):>11} {r.cost.get('extra_seconds', 0):>12.3f}")
    return "\n".join(rows)


# the memlab-fit command line lives in cli.py; pyproject's entry point names it here
from .cli import HELP, main  # noqa: E402,F401
