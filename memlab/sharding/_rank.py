"""What runs inside a rank process of `memlab.sharding.RankGroup` (kept apart from the parent's side).

A rank: leads its own process group (so the parent's `os.killpg` also takes what it starts),
asks Linux to kill it when its parent dies, sends its output to its log file, joins the
torch.distributed process group, then runs the jobs it receives on its pipe until told to stop.
Every answer is plain data: ("ready" | "ok" | "error", rank, payload).
"""

from __future__ import annotations

import gc
import os
import pickle
import time
import traceback

import torch

from .comm import CommCounter


def _die_with_parent():
    try:                                                  # Linux: SIGKILL this process when its parent dies
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG = 1
    except Exception:                                     # noqa: BLE001 - not Linux: the EOF on the pipe ends it
        pass


def _call_tracked(fn, args, kwargs, device):
    from ..core.track import MemoryTracker
    tracker = MemoryTracker(device=device, timeline=False)
    comm = CommCounter()
    t0 = time.perf_counter()
    with tracker, comm:
        value = fn(*args, **kwargs)
    return {"value": value, "peak": tracker.peak, "peak_breakdown": tracker.peak_breakdown,
            "end_breakdown": tracker.breakdown(), "phase_peaks": tracker.phase_peaks,
            "comm": comm.as_dict(), "seconds": time.perf_counter() - t0}


def _rank_main(rank, world_size, backend, conn, env, threads, log_path, preload=()):
    os.setsid()                                           # its own process group: killpg takes its children too
    _die_with_parent()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)                                        # prints and library logging go to the rank's log
    os.environ.update(env)
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        import importlib
        for m in preload:                                 # already imported if the fork server preloaded it
            importlib.import_module(m)
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = "cuda"
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        gc.freeze()                                       # the imported modules' objects: no garbage collector passes
        conn.send(("ready", rank, None))
    except BaseException as e:                            # noqa: BLE001 - report anything to the parent
        conn.send(("error", rank, (f"{type(e).__name__}: {e}", traceback.format_exc())))
        return
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            break
        except Exception as e:                            # noqa: BLE001 - the function could not be imported here
            conn.send(("error", rank, (f"could not load the task ({type(e).__name__}: {e})", traceback.format_exc())))
            continue
        if task is None:
            break
        fn, args, kwargs, tracked = task
        try:
            out = _call_tracked(fn, args, kwargs, device) if tracked else fn(*args, **kwargs)
        except BaseException as e:                        # noqa: BLE001 - report anything to the parent
            conn.send(("error", rank, (f"{type(e).__name__}: {e}", traceback.format_exc())))
            continue
        try:
            data = pickle.dumps(("ok", rank, out))
        except Exception as e:                            # noqa: BLE001
            conn.send(("error", rank, (f"its return value does not pickle ({type(e).__name__}: {e}); return "
                                       f"plain data (numbers, strings, lists, dicts)", "")))
            continue
        conn.send_bytes(data)
    try:
        dist.destroy_process_group()
    except Exception:                                     # noqa: BLE001
        pass
