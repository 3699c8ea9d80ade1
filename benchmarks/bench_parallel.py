"""Tensor, sequence and pipeline parallelism per rank, measured on 2 and 4 CPU ranks (gloo), with the functions
lesson 09 uses (memlab.parallel.runs) beside the formulas it predicts with (memlab.parallel).

For tensor (TP) and tensor + sequence parallelism (TP+SP) on one `memlab.parallel.Block` (h = 128, 4 heads,
2 x 64 tokens, fp32): each rank's parameter bytes, the bytes kept for backward when the forward ends (block
output included), the collectives of one forward + backward and the bytes the rank sends with ring algorithms,
each against its formula. For a pipeline with one stage per rank (GPipe and 1F1B, m micro-batches of 4 x 64
tokens, two blocks per stage): micro-batches in flight per stage (largest bytes kept / one micro-batch's), the
point-to-point bytes each stage sends, and the idle share of the step against (p-1)/(m+p-1). Bytes are exact;
times (and so the measured bubble) are noisy on a shared machine.

    python benchmarks/bench_parallel.py [--ranks 2 4] [--micro 4 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memlab import format_bytes as fmt, sharding  # noqa: E402
from memlab.parallel import (bubble_fraction, in_flight_microbatches, layer_activation_bytes,  # noqa: E402
                             tp_comm_per_layer, tp_param_bytes)
from memlab.parallel import runs  # noqa: E402

PRELOAD = ("torch.distributed.tensor.parallel", "torch.distributed.pipelining", "memlab.parallel.runs")
B, S, D, A = 2, 64, 128, 4


def _sent(comm: dict) -> int:
    return sum(c["sent"] for c in comm.values())


def tp_rows(group, n):
    print(f"{'run':<6} {'N':>2} {'params/rank':>12} {'formula':>10} {'kept/rank':>10} {'formula':>10} "
          f"{'collectives fwd+bwd':<34} {'sent/rank':>10} {'formula':>10} {'max grad err':>12}")
    for sp in (False, True):
        res = group.run(runs.tp_run, sp)
        r = max(res, key=lambda x: x["activation_bytes"])
        comm = tp_comm_per_layer(S, B, D, n, sequence_parallel=sp, e=4)
        kinds = ", ".join(f"{k} {v['calls']}+{r['backward_comm'][k]['calls']}" for k, v in r["forward_comm"].items())
        sent = _sent(r["forward_comm"]) + _sent(r["backward_comm"])
        kept = layer_activation_bytes(S, B, D, A, t=n, sequence_parallel=sp, e=4, dropout=False, impl="pytorch")
        print(f"{'TP+SP' if sp else 'TP':<6} {n:>2} {fmt(r['param_bytes']):>12} {fmt(tp_param_bytes(D, None, n)):>10} "
              f"{fmt(r['activation_bytes']):>10} {fmt(kept):>10} "
              f"{kinds:<34} {fmt(sent):>10} {fmt(comm['sent_per_step']):>10} "
              f"{max(x['max_grad_error'] for x in res):>12.1e}")


def pp_rows(group, n, micro):
    print(f"{'schedule':<8} {'p':>2} {'m':>2} {'stage':>5} {'one micro-batch':>15} {'in flight':>9} {'predicted':>9} "
          f"{'p2p sent':>10} {'bubble':>7} {'predicted':>9} {'wall s':>7}")
    for schedule in ("gpipe", "1f1b"):
        for m in micro:
            for r in group.run(runs.pp_run, schedule, m):
                print(f"{schedule:<8} {n:>2} {m:>2} {r['rank']:>5} {fmt(r['per_micro_batch']):>15} "
                      f"{r['in_flight']:>9.2f} {in_flight_microbatches(schedule, n, m, r['rank']):>9} "
                      f"{fmt(r['comm']['send']['bytes'] if 'send' in r['comm'] else 0):>10} {r['bubble']:>7.2f} "
                      f"{bubble_fraction(n, m):>9.2f} {r['wall']:>7.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    a = ap.parse_args(argv)
    t0 = time.time()
    for n in a.ranks:
        with sharding.RankGroup(n, preload=PRELOAD, timeout=300) as group:
            print(f"\n## {n} ranks\n")
            tp_rows(group, n)
            print()
            pp_rows(group, n, a.micro)
    print(f"\n(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
