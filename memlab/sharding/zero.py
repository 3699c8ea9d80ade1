"""ZeRO by the numbers: communication volumes, DeepSpeed's buffers by role, host-link bytes,
and a tracker that counts FSDP2's shards (DTensors) by their local bytes.

Notation (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", Sec. 3 and 7): Psi parameters, N data-parallel ranks, mixed-precision
Adam with K = 12 bytes/param of optimizer state (fp32 master weights, momentum, variance),
2-byte weights and 2-byte gradients. Per-rank model-state bytes are
`memlab.core.estimate.zero_model_state_bytes`; this module adds what that formula leaves out.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.track import _LIFT_FRESH, _T, MemoryTracker, _storages, active_trackers
from ..core.validate import one_of, pos_int

__all__ = ["comm_volume", "deepspeed_buffers", "label_deepspeed", "follow_storage_resizes", "HostLinkCounter",
           "local_tensor", "label", "ShardAwareTracker"]

STAGES = (0, 1, 2, 3)


def comm_volume(n_params: int, stage: int, bytes_per_element: int = 2, world_size: int | None = None) -> dict:
    """Bytes each rank moves per training step, by collective (Rajbhandari et al. 2020, Sec. 7).

    Data parallel (stage 0) all-reduces the gradients: a reduce-scatter plus an all-gather,
    Psi elements each, 2 Psi in all. ZeRO-1 and ZeRO-2 reduce-scatter the gradients (Psi) and
    all-gather the updated parameters (Psi): 2 Psi, the same. ZeRO-3 all-gathers the parameters
    in the forward (Psi) and again in the backward (Psi) and reduce-scatters the gradients (Psi):
    3 Psi, 1.5x data parallel. `world_size` given: multiply by (N-1)/N, the share a rank sends with
    ring algorithms (`memlab.sharding.ring_bytes_sent`); None: the paper's volume.
    """
    pos_int("n_params", n_params)
    one_of("stage", stage, STAGES)
    pos_int("bytes_per_element", bytes_per_element)
    if world_size is not None:
        pos_int("world_size", world_size)
    s = n_params * bytes_per_element
    out = ({"reduce_scatter": s, "all_gather": s} if stage < 3 else {"reduce_scatter": s, "all_gather": 2 * s})
    f = 1.0 if world_size is None else (world_size - 1) / world_size
    out = {k: v * f for k, v in out.items()}
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------- DeepSpeed's buffers
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a DTensor (FSDP2's sharded parameters); `t` itself otherwise."""
    return getattr(t, "_local_tensor", t)


def label(tensors, category: str):
    """Give `tensors` a category in every active tracker; a DTensor by its local shard."""
    from ..core.track import watch
    watch(tensors=[local_tensor(t) for t in tensors], category=category)


