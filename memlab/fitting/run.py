"""How `memlab.fit` gets its numbers: the virtual-GPU runs at 2 and 3 layers extended to the model's
depth (`measure`), with each run's allocation stream replayed through the caching-allocator model
(`memlab.core.allocator`) for its reserved bytes, the per-rank partition of ZeRO and offload computed on top of
them (`shard_phases`), and the extra work a plan costs per step (`plan_cost`)."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

from ..core.track import CATEGORIES

__all__ = ["measure", "allocator_bytes", "shard_phases", "plan_cost", "clear_cache", "cache_folder"]

# ----------------------------------------------------------------------------- measuring
_CACHE: dict = {}
# the runs use BASE and BASE + 1 layers: layer 0 differs from the others (its input needs no gradient), so
# 2 and 3 layers extend exactly where 1 and 2 do not (tests/test_fit.py, benchmarks/fit.md)
BASE = 2


def clear_cache():
    """Forget the measured runs and the built models of this process (measure caches them per config and options).
    The folder on disk (`cache_folder`) is left as it is: delete it to forget those."""
    _CACHE.clear()
    _SKELETONS.clear()


# ----------------------------------------------------------------------------- measuring, kept on disk
# Each measured run is kept on disk too, so that other processes (a second memlab-fit, the test suite's workers, a
# class run's judges) read it instead of running it again: in MEMLAB_FIT_CACHE=<folder> when that is set (set empty,
# nothing is kept: `memlab-fit --no-cache` does that), else in the user's cache folder, $XDG_CACHE_HOME/memlab/fit
# (~/.cache/memlab/fit). A file is named by a hash of the run's key (the config's JSON and the run's options) and of
# what decides the numbers: every source file of memlab and the versions of torch, transformers, peft and
# bitsandbytes. Change any of them and the old files are simply never read again; delete the folder to forget them.
def cache_folder() -> Path | None:
    """Where measured runs are kept (`MEMLAB_FIT_CACHE`, else $XDG_CACHE_HOME/memlab/fit or ~/.cache/memlab/fit);
    None when MEMLAB_FIT_CACHE is set empty (nothing kept)."""
    folder = os.environ.get("MEMLAB_FIT_CACHE")
    if folder is not None:
        return Path(folder) if folder else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memlab" / "fit"


@functools.lru_cache(maxsize=1)
def _code_version() -> str:
    import importlib.metadata as md
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    for dist in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            h.update(f"{dist}={md.version(dist)}".encode())
        except md.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    return h.hexdigest()


def _disk_file(key) -> Path | None:
    folder = cache_folder()
    if folder is None:
        return None
    return folder / (hashlib.sha256(repr((_code_version(), key)).encode()).hexdigest() + ".json")


def _disk_read(key):
    f = _disk_file(key)
    try:
        got = json.loads(f.read_text()) if f is not None else None
    except (OSError, ValueError):          # absent, unreadable or half-written by another process: measure
        return None
    ok = isinstance(got, dict) and set(got) == {"phases", "info", "allocator"} and \
        all(isinstance(v, dict) for v in got.values())
    return got if ok else None             # JSON that is not a measured run: measure


def _disk_write(key, out: dict) -> None:
    f = _disk_file(key)
    text = json.dumps(out)
    if f is None or json.loads(text) != out:      # only what JSON gives back unchanged
        return
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, f)                          # whole or not at all, for readers in other processes
    except OSError:
        pass


def _run_key(plan):
    """The options that change what runs (ZeRO, gpus and offload are computed on top of a run)."""
    micro = plan.micro if plan.mode == "train" else plan.batch
    from .optimizers import run_as
    return replace(plan, batch=micro * min(2, plan.steps_per_batch), micro_batch=micro, zero=0, gpus=1,
                   offload=False, paged=False, checkpointing=plan.checkpointing if plan.mode == "train" else "none",
                   optimizer=run_as(plan.optimizer) if plan.mode == "train" else "adamw")


def _extend(a: dict, b: dict, layers: int) -> dict:
    """a (k layers) and b (k + 1 layers) extended linearly by layers - 1 more: a + (layers - 1) * (b - a)."""
    return {k: a[k] + (layers - 1) * (b[k] - a[k]) for k in a}


STEADY_REPEATS = 2   # the step's events are replayed this many more times: the cache of later steps (benchmarks/fit.md)


def allocator_bytes(tracker) -> dict:
    """A virtual run's allocation stream through the caching-allocator model, the step's part repeated
    STEADY_REPEATS more times (the steady state of a training loop): {"allocated": max allocated,
    "reserved": the least memory the allocator runs it in (it frees cached segments and retries before it
    fails), "reserved_cached": max reserved with memory to spare, what torch.cuda.max_memory_reserved() shows}."""
    from ..core.allocator import events_from_tracker, least_capacity, replay, step_start
    ev, start = events_from_tracker(tracker), step_start(tracker)
    kw = dict(repeat_from=start, repeats=STEADY_REPEATS) if start is not None else {}
    free = replay(ev, **kw)
    return {"allocated": free["max_allocated"], "reserved": least_capacity(ev, **kw),
            "reserved_cached": free["max_reserved"]}


_SKELETONS: dict = {}


def _skeleton(cfg_key: str, cfg, method, dtype, r, attention, layers=None):
    """`memlab.fitting.model.skeleton`, built once per config and model options and copied for each run (a run
    gives the copy its storage): building one, peft's wrapping above all, is most of a run's time, and a search
    runs the same model under many plans."""
    from .model import skeleton
    key = (cfg_key, cfg.num_hidden_layers, method, dtype, r, attention, layers)
    if key not in _SKELETONS:
        _SKELETONS[key] = skeleton(cfg, method, dtype, r, attention, layers)
    sk, info = _SKELETONS[key]
    return copy.deepcopy(sk), dict(info)


def measure(config, plan) -> dict:
    """Run `memlab.fitting.model.fit_step` on the virtual GPU with the model cut to BASE and BASE + 1 layers and extend
    to the config's depth. `config`: config.json contents (a dict, as `memlab.fitting.config.read_config` gives) or a
    transformers PretrainedConfig. Returns {"phases": {phase: {category: bytes, "total": bytes}}, "info": {...},
    "allocator": `allocator_bytes` of the deeper run}, cached per config and run options in this process and on disk
    (`cache_folder`): a run measured before is read back without importing transformers.
    The allocator's overhead does not grow linearly with depth (fragmentation settles over several layers), so
    it is not extended: `fit` scales its peak by that run's reserved / allocated (checked against full-depth
    replays in benchmarks/fit.md: 0 to 6% above them, never below, on the plans tried)."""
    from .config import config_key, load_config, read_config
    raw = config if isinstance(config, dict) else read_config(config)
    key = (config_key(raw), _run_key(plan))
    if key in _CACHE:
        return _CACHE[key]
    kept = _disk_read(key)
    if kept is not None:
        _CACHE[key] = kept
        return kept
    from .model import cut_layers, fit_step, model_depth, precision_dtype
    from ..core.virtual_gpu import VirtualGPU
    cfg = load_config(config)
    rp = key[1]
    if rp.optimizer == "adafactor":     # imported here, not inside the run: importing it makes module-level tensors
        import transformers.optimization  # noqa: F401
    L = model_depth(cfg)
    gpu = VirtualGPU(capacity_gb=2**20)
    cfg_json = cfg.to_json_string(use_diff=False)

    def run(k, layers=None, allocator=True):
        # the allocator's replay (a tenth of a run) only for the run whose overhead is kept
        sk, info = _skeleton(cfg_json, cut_layers(cfg, k), rp.method, precision_dtype(rp.precision), rp.lora_r,
                             rp.attention, layers)
        r = gpu.run(fit_step, sk, info, rp, timeline=allocator)
        return ({ph: dict(v) for ph, v in r.phase_peaks.items()}, r.value,
                allocator_bytes(r.tracker) if allocator else None)
    from .layers import combine, kind_runs, layer_kinds
    kinds = layer_kinds(cfg, L) if L > BASE + 1 else None
    if kinds is not None:                      # layers of several kinds: memlab/fitting/layers.py
        base_idx, kind_idx, counts = kind_runs(kinds)
        base = run(max(base_idx) + 1, base_idx)
        more = {k: run(max(idx) + 1, idx) for k, idx in kind_idx.items()}
        phases = {ph: combine(base[0][ph], {k: m[0][ph] for k, m in more.items()}, counts)
                  for ph in base[0] if all(ph in m[0] for m in more.values())}
        info = combine(base[1], {k: m[1] for k, m in more.items()}, counts)
        last = more[max(more, key=lambda k: max(d["total"] for d in more[k][0].values()))] if more else base
        out = {"phases": phases, "info": info, "allocator": last[2]}
        out["info"]["layer_kinds"] = kinds
        out["info"].update(_shape(cfg, L))
        _CACHE[key] = out
        _disk_write(key, out)
        return out
    runs = [run(BASE, allocator=False), run(BASE + 1)] if L > BASE else [run(L)]
    if len(runs) == 1:
        out = {"phases": runs[0][0], "info": runs[0][1], "allocator": runs[0][2]}
    else:
        (p1, i1, a1), (p2, i2, a2) = runs
        phases = {ph: _extend(p1[ph], p2[ph], L - BASE + 1) for ph in p1 if ph in p2}
        # per-layer constants (one layer's bytes, the embedding's) come out unchanged: b - a = 0
        n = L - BASE
        info = {k: (_extend(i1[k], i2[k], n + 1) if isinstance(i1[k], dict) else i1[k] + n * (i2[k] - i1[k])
                    if isinstance(i1[k], (int, float)) else i1[k]) for k in i1}
        out = {"phases": phases, "info": info, "allocator": a2}
    out["info"].update(_shape(cfg, L))
    _CACHE[key] = out
    _disk_write(key, out)
    return out


def _shape(cfg, depth: int) -> dict:
    """What `plan_cost` needs of the config, kept with the run: the depth and the attention's width (heads x
    head_dim)."""
    H = getattr(cfg, "num_attention_heads", None) or 1
    hd = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", H) // H
    return {"depth": depth, "attn_width": H * hd}


def shard_phases(phases: dict, info: dict, plan, bucket_elems: int | None = None) -> dict:
    """Per-rank bytes of each phase under ZeRO stage `plan.zero` on `plan.gpus` ranks and with optimizer
    offload, from a single-GPU run (Rajbhandari et al. 2020, section 5; DeepSpeed's implementation):

      stage >= 1   optimizer state (incl. fp32 masters) and the step's scratch -> ceil(x / N); plus one
                   reduce bucket of the gradients' dtype in backward and step: DeepSpeed's default
                   reduce_bucket_size (5e8 elements, memlab.sharding.zero_scale.DEEPSPEED_REDUCE_BUCKET), capped at
                   the trainable parameter count (an assumption: a bucket is never larger than all grads)
      stage >= 2   gradients -> ceil(x / N)
      stage 3      parameters -> ceil(x / N) plus the largest module gathered at a time (one decoder layer
                   or the biggest single tensor, e.g. the embedding), and in backward its gradients
      offload      ZeRO-Offload (Ren et al. 2021; DeepSpeed's cpu offload_optimizer): the optimizer state, the
                   fp32 masters and the step run on the CPU, and each gradient leaves the GPU through the reduce
                   bucket into the CPU's fp32 partition. The GPU keeps the 16-bit weights (its partition with
                   stage 3) and the bucket: optimizer, step scratch and gradients -> 0, plus the bucket in
                   backward and step. (DeepSpeed's estimator: 2 bytes per parameter on the GPU; lesson 06
                   measures it.)
    The activations are untouched, and the moment of each phase's peak is taken to be unchanged."""
    from ..sharding.zero_scale import DEEPSPEED_REDUCE_BUCKET
    N, s = plan.gpus, plan.zero
    if plan.mode != "train" or (s == 0 and not plan.offload):
        return {ph: dict(d) for ph, d in phases.items()}
    part = lambda x: -(-x // N)   # noqa: E731
    gb = info.get("grad_elem_bytes", 2)
    bucket = min(DEEPSPEED_REDUCE_BUCKET if bucket_elems is None else bucket_elems, info["trainable"]) * gb
    out = {}
    for ph, d in phases.items():
        d = dict(d)
        in_bucket = bucket if ph in ("backward", "step") else 0
        if plan.offload:
            d["optimizer"] = 0
            d["gradients"] = in_bucket
            if ph == "step":
                d["temporaries"] = 0
        else:
            d["optimizer"] = part(d["optimizer"])
            if ph == "step":
                d["temporaries"] = part(d["temporaries"])
            d["gradients"] = (part(d["gradients"]) if s >= 2 else d["gradients"]) + in_bucket
        if s == 3:
            d["parameters"] = part(d["parameters"]) + (info["gather_bytes"] if ph in ("forward", "backward") else 0)
            if ph == "backward" and not plan.offload:
                d["gradients"] += info["gather_grad_bytes"]
        d["total"] = sum(d[c] for c in CATEGORIES)
        out[ph] = d
    return out


def plan_cost(plan, info: dict) -> dict:
    """The extra work a plan does per optimizer step, beside a plain step:

      recompute_flops  forward FLOPs recomputed in the backward: checkpointing "full" recomputes every
                       decoder layer, 2 * layer_params * tokens (matmuls) + 4 * tokens * seq * heads * head_dim
                       (QK^T and attention x V, counted without the causal half), times layers;
                       "selective" recomputes the attention core, the second term only (norms and elementwise
                       ops are not counted). tokens = batch * seq per optimizer step.
      offload_bytes    bytes over PCIe per step: this rank's partition of the gradients to the CPU in fp32 (DeepSpeed
                       casts them before the copy: 4 bytes per trainable parameter) and of the updated weights back
                       in the weights' dtype (2 bytes in 16-bit), the 4 + 2 bytes per parameter lesson 06 measures;
                       with activation offloading also every offloaded activation, out and back, per micro-batch
      attention_flops  the forward's attention matmuls (QK^T and attention x V) of the step, as recompute_flops
                       counts them (the causal half not taken off): for a step-time bound (memlab.fitting.published)
      host_step_bytes  with optimizer offload: the bytes the CPU's AdamW step reads and writes in host memory for this
                       rank's partition (DeepSpeed's CPU Adam on fp32 masters): the fp32 gradient, master and two
                       moments read (16 B/param), master and moments written back (12 B/param) and the 16-bit copy
                       of the updated weight written for the GPU (2 B/param), 30 B per trainable parameter; a step
                       cannot take less than these bytes over the host's memory bandwidth
      comm_bytes       bytes each rank sends, ring collectives ((N - 1) / N of the volume): ZeRO 0-2 reduce
                       the gradients (reduce-scatter + all-gather = 2 x gradient bytes, the ZeRO paper's
                       2 Psi, section 7); ZeRO-3 adds a weight all-gather in the forward and one in the backward
                       (gradient bytes + 2 x weight bytes, the paper's 3 Psi for full fine-tuning); 0 on 1 GPU
      dequant_bytes    QLoRA: the 4-bit base is dequantized before each use of a weight (bitsandbytes' matmul_4bit
                       dequantizes to the 16-bit compute dtype, then multiplies): the kernel reads 0.5 byte per
                       weight (plus its share of the absmax) and writes 2, memory traffic a 16-bit base does not
                       have. Uses per micro-batch: the forward, the backward's input gradient, and the recomputed
                       forward with checkpointing "full": 2.5 bytes x quantized weights (layer_params x layers)
                       x uses x micro-batches, in the card's DRAM
      steps_per_batch  micro-batches per optimizer step
    """
    if plan.mode != "train":
        return {"recompute_flops": 0, "offload_bytes": 0, "comm_bytes": 0, "dequant_bytes": 0, "host_step_bytes": 0,
                "attention_flops": 0, "steps_per_batch": 1}
    L, tokens = info["depth"], plan.batch * plan.seq
    attn = 4 * tokens * plan.seq * info["attn_width"]
    stack = info.get("stack_params", info["layer_params"] * L)        # every repeated layer's parameters
    flops = {"none": 0, "selective": L * attn, "full": 2 * stack * tokens + L * attn}
    N = plan.gpus
    grads = info["trainable_bytes"]
    offload = (4 * -(-info["trainable"] // N) + -(-grads // N)) if plan.offload else 0
    ring = (N - 1) / N
    comm = 0 if N == 1 else int(ring * (2 * grads if plan.zero < 3 else grads + 2 * info["weight_bytes"]))
    if getattr(plan, "activation_offload", False):    # measured over min(2, steps_per_batch) micro-batches
        offload += 2 * info.get("offloaded_bytes", 0) * plan.steps_per_batch // min(2, plan.steps_per_batch)
    uses = 2 + (plan.checkpointing == "full")
    dequant = int(2.5 * stack * uses * plan.steps_per_batch) if plan.method == "qlora" else 0
    host = HOST_STEP_BYTES_PER_PARAM * -(-info["trainable"] // N) if plan.offload else 0
    return {"recompute_flops": int(flops[plan.checkpointing]), "offload_bytes": offload, "comm_bytes": comm,
            "dequant_bytes": dequant, "host_step_bytes": host, "attention_flops": int(L * attn),
            "steps_per_batch": plan.steps_per_batch}


HOST_STEP_BYTES_PER_PARAM = 16 + 12 + 2   # read: fp32 grad, master, 2 moments; write: master, moments; 16-bit copy
