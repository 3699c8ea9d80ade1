"""Exercise 09's judges: each rank's shards against the unsharded nn.Linear (task 9.1), every rank's output,
gradients and the traffic of its forward and of its backward against the one-process MLP (task 9.2), and the
per-stage bytes against a walk of the schedule (task 9.3). Messages teach and never show a hidden reference value."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memlab.sharding.comm import ring_bytes_sent
from memlab.kit.ex09 import linear_weights

from ..common import allclose, expect_int, expect_type
from .refs import TP_DIMS, linear_reference, reference_pipeline_bytes, row_input, torch_shard, tp_reference

SLACK = 64          # bytes a rank may send beyond one all-reduce's ring share (padding a flat buffer)


# ----------------------------------------------------------------------------- task 9.1
def _what(case):
    return (f"[{case['kind']}_parallel_linear, nn.Linear({case['in']}, {case['out']}"
            f"{'' if case['bias'] else ', bias=False'}), world_size {case['world']}]")


def _expect_raise(case, call, names: tuple[str, ...], why: str):
    if call["raised"] != "ValueError":
        got = f"raised {call['raised']}" if call["raised"] else "returned shards"
        raise AssertionError(f"{_what(case)}: {why}, your function {got}; raise ValueError instead")
    if not any(n in call["message"] for n in names):
        raise AssertionError(f"{_what(case)}: {why}: your ValueError must name the argument "
                             f"({' or '.join(names)}) so the caller knows what to fix; its message was "
                             f"{call['message'][:100]!r}")


def _tensor(case, rank, what, s, shape):
    where = f"{_what(case)} rank {rank}'s {what}"
    if s is None or s.get("type") != "Tensor":
        raise AssertionError(f"{where} must be a torch.Tensor, got {'None' if s is None else s['type']}")
    if s["shape"] != list(shape):
        hint = ""
        if case["kind"] == "column" and what == "weight shard" and s["shape"] == [case["out"], case["in"] //
                                                                                   case["world"]]:
            hint = (": you split the input features (dim 1). nn.Linear stores weight as (out_features, "
                    "in_features); column-parallel (Y = X A with A split by columns) splits the OUTPUT features, "
                    "dim 0 of nn.Linear's weight")
        elif case["kind"] == "row" and what == "weight shard" and s["shape"] == [case["out"] // case["world"],
                                                                                  case["in"]]:
            hint = ": row-parallel splits the INPUT features, dim 1 of nn.Linear's (out_features, in_features) weight"
        raise AssertionError(f"{where} has shape {tuple(s['shape'])}, expected {tuple(shape)}{hint}")
    if s["dtype"] != "float32":
        raise AssertionError(f"{where} is {s['dtype']}; keep the weight's dtype (float32)")
    if s["aliases"] or s["storage_bytes"] > s["nbytes"]:
        raise AssertionError(f"{where} shares memory with a {s['storage_bytes']:,}-byte tensor for its own "
                             f"{s['nbytes']:,} bytes: a slice or torch.chunk is a VIEW of the full weight, which "
                             f"stays alive as long as the shard does, so the rank saves nothing. Return a copy "
                             f"(.clone()) that owns only its share")
    return torch.tensor(s["values"], dtype=torch.float32).reshape(shape)


def shard_judge(case, got):
    expect_type("result", got, dict)
    calls = got["calls"]
    t, out, inp = case["world"], case["out"], case["in"]
    if case["error"] == "uneven":
        dim = "out_features (dim 0)" if case["kind"] == "column" else "in_features (dim 1)"
        _expect_raise(case, calls[0], ("weight", "world_size"),
                      f"{dim} = {out if case['kind'] == 'column' else inp} does not divide by world_size {t}")
        return
    if case["error"] == "rank":
        _expect_raise(case, calls[0], ("rank",), f"rank {case['bad_rank']} is not in [0, world_size)"
                      + (" (a negative index silently picks the last shard)" if case["bad_rank"] < 0 else ""))
        return
    assert len(calls) == t, f"{_what(case)}: expected one result per rank ({t}), got {len(calls)}"
    ws, bs = [], []
    for r, c in enumerate(calls):
        if c["raised"]:
            other = "in_features" if case["kind"] == "column" else "out_features"
            raise AssertionError(f"{_what(case)} rank {r}: your function raised {c['raised']}: "
                                 f"{c['message'][:100]!r} on a layer that does split evenly. Only the split "
                                 f"dimension must divide by world_size; {other} is never split")
        if "returned" in c:
            raise AssertionError(f"{_what(case)} rank {r}: return a pair (weight_shard, bias_part), got "
                                 f"{c['returned']}")
        if case["kind"] == "column":
            ws.append(_tensor(case, r, "weight shard", c["weight"], (out // t, inp)))
            if case["bias"]:
                bs.append(_tensor(case, r, "bias shard", c["bias"], (out // t,)))
            elif c["bias"] is not None:
                raise AssertionError(f"{_what(case)} rank {r}: the layer has no bias, so its bias shard is None")
        else:
            ws.append(_tensor(case, r, "weight shard", c["weight"], (out, inp // t)))
            bs.append(None if c["bias"] is None else _tensor(case, r, "bias part", c["bias"], (out,)))
    x, want, no_bias = linear_reference(case)
    if case["kind"] == "column":
        y = torch.cat([F.linear(x, w, b if case["bias"] else None) for w, b in zip(ws, bs or [None] * t)], -1)
        allclose(f"{_what(case)} the ranks' outputs concatenated in rank order", y, want, rtol=1e-5,
                 atol=1e-5,
                 hint=". Rank r keeps output features r*out/t ... (r+1)*out/t - 1 (a contiguous "
                      "block of weight's rows, in order) and the matching block of the bias, so that "
                      "concatenating the ranks' outputs gives the full layer's output")
        return
    partial = sum(F.linear(row_input(x, r, t), w) for r, w in enumerate(ws))
    allclose(f"{_what(case)} the sum of the ranks' partial outputs without bias", partial, no_bias,
             rtol=1e-5, atol=1e-5,
             hint=". Rank r multiplies its block of input features (r*in/t ... (r+1)*in/t - 1, "
                  "what a column-parallel layer before it produced) by the matching contiguous "
                  "block of weight's columns")
    with_bias = [b for b in bs if b is not None]
    if not case["bias"] and with_bias:
        raise AssertionError(f"{_what(case)}: the layer has no bias, yet {len(with_bias)} rank(s) return a bias "
                             f"part: return None")
    y = partial + (sum(with_bias) if with_bias else 0)
    allclose(f"{_what(case)} the all-reduced output (partial outputs plus bias parts, summed)", y, want,
             rtol=1e-5, atol=1e-5,
             hint=f". The all-reduce SUMS what every rank adds: {len(with_bias)} of {t} ranks "
                  f"return a bias part, so the bias arrives {len(with_bias)} times. Keep the whole "
                  f"bias on one rank only (rank 0, for instance) and return None on the others")
    if case["bias"]:       # the sum is right; where the bias sits is what the text asks for
        holders = [r for r, b in enumerate(bs) if b is not None]
        assert len(holders) == 1, (
            f"{_what(case)}: ranks {holders} return a bias part; the whole bias belongs to one rank alone (any one: "
            f"rank 0, for instance) "
            f"and every other rank returns None (not zeros, not a share of it): the next layer's code adds the "
            f"bias where it is not None, and a zero tensor costs a rank the bias's bytes for nothing")
        allclose(f"{_what(case)} rank {holders[0]}'s bias", bs[holders[0]], linear_weights(case)[1], rtol=0, atol=0,
                 hint=": the rank that holds the bias returns all of it, unscaled")


# ----------------------------------------------------------------------------- task 9.2
def _what_run(run, rank):
    tp = run["tp"]
    return (f"[rank {rank} of 4: tensor-parallel rank {rank % tp} of a group of {tp}"
            + (f" (ranks {rank - rank % tp}-{rank - rank % tp + tp - 1}; another group runs beside it on other "
               f"data)" if tp < 4 else "")
            + f"; x of shape ({run['batch']}, {run['seq']}, {run['d']}), hidden {run['hidden']}]")


def _collective_hint(run):
    tp = run["tp"]
    return (" Each rank computes GELU(x W1_shard^T + b1_shard) W2_shard^T, a partial sum of the output; ONE "
            "all-reduce (sum) over `group` makes it whole (pass group=group"
            + (f": with tp={tp} the other ranks belong to another group, on other data" if tp < 4 else "")
            + f"); b2 is added once, after the reduction (added before it on every rank it arrives {tp} times).")


def _check_run(run, k, got):
    tp = run["tp"]
    refs = [tp_reference(run, replica) for replica in range(4 // tp)]
    payload = run["batch"] * run["seq"] * run["d"] * 4            # the (B, T, d) fp32 output
    allowed = ring_bytes_sent("all_reduce", payload, tp)
    for rank, ranks_runs in enumerate(got):
        g = ranks_runs[k]
        what = _what_run(run, rank)
        want_y, want_grads = refs[rank // tp]
        if g["shape"] != list(want_y.shape):
            raise AssertionError(f"{what}: tp_mlp_forward returned shape {tuple(g['shape'])}; every rank returns "
                                 f"the whole output, the shape of x")
        allclose(f"{what} the output", g["y"], want_y.reshape(-1), rtol=1e-4, atol=1e-5,
                 hint=". Compared with the unsharded nn.Sequential(Linear, GELU, Linear) on this "
                      "group's data." + _collective_hint(run))
        if not g["requires_grad"] or "grads" not in g:
            raise AssertionError(f"{what}: the output does not require grad: keep the computation in autograd "
                                 f"(no torch.no_grad, no .detach() on the way to the result)")
        for name, dim in TP_DIMS.items():
            gr = g["grads"][name]
            if gr is None:
                raise AssertionError(f"{what}: {name} got no gradient. "
                                     + ("b2 is replicated: add it on every rank, after the all-reduce, so each "
                                        "copy receives the same gradient (a bias added on one rank only leaves "
                                        "the others' copies untrained, and they drift apart)" if name == "b2" else
                                        "every shard must take part in the output through autograd"))
            want = torch_shard(want_grads[name], dim, rank % tp, tp)
            allclose(f"{what} the gradient of {name}", gr, want.reshape(-1), rtol=1e-4, atol=1e-5,
                     hint=f", while the output is right. Every rank computes the same loss from its "
                          f"replicated output, so the backward of the all-reduce must be the IDENTITY "
                          f"(Megatron's g operator): dL/d(partial) = dL/dy. "
                          f"torch.distributed.nn.functional.all_reduce all-reduces the gradient too and "
                          f"hands every rank {tp} times it; write a torch.autograd.Function whose forward "
                          f"all-reduces a copy and whose backward returns the gradient unchanged")
        # the ring bytes of each collective within the group of tp ranks, from its payload
        sent = sum(ring_bytes_sent(c, v["bytes"], tp) for c, v in g["comm"].items())
        if sent > allowed + SLACK:
            kinds = ", ".join(f"{c}: {v['calls']} call(s), {v['bytes']:,} bytes of payload"
                              for c, v in sorted(g["comm"].items()))
            raise AssertionError(f"{what}: the forward sent {sent:,.0f} bytes ({kinds}), more than one all-reduce of "
                                 f"the (B, T, d) output sends with a ring ({allowed:,.0f} bytes): the Megatron MLP "
                                 f"needs one all-reduce of the output per forward and nothing else. All-gathering "
                                 f"the hidden activation (hidden = 4d) or every rank's partial output moves more")
        _check_backward_traffic(run, what, g["backward_comm"])


def _check_backward_traffic(run, what, comm):
    """The backward's collectives, bounded as Megatron's MLP bounds them: g's backward (after the row-parallel
    layer) is the identity and sends nothing; f's backward (before the column-parallel layer) all-reduces the
    gradient of x, and only when x needs a gradient, which the grader's x (kit09.mlp_data) never does. So nothing
    may be sent."""
    sent = sum(ring_bytes_sent(c, v["bytes"], run["tp"]) for c, v in comm.items())
    if sent > 0:
        kinds = ", ".join(f"{c}: {v['calls']} call(s), {v['bytes']:,} bytes of payload"
                          for c, v in sorted(comm.items()))
        raise AssertionError(
            f"{what}: the backward sent {sent:,.0f} bytes ({kinds}); the Megatron MLP's backward sends nothing here. "
            f"Every rank computes the same loss from the same replicated output, so dL/dy is already whole on every "
            f"rank and the backward of the forward's all-reduce (Megatron's g) is the identity: return the gradient "
            f"unchanged, with no collective. All-reducing it and dividing by t (data parallelism's habit for "
            f"gradients of different data) gives the same gradients for one more all-reduce per step. Only f, the "
            f"identity before the column-parallel layer, all-reduces in the backward, the gradient of x, and the "
            f"grader's x needs no gradient")


def tp_judge(case, got):
    expect_type("result", got, list)
    assert len(got) == case["world"], f"expected one result per rank ({case['world']}), got {len(got)}"
    for r, g in enumerate(got):
        expect_type(f"rank {r}'s result", g, list)
        assert len(g) == len(case["runs"]), f"rank {r}: expected {len(case['runs'])} runs, got {len(g)}"
    for k, run in enumerate(case["runs"]):
        _check_run(run, k, got)


# ----------------------------------------------------------------------------- task 9.3
def _what_pipe(case):
    return (f"[{case['schedule']!r}, {case['stages']} stages, {case['microbatches']} micro-batches, "
            f"bytes_per_microbatch {case['bytes_per_microbatch']:,}]")


def pipe_judge(case, got):
    expect_type("result", got, dict)
    what = _what_pipe(case)
    if case["error"]:
        why = {"schedule": "the schedule is neither 'gpipe' nor '1f1b'",
               "bytes_per_microbatch": "bytes_per_microbatch does not divide evenly by the stages"}[case["error"]]
        if got["raised"] != "ValueError":
            did = f"raised {got['raised']}" if got["raised"] else "returned a value"
            raise AssertionError(f"{what}: {why}; your function {did}. Raise ValueError")
        if case["error"] not in got["message"]:
            raise AssertionError(f"{what}: {why}: your ValueError must name the argument ({case['error']}); its "
                                 f"message was {got['message'][:100]!r}")
        return
    if got["raised"]:
        raise AssertionError(f"{what}: your function raised {got['raised']}: {got['message'][:100]!r} on valid "
                             f"arguments")
    if "returned" in got:
        raise AssertionError(f"{what}: return a list with one int per stage, got a {got['returned']}")
    value = got["value"]
    p, m = case["stages"], case["microbatches"]
    if len(value) != p:
        raise AssertionError(f"{what}: return one number per stage (stage 0 first), got {len(value)}")
    want = reference_pipeline_bytes(case["schedule"], p, m, case["bytes_per_microbatch"])
    for s, (v, w) in enumerate(zip(value, want)):
        expect_int(f"stage {s}'s bytes", v)
        if v != w:
            hint = {"gpipe": "GPipe runs every forward before any backward, so each stage keeps every "
                             "micro-batch's activations at once",
                    "1f1b": "1F1B: stage s runs p - s - 1 warm-up forwards (all m if there are fewer), then "
                            "one forward and one backward in turn: count the micro-batches whose forward is done "
                            "and whose backward is not at the moment stage s starts its first backward (stage 0 "
                            "is the earliest in the pipeline and waits longest for it)"}
            raise AssertionError(f"{what}: stage {s} (of 0..{p - 1}) holds {v:,} bytes by your function, "
                                 f"{'more' if v > w else 'less'} than the reference walk of the schedule. "
                                 f"{hint[case['schedule']]}; each in-flight micro-batch costs a stage "
                                 f"bytes_per_microbatch / stages (its share of the layers)")