class ShardAwareTracker(MemoryTracker):
    """memlab's MemoryTracker, counting a DTensor (FSDP2's shards) by its local shard.

    A dispatch mode sees a DTensor op's output as the DTensor; its local shard is allocated
    inside DTensor's own dispatch, out of the mode's sight, and the DTensor's storage reports
    the *global* size. This tracker counts the local shard instead (same rules as
    MemoryTracker otherwise), so a rank's bytes are its own shard's bytes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            t = local_tensor(t)
            if t.device.type != self._device_type:
                continue
            for st in _storages(t):
                if st._cdata not in self._blocks and func is not _LIFT_FRESH:
                    if inputs is None:            # a view or in-place result of an older tensor is not new memory
                        inputs = {s._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                                  for s in _storages(local_tensor(a))}
                    if st._cdata in inputs:
                        continue
                self._add(st, _T)
        return out


# name -> role, first match wins: fp32 copies are optimizer state (K counts the master weights),
# anything named for gradients or the reduction buckets holds gradients, the 16-bit groups are parameters
_ROLES = ((re.compile(r"fp32"), "optimizer"), (re.compile(r"grad|ipg"), "gradients"),
          (re.compile(r"bit16|fp16|bf16|param"), "parameters"))


def _role(name: str) -> str:
    for pat, role in _ROLES:
        if pat.search(name):
            return role
    return "temporaries"


def deepspeed_buffers(zero_optimizer, device: str = "cpu") -> dict[str, dict]:
    """Every tensor a DeepSpeed ZeRO optimizer object holds, by attribute name:
    {name: {"bytes": ..., "role": ..., "tensors": [...]}}.

    Walks the optimizer's attributes (lists, dicts, and DeepSpeed's own objects such as
    the reduction buckets, a few levels deep), counts each storage once (a parameter that is
    a view into a flat buffer is counted with the buffer), skips "meta" tensors (shape
    bookkeeping without memory) and the wrapped torch optimizer (its state is the optimizer
    category already). `role` is guessed from the name: fp32 -> optimizer (master weights),
    grad/ipg -> gradients, bit16/fp16/param -> parameters, else temporaries.
    """
    if not hasattr(zero_optimizer, "__dict__"):
        raise TypeError(f"zero_optimizer must be a DeepSpeed optimizer object, got {type(zero_optimizer).__name__}")
    out: dict[str, dict] = {}
    seen_st, seen_obj = set(), {id(zero_optimizer)}

    def visit(name, v, depth):
        if isinstance(v, torch.Tensor):
            v = local_tensor(v)
            if v.device.type != device:
                return
            try:
                st = v.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return
            if st._cdata in seen_st or st.nbytes() == 0:
                return
            seen_st.add(st._cdata)
            entry = out.setdefault(name, {"bytes": 0, "role": _role(name), "tensors": []})
            entry["bytes"] += st.nbytes()
            entry["tensors"].append(v)
        elif depth > 5:
            return
        elif isinstance(v, (list, tuple, set)):
            for x in v:
                visit(name, x, depth + 1)
        elif isinstance(v, dict):
            for x in v.values():
                visit(name, x, depth + 1)
        elif type(v).__module__.startswith("deepspeed") and hasattr(v, "__dict__") and id(v) not in seen_obj:
            seen_obj.add(id(v))
            for k, x in vars(v).items():
                visit(f"{name}.{k}", x, depth + 1)

    for k, v in vars(zero_optimizer).items():
        if k != "optimizer" and not isinstance(v, torch.nn.Module):
            visit(k, v, 0)
    return out


def label_deepspeed(engine, hooks: bool = False) -> dict[str, dict]:
    """Tell every active memlab tracker what DeepSpeed's tensors are: the module's parameters,
    the wrapped torch optimizer's state, and DeepSpeed's flat buffers by `deepspeed_buffers`'
    roles. hooks=True (once per engine) also registers the module and optimizer with the
    trackers, so gradients are labelled the moment they appear. Returns {name: {"bytes", "role"}}."""
    from ..core.track import watch
    inner = getattr(engine.optimizer, "optimizer", None)
    inner = inner if isinstance(inner, torch.optim.Optimizer) else None
    if hooks:
        watch(engine.module, inner)
    device = next((p.device.type for p in engine.module.parameters()), "cpu")
    bufs = deepspeed_buffers(engine.optimizer, device)
    for b in bufs.values():
        label(b["tensors"], b["role"])
    label(list(engine.module.parameters()), "parameters")
    if inner is not None:                                # state made by a step that ran outside any tracker
        label([v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)], "optimizer")
    return {k: {"bytes": v["bytes"], "role": v["role"]} for k, v in bufs.items()}


# ----------------------------------------------------------------------------- storage resizes
@contextlib.contextmanager
def follow_storage_resizes():
    """Let memlab's trackers see `storage.resize_()`.

    FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes and re-allocates it by
    resizing it back, outside PyTorch's dispatcher, where a TorchDispatchMode cannot see it.
    Inside this context every resize updates the active trackers' count of that storage."""
    original = torch.UntypedStorage.resize_

    def resize_(self, size):
        out = original(self, size)
        for tr in active_trackers():
            blk = tr._blocks.get(self._cdata)
            if blk is not None:
                n = tr._bytes(self)
                if n != blk.nbytes:
                    tr._grow(blk, n - blk.nbytes)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


# ----------------------------------------------------------------------------- host link
class HostLinkCounter(TorchDispatchMode):
    """Bytes copied between device memory and host memory (PCIe on a GPU machine).

    A copy crosses the link when its source and destination are on different devices, or,
    on a machine where "device" and "host" are the same CPU, when exactly one of them is one
    of `host_tensors` (the buffers an offloading optimizer keeps on the host). The bytes are the
    source's: what is read on one side and written on the other. `to_host`, `to_device` in bytes.
    """

    def __init__(self, host_tensors=()):
        super().__init__()
        self._host = set()
        for t in host_tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"host_tensors must contain tensors, got {type(t).__name__}")
            self._host.add(local_tensor(t).untyped_storage()._cdata)
        self.to_host = 0
        self.to_device = 0

    def _in_host_set(self, t):
        return t.untyped_storage()._cdata in self._host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
                if src.device != dst.device:                  # a real device <-> host copy
                    if dst.device.type == "cpu":
                        self.to_host += src.nbytes
                    elif src.device.type == "cpu":
                        self.to_device += src.nbytes
                elif self._host:                              # one machine plays both sides
                    d_host, s_host = self._in_host_set(dst), self._in_host_set(src)
                    if d_host and not s_host:
                        self.to_host += src.nbytes
                    elif s_host and not d_host:
                        self.to_device += src.nbytes
        return func(*args, **(kwargs or {}))
