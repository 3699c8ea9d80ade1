"""What exercise 06's notebook takes from the kit: `run_ranks` (N gloo ranks forked from the kernel) and
`show_ranks` (what every rank of a sharded optimizer holds), with the small model, its data and the per-rank
driver they run. The checks of exercise 06 run the learner's optimizer with the same pieces.

`run_ranks(world, fn)`: the learner's classes live in the notebook's (or the grading harness's) IPython
namespace, which a fresh interpreter cannot import, so `memlab.sharding.RankGroup` (forkserver) cannot run them. A
forked child inherits them: `run_ranks` forks `world` children, each joins one gloo process group through a
FileStore in a temporary folder (loopback only: it works inside the grading sandbox, which has no network but
its own loopback), calls `fn(rank, world)` and sends back what it returns (plain data). A rank that raises is
reported with its traceback; ranks that do not finish within `timeout` seconds are killed, and so is every rank
when this process is interrupted (the grader's time limit).

The model (`Net`) is built from a case (plain data) the same way on every rank and in a one-process run:
widths that are not powers of two, an optional frozen bias (requires_grad False), an optional module the
forward never uses (its gradients stay None), and an optional weight shared by two modules (listed twice in
the parameter list handed to the optimizer), optional float64 layers among the float32 ones
(`float64_layers`: a model whose bytes and element counts rank its tensors differently), and an optional
learning-rate scheduler (`scheduler`) stepped after
every optimizer step. `rank_fn(case, cls)` is one rank's run: build the model, step
`cls` a few times on this rank's data, and bring back plain data (final parameters, the bytes of optimizer
state it holds and for which parameters, the gradients it holds, the bytes of each collective of `step()`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

import torch
from torch import nn

from ..sharding.comm import CommCounter


# ----------------------------------------------------------------------------- N ranks forked from this process
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
            if errors[r].startswith("AssertionError: "):      # a check's teaching message, raised inside a rank
                raise AssertionError(f"rank {r} of {world}: {errors[r].split(chr(10))[0][len('AssertionError: '):]}")
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


# ----------------------------------------------------------------------------- the model and its data
class Net(nn.Module):
    def __init__(self, case):
        super().__init__()
        w = case["widths"]                                       # [d_in, h1, ..., h_last]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(w[:-1], w[1:]))
        h = w[-1]
        self.enc, self.dec = nn.Linear(h, h), nn.Linear(h, h)
        if case["shared"]:
            self.dec.weight = self.enc.weight                    # one tensor, two modules
        self.head = nn.Linear(h, case["d_out"])
        self.extra = nn.Linear(3, 5) if case["unused"] else None   # never called: its .grad stays None
        g = torch.Generator().manual_seed(case["seed"])
        with torch.no_grad():
            for p in self.parameters():                          # deterministic, whatever the global RNG
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
        for i in case.get("float64_layers", ()):                 # some cases: 8 bytes an element, not 4
            self.layers[i].double()
        if case["frozen"]:
            self.layers[0].bias.requires_grad_(False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype)))      # a float64 layer computes in float64
        x = x.float()
        x = torch.tanh(self.dec(torch.tanh(self.enc(x))))
        return self.head(x)

    def listed_params(self):
        """Module by module, as a careless `[p for m in modules for p in m.parameters()]` lists them: a
        shared weight appears twice."""
        mods = [*self.layers, self.enc, self.dec, self.head] + ([self.extra] if self.extra is not None else [])
        return [p for m in mods for p in m.parameters()]


def unique_params(model: Net) -> list[torch.Tensor]:
    """The model's distinct parameters, in order (the index used in every result)."""
    return list(model.parameters())


def param_groups(case, model: Net):
    """What the optimizer is given: a flat list, or two groups (weights / biases with their own lr and
    weight decay). A shared weight is listed twice in either form."""
    listed = model.listed_params()
    if not case["groups"]:
        return listed
    return [{"params": [p for p in listed if p.dim() > 1]},
            {"params": [p for p in listed if p.dim() == 1], "lr": case["bias_lr"], "weight_decay": 0.0}]


def optimizer_cls(case):
    return {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[case["opt"]]


def scheduler(case, opt):
    """The case's learning-rate schedule on `opt` (None without one): StepLR multiplying every group's lr by
    `gamma` after each step, as a training loop would. It writes the new lr into `opt.param_groups`, the
    groups the optimizer was built with; an optimizer that steps an inner optimizer must pass it on."""
    if not case.get("gamma"):
        return None
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=case["gamma"])


def batch(case, rank: int, step: int):
    """Rank `rank`'s data at step `step`: different on every rank and every step."""
    g = torch.Generator().manual_seed(case["seed"] * 7919 + 1000 * step + rank + 1)
    x = torch.randn(case["batch"], case["widths"][0], generator=g)
    y = torch.randn(case["batch"], case["d_out"], generator=g)
    return x, y


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


