"""memlab.fit against the model-state estimators, at full size, and its speed.

For each shipped 7B-class config, one training step at batch 1 x seq 512 on an A100-80GB:
  fit          memlab.fit's peak (virtual GPU, extended from 2 and 3 layers), full fine-tuning, precision
               "mixed" (bf16 weights + fp32 master, AdamW: 16 B/param of model states) and "bf16"
  accelerate   `accelerate estimate-memory`'s training figure for bf16: max of estimate_training_usage
               (model states only, batch 1, no activations)
  ds-zero2/3   DeepSpeed's estimate_zero2/zero3_model_states_mem_needs, 1 GPU, no offload (model states)
and the time of each fit (first call per plan: it runs the virtual step) and of one fit_search.
The real-tensor check (memlab's tracker on real CPU tensors vs fit, to the byte) runs on a tiny Llama.

    python benchmarks/bench_fit.py [--models llama-2-7b mistral-7b ...]
    python benchmarks/bench_fit.py --speed          # only the command line's speed, cold and warm

Speed: each `memlab-fit` command of SPEED runs in a fresh process (imports included), first with an empty folder of
measured steps (cold: every step is run) and then again with the folder it filled (warm: read back, transformers
not imported); the CPU seconds are the child process's user + sys (resource.getrusage), the wall seconds its
elapsed time, printed with the machine's load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEVEN_B = ["llama-2-7b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b", "gemma-7b"]
GiB = 2**30


def _ds(n: int, largest: int):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    _, z2 = estimate_zero2_model_states_mem_needs(n, 1, 1, cpu_offload=False)
    _, z3, _ = estimate_zero3_model_states_mem_needs(n, largest, 1, 1, cpu_offload=False, cpu_offload_params=False)
    return z2, z3


SPEED = ["llama-2-7b --gpu L4-24GB --batch 4 --seq 2048 --no-search",
         "llama-2-7b --gpu L4-24GB --method qlora --checkpointing full --seq 1024 --no-search",
         "llama-2-7b --gpu T4 --seq 1024 --search",
         "llama-3.1-8b --gpu 4090 --method qlora --checkpointing full --max-seq"]


def _timed(cmd: str, cache: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one memlab-fit command in a fresh process."""
    import resource
    import shlex
    import subprocess
    exe = os.path.join(os.path.dirname(sys.executable), "memlab-fit")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run([exe, *shlex.split(cmd)], capture_output=True, text=True,
                         env=dict(os.environ, MEMLAB_FIT_CACHE=cache, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise RuntimeError(f"{cmd}: {out.stderr[-500:]}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def speed():
    import tempfile
    print("| command | cold: CPU s (wall s) | warm: CPU s (wall s) | load average |")
    print("|---|---|---|---|")
    for cmd in SPEED:
        with tempfile.TemporaryDirectory() as folder:
            cold = _timed(cmd, folder)
            warm = _timed(cmd, folder)
        print(f"| `memlab-fit {cmd}` | {cold[0]:.1f} ({cold[1]:.1f}) | {warm[0]:.1f} ({warm[1]:.1f}) | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=SEVEN_B)
    ap.add_argument("--speed", action="store_true", help="only the command line's speed, cold and warm")
    args = ap.parse_args(argv)
    if args.speed:
        return speed()
    import memlab
    from memlab.quant.llama import silence_libraries
    silence_libraries()
    from accelerate.commands.estimate import estimate_training_usage

    print("| model | params | fit mixed (s) | fit bf16 (s) | fit mixed, ckpt full | accelerate bf16 | "
          "DeepSpeed ZeRO-2 | DeepSpeed ZeRO-3 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        t = time.perf_counter()
        mixed = memlab.fit(name, "A100-80GB", precision="mixed")
        t_mixed = time.perf_counter() - t
        t = time.perf_counter()
        bf16 = memlab.fit(name, "A100-80GB", precision="bf16")
        t_bf16 = time.perf_counter() - t
        ck = memlab.fit(name, "A100-80GB", precision="mixed", checkpointing="full")
        n = mixed.n_params
        acc = max(estimate_training_usage(4 * n, "bfloat16").values())
        from memlab.fitting.plan import load_config
        cfg = load_config(name)
        largest = max(cfg.vocab_size * cfg.hidden_size, mixed.n_params // cfg.num_hidden_layers)
        z2, z3 = _ds(n, largest)
        g = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
        print(f"| {name} | {n / 1e9:.2f}B | {g(mixed.peak)} ({t_mixed:.1f}) | {g(bf16.peak)} ({t_bf16:.1f}) | "
              f"{g(ck.peak)} | {g(acc)} | {g(z2)} | {g(z3)} |")

    print("\nmodel states of fit mixed vs 16 B/param:")
    r = memlab.fit(args.models[0], "A100-80GB", precision="mixed")
    print(f"  {args.models[0]}: {sum(r.model_states.values()) / r.n_params:.3f} B/param "
          f"({', '.join(f'{k} {v / GiB:.2f} GiB' for k, v in r.model_states.items())})")

    print("\nspeed (this machine; noisy when it is shared):")
    from memlab.fitting.run import clear_cache
    for name in args.models[:1]:
        clear_cache()
        t = time.perf_counter()
        memlab.fit(name, "L4-24GB", batch=4, seq=1024, method="qlora", checkpointing="full")
        print(f"  fit {name} qlora, batch 4 x 1024, first call: {time.perf_counter() - t:.1f} s")
        clear_cache()
        t = time.perf_counter()
        plans = memlab.fit_search(name, "L4-24GB", batch=4, seq=1024)
        print(f"  fit_search {name} on L4-24GB, batch 4 x 1024: {time.perf_counter() - t:.1f} s, "
              f"{len(plans)} plans; cheapest: {plans[0].plan['method']}, checkpointing "
              f"{plans[0].plan['checkpointing']}, micro-batch {plans[0].plan['micro_batch'] or 4}" if plans else
              f"  fit_search: nothing fits ({time.perf_counter() - t:.1f} s)")

    print("\nreal CPU tensors (memlab tracker) vs fit (virtual GPU), tiny Llama, seq 256:")
    from memlab.fitting.plan import Plan
    from memlab.fitting.model import fit_step, precision_dtype, skeleton
    from memlab.core.track import MemoryTracker
    tiny = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    for kw in (dict(), dict(method="lora"), dict(method="qlora", checkpointing="full"), dict(precision="amp"),
               dict(precision="mixed", checkpointing="selective")):
        plan = Plan(seq=256, **kw)
        sk, info = skeleton(load_config(tiny), plan.method, precision_dtype(plan.precision), plan.lora_r,
                            plan.attention)
        trk = MemoryTracker(device="cpu", round_to=512)
        with trk:
            fit_step(sk, info, plan)
        r = memlab.fit(tiny, 1, seq=256, **kw)
        print(f"  {kw or 'full bf16'}: real {trk.peak} B, fit {r.peak} B, difference {trk.peak - r.peak} B")


if __name__ == "__main__":
    main()
