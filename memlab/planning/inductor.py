"""What TorchInductor's generated code allocates, and the real allocation peak of a call.

`torch.compile` (TorchInductor) writes a Python "wrapper" that allocates every intermediate buffer explicitly
(`buf0 = empty_strided_cpu(...)`), deletes it after its last use (`del buf0`), and reuses buffers:

  * by default (`torch._inductor.config.allow_buffer_reuse`), a freed buffer is handed to a later one with the
    same device, dtype and storage size (`buffer_reuse_key` in torch/_inductor/codegen/wrapper.py), and a kernel
    may write its output into a dead input (`inplace_buffers`): the line reads `buf3 = buf2; del buf2  # reuse`;
  * with `torch._inductor.config.memory_planning = True` (off by default, inference graphs only: "We disable
    planning during training because it presently increases peak memory consumption", wrapper.py), the
    intermediates get offsets in one pool, placed largest first (`MemoryPlanner.allocate_groups` in
    torch/_inductor/codegen/memory_planning.py): `pool1 = empty_strided_cpu((nbytes,), (1,), torch.uint8)` and
    `buf0 = alloc_from_pool(pool1, offset, ...)`: a static plan like TFLite's arena.

`inductor_code(fn, *args)` compiles fn and returns the generated source; `wrapper_buffers(code)` reads its
`call` function and replays the allocations, frees and reuses it performs, returning what it allocates and the
most bytes of its own buffers alive at once. memlab's tracker cannot see inside compiled code (it is a dispatch
mode: under it Dynamo does not run the compiled graph, and compiled kernels allocate below the dispatcher), so
`memlab.planning.layout.profiled_allocations` measures a compiled call with PyTorch's profiler instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..core.validate import flag

__all__ = ["WrapperBuffers", "wrapper_buffers", "inductor_code"]

_ALLOC = re.compile(r"^(\w+) = empty_strided_\w+\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")
_ALIAS = re.compile(r"^(\w+) = (?:reinterpret_tensor\()?(\w+)[,;)\s]")
_FROM_POOL = re.compile(r"^(\w+) = alloc_from_pool\((\w+),")
_DEL = re.compile(r"^del (.+)$")


@dataclass
class WrapperBuffers:
    """What one generated `call` function does with memory: `allocations` (fresh empty_strided buffers, pools
    included), `reuses` (lines marked "# reuse": a buffer taking over a dead one's storage), `pools` (bytes of
    each pool of a memory-planned graph), `allocated` (bytes of all fresh allocations) and `peak` (the most bytes
    of these allocations alive at once; the graph's inputs, such as parameters, are not counted)."""
    allocations: int
    reuses: int
    allocated: int
    peak: int
    pools: list[int] = field(default_factory=list)


def _numbers(text: str) -> list[int]:
    return [int(v) for v in text.replace(" ", "").split(",") if v]


def wrapper_buffers(code: str) -> WrapperBuffers:
    """Replay the `def call(...)` body of Inductor-generated code (see the module docstring). ValueError if the
    code has no such function or a buffer's shape is symbolic (compile with static shapes)."""
    if not isinstance(code, str):
        raise TypeError(f"code must be the generated source (a str), got {type(code).__name__}")
    if "def call(" not in code:
        raise ValueError("code must be Inductor's generated wrapper (it has no `def call(` function)")
    body = code.split("def call(", 1)[1]
    storage_of: dict[str, int] = {}                   # buffer name -> storage id
    size: dict[int, int] = {}                         # live storage id -> bytes
    names: dict[int, set] = {}                        # storage id -> live names
    allocations = reuses = allocated = live = peak = 0
    pools: list[int] = []
    for raw in body.splitlines():
        line = raw.strip()
        if line.startswith(("def ", "class ", "runner = ")) and raw[:1] not in (" ", "\t"):
            break                                     # the end of `call`
        if line.startswith("return "):
            break
        m = _ALLOC.match(line)
        if m:
            name, shape, stride, dtype = m.groups()
            try:
                dims, strides = _numbers(shape), _numbers(stride)
            except ValueError:
                raise ValueError(f"buffer {name} has a symbolic shape ({shape}): compile with dynamic=False") \
                    from None
            numel = 0 if 0 in dims else 1 + sum((d - 1) * s for d, s in zip(dims, strides))
            nbytes = numel * getattr(torch, dtype).itemsize
            sid = allocations = allocations + 1
            storage_of[name], size[sid], names[sid] = sid, nbytes, {name}
            allocated += nbytes
            live += nbytes
            peak = max(peak, live)
            if name.startswith("pool"):
                pools.append(nbytes)
            continue
        if "# reuse" in line:
            reuses += 1
        code_part = line.split("#")[0].strip()
        for stmt in filter(None, (s.strip() for s in code_part.split(";"))):
            a = _FROM_POOL.match(stmt) or _ALIAS.match(stmt + " ")
            if a and a.group(2) in storage_of:
                sid = storage_of[a.group(2)]
                storage_of[a.group(1)] = sid
                names[sid].add(a.group(1))
                continue
            d = _DEL.match(stmt)
            if d:
                for nm in (v.strip() for v in d.group(1).split(",")):
                    sid = storage_of.pop(nm, None)
                    if sid is None:
                        continue
                    names[sid].discard(nm)
                    if not names[sid]:
                        live -= size.pop(sid)
    return WrapperBuffers(allocations, reuses, allocated, peak, pools)


def inductor_code(fn, *args, memory_planning: bool = False, **kwargs) -> list[str]:
    """Compile `fn` with torch.compile (Inductor, static shapes; Dynamo's caches reset first), run it once on
    args and return the source of every graph it generated (a training step gives a forward and a backward).
    memory_planning=True turns on Inductor's pooled static plan (inference graphs only)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    flag("memory_planning", memory_planning)
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    with config.patch(memory_planning=memory_planning):
        _, codes = run_and_get_code(torch.compile(fn, dynamic=False), *args, **kwargs)
    torch._dynamo.reset()
    return list(codes)
