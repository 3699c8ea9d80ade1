"""Exercise 06's rank harness: N gloo ranks forked from the current process.

The learner's classes live in the notebook's (or the grading harness's) IPython namespace, which a
fresh interpreter cannot import, so `memlab.dist.RankGroup` (forkserver) cannot run them. A forked
child inherits them: `run_ranks(world, fn)` forks `world` children, each joins one gloo process group
through a FileStore in a temporary folder (loopback only: it works inside the grading sandbox, which has
no network but its own loopback), calls `fn(rank, world)` and sends back what it returns (plain data).
A rank that raises is reported with its traceback; ranks that do not finish within `timeout` seconds
are killed, and so is every rank when this process is interrupted (the grader's time limit).
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback


class RanksFailed(RuntimeError):
    """A rank raised, died or did not finish in time; the message carries its traceback."""


def _child(rank, world, store_path, conn, fn, collective_timeout):
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)       # a notebook kernel's streams are not fork-safe
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.stdout = sys.stderr = open(os.devnull, "w")
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        try:
            value = fn(rank, world)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:                             # noqa: BLE001
                pass
        conn.send(("ok", rank, value))
    except BaseException as e:                            # noqa: BLE001 - everything goes back to the parent
        try:
            conn.send(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-6)}"))
        except Exception:                                 # noqa: BLE001
            pass
    finally:
        os._exit(0)


_WARM = []


def warm_up():
    """One tiny AdamW and SGD step in this process, once: their first step imports torch._dynamo (seconds),
    which forked ranks then inherit instead of each importing it again."""
    if not _WARM:
        import torch
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.ones(2)
        for cls, kw in ((torch.optim.AdamW, {}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
            cls([p], **kw).step()
        _WARM.append(True)


def run_ranks(world: int, fn, timeout: float = 60.0, collective_timeout: float = 20.0) -> list:
    """fn(rank, world) on `world` forked gloo ranks; the values, rank 0 first (RanksFailed on any failure)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    warm_up()
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="ex06-ranks-")
    procs, conns = [], []
    try:
        for r in range(world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(r, world, os.path.join(tmp, "store"), child, fn,
                                                 collective_timeout), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        results, errors = {}, {}
        pending = dict(enumerate(conns))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending.values()), timeout=left) if left > 0 else []
            if not ready:
                raise RanksFailed(f"rank(s) {sorted(pending)} did not finish within {timeout:g} s: a rank waiting "
                                  f"in a collective that another rank never calls (a broadcast from a different "
                                  f"source, a reduce only some ranks reach) hangs like this")
            for c in ready:
                r = next(k for k, v in pending.items() if v is c)
                del pending[r]
                try:
                    status, rank, payload = c.recv()
                except (EOFError, OSError):
                    errors[r] = f"rank {r} died without reporting (exit code {procs[r].exitcode})"
                    continue
                (results if status == "ok" else errors)[rank] = payload
            if errors:
                break
        if errors:
            collective = lambda r: "gloo" in errors[r] or "Connection" in errors[r]   # noqa: E731
            r = min(errors, key=lambda r: (collective(r), r))        # the cause before its echoes on other ranks
            if errors[r].startswith("NotImplementedError"):
                raise NotImplementedError(f"rank {r}: {errors[r].splitlines()[0]}")
            hint = ""
            if collective(r):
                hint = ("\nHint: a collective failed because another rank left it or never called it: every rank must "
                        "call the same collectives in the same order (the same loop over the same parameters), "
                        "with the same source or destination rank.\n")
            raise RanksFailed(f"rank {r} of {world} raised {errors[r].splitlines()[0]}{hint}\n"
                              + "\n".join(errors[r].splitlines()[1:]))
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.join(5)
        for c in conns:
            c.close()
        shutil.rmtree(tmp, ignore_errors=True)