# ----------------------------------------------------------------------------- one rank's run
def _optimizers(obj) -> list:
    """Every torch.optim.Optimizer reachable from obj: itself, its attributes, and lists/dicts in them."""
    found, seen, stack = [], set(), [(obj, 0)]
    while stack:
        o, depth = stack.pop()
        if id(o) in seen or depth > 3 or isinstance(o, torch.Tensor):
            continue
        seen.add(id(o))
        if isinstance(o, torch.optim.Optimizer):
            found.append(o)
        if isinstance(o, (list, tuple, set)):
            kids = list(o)
        elif isinstance(o, dict):
            kids = list(o.values())
        elif isinstance(o, torch.optim.Optimizer) or depth == 0:
            kids = [v for k, v in vars(o).items() if k not in ("param_groups", "state", "defaults")]
        else:
            kids = []
        stack += [(k, depth + 1) for k in kids]
    return found


def _state(opt, params) -> tuple[int, list[int]]:
    """Bytes of the optimizer-state tensors this rank holds, and the indices of the parameters they belong to."""
    index = {id(p): i for i, p in enumerate(params)}
    seen, nbytes, owners = set(), 0, set()
    for o in _optimizers(opt):
        for key, st in o.state.items():
            tensors = [v for v in st.values() if isinstance(v, torch.Tensor)] if isinstance(st, dict) else []
            if id(key) in index and tensors:
                owners.add(index[id(key)])
            for v in tensors:
                k = (v.data_ptr(), v.nbytes)
                if k not in seen:
                    seen.add(k)
                    nbytes += v.nbytes
    return nbytes, sorted(owners)


def _owner_map(opt, params) -> dict | str:
    """The optimizer's `owner` dict (tensor -> rank) as {parameter index: rank}, or what it is instead."""
    owner = getattr(opt, "owner", None)
    if not isinstance(owner, dict):
        return f"no owner dict (self.owner is {type(owner).__name__})"
    index = {id(p): i for i, p in enumerate(params)}
    out = {}
    for k, v in owner.items():
        if id(k) not in index or type(v) is not int:
            return f"self.owner maps {type(k).__name__} -> {type(v).__name__}, not a model parameter -> its rank (int)"
        out[str(index[id(k)])] = v
    return out


def rank_fn(case, cls, guard=contextlib.nullcontext):
    """fn(rank, world) for run_ranks: one rank's run of optimizer class `cls` on the case's model and this
    rank's data, as plain data. `guard()` wraps the calls into `cls` (the checks pass their own)."""
    def fn(rank, world):
        model = Net(case)
        params = unique_params(model)
        comm = CommCounter()
        with guard():
            opt = cls(param_groups(case, model), optimizer_cls(case), **case["kwargs"])
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"{cls.__name__}(...) must be a torch.optim.Optimizer (subclass it), got "
                                f"{type(opt).__name__}")
            sched = scheduler(case, opt)
            for step in range(case["steps"]):
                model.zero_grad(set_to_none=True)
                loss_fn(model, *batch(case, rank, step)).backward()
                with comm:
                    opt.step()
                if sched is not None:
                    sched.step()                                 # changes the lr in opt.param_groups
        nbytes, owners = _state(opt, params)
        held = [i for i, p in enumerate(params) if p.grad is not None]
        return {"params": [p.detach().reshape(-1).tolist() for p in params], "state_bytes": nbytes,
                "state_params": owners, "grad_params": held, "owner": _owner_map(opt, params),
                "grads": {str(i): params[i].grad.reshape(-1).tolist() for i in held}, "comm": comm.as_dict()}
    return fn


# ----------------------------------------------------------------------------- what every rank holds
DEMO = {"seed": 1537810351, "world": 2, "widths": [7, 27, 29, 31, 30], "d_out": 3, "batch": 4, "steps": 2,
        "opt": "adamw", "kwargs": {"lr": 0.02, "weight_decay": 0.1, "betas": [0.9, 0.99]}, "groups": True,
        "bias_lr": 0.01, "frozen": True, "unused": True, "shared": True,
        "gamma": 0.5}                                                       # task 6.1's visible case


def unsharded_state_bytes(case) -> int:
    """Bytes of optimizer state the case's torch.optim optimizer holds on ONE process after one step: every
    distinct parameter with a gradient gets its state (AdamW: exp_avg, exp_avg_sq, a 4-byte step)."""
    model = Net(case)
    opt = optimizer_cls(case)([p for p in unique_params(model) if p.requires_grad], **case["kwargs"])
    loss_fn(model, *batch(case, 0, 0)).backward()
    opt.step()
    return sum(v.nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def show_ranks(cls, world: int = 2):
    """Run the DEMO case (task 6.1's visible case) on `world` ranks with optimizer class `cls` and print what
    every rank holds (the test cells use it). Returns the ranks' results."""
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class (a torch.optim.Optimizer subclass), got {type(cls).__name__}")
    case = dict(DEMO, world=world)
    res = run_ranks(world, rank_fn(case, cls))
    unsharded = unsharded_state_bytes(case)
    print(f"{'rank':>4} {'state bytes':>12} {'params with state':>18} {'grads held':>10}  bytes per collective")
    for r, g in enumerate(res):
        comm = ", ".join(f"{k} {v['bytes']:,}" for k, v in sorted(g["comm"].items()))
        print(f"{r:>4} {g['state_bytes']:>12,} {len(g['state_params']):>18} {len(g['grad_params']):>10}  {comm}")
    print(f"the unsharded {case['opt']} on one process holds {unsharded:,} bytes of state for "
          f"{len(res[0]['params'])} parameter tensors")
    return res
