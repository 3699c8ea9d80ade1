"""memlab.sharding.comm: count the bytes of every collective a process issues.

`CommCounter` is a `TorchDispatchMode`: eager calls (`dist.all_reduce`, ...) reach the
dispatcher as `c10d.*` ops and functional collectives as `_c10d_functional.*` ops, so it
sees what DeepSpeed, FSDP2 and DDP send, whatever Python function they call. Bytes on the
wire follow the ring algorithms' accounting (`ring_bytes_sent`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.validate import is_int, pos_int

__all__ = ["CommCounter", "ring_bytes_sent"]


# payload of one call, from the dispatcher op's arguments:
#   all_reduce / broadcast / reduce: the tensor;  all_gather: the gathered output (N x the input);
#   reduce_scatter: the input being reduced (N x the output). Every one of them is "S" below.
_PAYLOAD_ARG = {"allreduce": 0, "allreduce_coalesced": 0, "broadcast": 0, "reduce": 0,
                "allgather": 0, "allgather_into_tensor_coalesced": 0, "_allgather_base": 0,
                "reduce_scatter": 1, "_reduce_scatter_base": 1, "reduce_scatter_tensor_coalesced": 1,
                "alltoall": 1, "alltoall_base": 1, "send": 0, "recv": 0, "gather": 1, "scatter": 1}
_NAMES = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "_allgather_base": "all_gather",
          "allgather": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
          "all_gather_into_tensor": "all_gather",
          "all_gather_into_tensor_coalesced": "all_gather", "_reduce_scatter_base": "reduce_scatter",
          "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
          "all_reduce_coalesced": "all_reduce", "alltoall_base": "all_to_all", "alltoall": "all_to_all",
          "all_to_all_single": "all_to_all"}
_SKIP = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}


def ring_bytes_sent(collective: str, payload: int, world_size: int) -> float:
    """Bytes one rank sends for a collective over `payload` bytes with ring algorithms
    (Patarasuk & Yuan 2009; the accounting of Rajbhandari et al. 2020, Sec. 7):
    reduce-scatter and all-gather each send (N-1)/N x S, an all-reduce is the two of them,
    2 (N-1)/N x S; a pipelined broadcast forwards S from all but the last rank: (N-1)/N x S.
    Point to point: a send sends its payload, a recv sends nothing."""
    pos_int("payload", payload, zero_ok=True, what="a number of bytes >= 0")
    pos_int("world_size", world_size)
    if collective in ("send", "recv"):
        return float(payload) if collective == "send" else 0.0
    factor = {"all_reduce": 2}.get(collective, 1)
    return factor * (world_size - 1) / world_size * payload


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _group_size(args) -> int:
    """The size of the process group a c10d op was called on: at the dispatcher the group arrives as a
    torch.ScriptObject, which ProcessGroup.unbox turns back into the group (a subgroup's size, not the world's)."""
    import torch.distributed as dist
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return int(dist.ProcessGroup.unbox(a).size())
            except Exception:                             # noqa: BLE001 - a ScriptObject that is not a group
                continue
        if isinstance(a, dist.ProcessGroup):
            return int(a.size())
    return dist.get_world_size() if dist.is_initialized() else 1


class CommCounter(TorchDispatchMode):
    """Count the collectives issued inside `with CommCounter() as comm:` on this rank.

    `comm.counts` maps a collective ("all_reduce", "all_gather", "reduce_scatter",
    "broadcast", ...) to {"calls", "bytes", "sent"}: bytes is the payload S (the reduced
    tensor, the gathered output, the scattered input), sent is the bytes this rank
    sends over the wire with ring algorithms (`ring_bytes_sent`). `comm.total("bytes")`
    sums a field. Only this process's own collectives are seen.
    """

    def __init__(self):
        super().__init__()
        self.counts: dict[str, dict[str, int]] = {}
        self.log: list[tuple[str, int]] = []      # (collective, payload bytes) of every call, in order

    def _count(self, name: str, payload: int, world: int):
        self.log.append((name, payload))
        c = self.counts.setdefault(name, {"calls": 0, "bytes": 0, "sent": 0})
        c["calls"] += 1
        c["bytes"] += payload
        c["sent"] += round(ring_bytes_sent(name, payload, world))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            op = func._opname.rstrip("_")
            if op not in _SKIP and func._opname not in _SKIP:
                name = _NAMES.get(op, op)
                if ns == "c10d":
                    idx = _PAYLOAD_ARG.get(op, 0)
                    payload = sum(t.nbytes for t in _tensors(args[idx])) if len(args) > idx else 0
                    self._count(name, payload, _group_size(args))
                else:                                     # functional: (input(s), ..., group_size?, group_name)
                    payload = sum(t.nbytes for t in _tensors(args[0]))
                    world = next((a for a in args[1:] if is_int(a)), None)
                    if name == "all_gather" and world:
                        payload *= world                  # the gathered output is N x the input
                    self._count(name, payload, world or _group_size(()))
        return func(*args, **(kwargs or {}))

    def total(self, key: str = "bytes") -> int:
        if key not in ("calls", "bytes", "sent"):
            raise ValueError(f"key must be 'calls', 'bytes' or 'sent', got {key!r}")
        return sum(c[key] for c in self.counts.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.counts.items()}
