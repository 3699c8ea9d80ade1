"""Exercise 08's cases (trusted side): the rungs train_step runs on the tiny twins (task 8.1), the plans whose
model states state_bytes predicts (task 8.2), and the hidden problem family plan_for meets (task 8.3)."""

from __future__ import annotations

from memlab.kit.ex08 import MODELS

from ..common import torch_seed


# ----------------------------------------------------------------------------- task8_1: one case per rung
def _rung(method, precision="fp32", optimizer="adamw", checkpointing=False, micro_batch=1, lora_r=4):
    return {"method": method, "lora_r": lora_r, "precision": precision, "optimizer": optimizer,
            "checkpointing": checkpointing, "micro_batch": micro_batch, "offload": False}


def _tiny_problem(model, batch):
    return {"model": model, "gpu": "T4-16GB", "batch": batch, "seq": 13, "headroom": 0.05, "lora_r": 4,
            "offload_ok": True}


# The watched memory case: the tiny twin of Llama-2-7B with two micro-batches of hundreds of sequences. The step
# peaks near 80 MiB for 1024 sequences (one micro-batch's activations; the whole batch at once, near 160 MiB) and
# takes about half a second on one CPU thread. The grader watches the memory of the learner's process from outside
# while a case runs (the sandbox's cgroup); judge.corroborate flags a case whose growth is far above the peak the
# tracker reported (more than twice it + 64 MiB): a step that did its work where the tracker does not see it.
WATCHED_BATCHES = (768, 896, 1024)


def train_step_cases(hidden, r):
    """Visible: full fp32 with uneven micro-batches and checkpointing, LoRA with checkpointing. Hidden, every run:
    full fp32 with uneven micro-batches (2..3 of 5 or 7) and checkpointing; full pure bf16 with even ones; full
    fp32 with bitsandbytes' AdamW8bit and one sequence per micro-batch; LoRA (fp32 base, rank drawn) with
    checkpointing and the whole batch at once; QLoRA (NF4 base, bf16 compute) with checkpointing and drawn
    micro-batches. Both tiny twins appear (MHA and GQA). Then the memory case (visible too): on a "small" twin, full
    fp32 with two micro-batches, the second real step's peak (the optimizer's state alive) against the same plan
    done by the grader; and the watched memory case (hidden), the same on the tiny twin with a batch of hundreds,
    corroborated from outside the learner's process (judge.corroborate)."""
    if not hidden:
        return [{"part": "tiny", "problem": _tiny_problem("llama-2-7b", 5),
                 "plan": _rung("full", checkpointing=True, micro_batch=2), "seed": 801, "data_seed": 8},
                {"part": "tiny", "problem": _tiny_problem("llama-3.1-8b", 4),
                 "plan": _rung("lora", checkpointing=True, micro_batch=2), "seed": 802, "data_seed": 9},
                {"part": "memory", "problem": _tiny_problem("llama-2-7b", 4), "plan": _rung("full", micro_batch=2),
                 "seed": 803, "data_seed": 10}]
    models = list(MODELS) * 3
    r.shuffle(models)
    B_odd = r.choice([5, 7])
    B_even = r.choice([4, 6])
    B3 = r.randint(3, 6)
    ck = r.random() < 0.5                     # one of the two full 16-bit/8-bit rungs checkpoints, the other not
    rungs = [(B_odd, _rung("full", checkpointing=True, micro_batch=r.choice([d for d in (2, 3) if B_odd % d]))),
             (B_even, _rung("full", "bf16", checkpointing=ck, micro_batch=2)),
             (B3, _rung("full", optimizer="adamw8bit", checkpointing=not ck, micro_batch=1)),
             (B3, _rung("lora", checkpointing=True, micro_batch=B3, lora_r=r.choice([2, 4, 8]))),
             (B3, _rung("qlora", "bf16", checkpointing=True, micro_batch=r.randint(1, B3), lora_r=r.choice([2, 4])))]
    models = models[:len(rungs)]
    if len(set(models)) < 2:
        models[0] = [m for m in MODELS if m != models[1]][0]
    out = [{"part": "tiny", "problem": _tiny_problem(m, B), "plan": plan, "seed": torch_seed(r),
            "data_seed": r.randrange(2**31)} for m, (B, plan) in zip(models, rungs)]
    B = r.choice([4, 6])                  # the memory case: two micro-batches, measured in the second real step
    out.append({"part": "memory", "problem": _tiny_problem(r.choice(MODELS), B), "plan": _rung("full",
                micro_batch=B // 2), "seed": torch_seed(r), "data_seed": r.randrange(2**31)})
    B = r.choice(WATCHED_BATCHES)         # the watched case: large enough that memory kept from the tracker shows
    out.append({"part": "memory", "size": "tiny", "watched": True, "problem": _tiny_problem("llama-2-7b", B),
                "plan": _rung("full", micro_batch=B // 2), "seed": torch_seed(r), "data_seed": r.randrange(2**31)})
    return out


# ----------------------------------------------------------------------------- task8_2: model states per rung
def state_cases(hidden, r):
    """Visible: Llama-2-7B, rank 16, five rungs. Hidden, every run: both presets, the rungs split between them at
    random - full fp32 AdamW, full bf16 AdamW8bit and LoRA on one; ZeRO-Offload (bf16), QLoRA, full fp32 AdamW8bit
    and LoRA on the other, the two LoRA plans in the two precisions (a frozen base counted in one dtype whatever
    the plan fails one) - each with a drawn rank (memlab.fit measures each once: a few seconds, then its disk
    cache answers). Every mistake judge.state_judge's tolerance is set to catch is decisive in every run: QLoRA's
    NF4 constants, the 8-bit state's block constants (two plans), the frozen base's dtype."""
    def problem(model):
        return {"model": model, "gpu": r.choice(["T4-16GB", "L4-24GB"]), "batch": r.choice([4, 8]),
                "seq": r.choice([512, 1024]), "headroom": 0.05, "lora_r": r.choice([8, 16, 32, 64]),
                "offload_ok": True}
    if not hidden:
        p = {**problem("llama-2-7b"), "gpu": "L4-24GB", "lora_r": 16}
        return [{"problem": p, "plans": [_rung("full", "bf16"), _rung("full", "bf16", "adamw8bit"),
                                         {**_rung("full", "bf16"), "offload": True}, _rung("lora", "bf16", lora_r=16),
                                         _rung("qlora", "bf16", lora_r=16)]}]
    one, two = r.sample(list(MODELS), 2)
    p1, p2 = problem(one), problem(two)
    lora = r.sample(["fp32", "bf16"], 2)
    return [{"problem": p1, "plans": [_rung("full", "fp32"), _rung("full", "bf16", "adamw8bit"),
                                      _rung("lora", lora[0], lora_r=p1["lora_r"])]},
            {"problem": p2, "plans": [{**_rung("full", "bf16"), "offload": True},
                                      _rung("qlora", r.choice(["fp32", "bf16"]), lora_r=p2["lora_r"]),
                                      _rung("full", "fp32", "adamw8bit"), _rung("lora", lora[1], lora_r=p2["lora_r"])]}]


# ----------------------------------------------------------------------------- task8_3: the problem family
# Every hidden run draws one problem of each kind (tests/test_checks_ex08.py proves each kind's answer at the
# corners of its ranges with memlab.fit; peaks grow with seq and lora_r, usable bytes shrink with headroom):
#   "qlora"  Llama-3.1-8B on the T4: the model states of every full and LoRA branch exceed the usable bytes, QLoRA
#            without checkpointing does not fit even one sequence per micro-batch, QLoRA with it does (so QLoRA in
#            fp32 is the answer, before bf16);
#   "lora"   Llama-3.1-8B on the L4 at rank 64, no host RAM for offload: no full plan fits, LoRA (bf16 base) does
#            with checkpointing, so it beats QLoRA; its model states hold over 80% of the usable bytes, so a
#            plan_for that skips branches well below the text's margin (states > 0.8 x usable) skips the answer;
#   "offload" Llama-2-7B on the L4 with host RAM: full fine-tuning in pure bf16 with ZeRO-Offload is the first branch
#            with room, and the headroom is set from memlab.fit's own runs of that branch (refs.trap_windows) so
#            that the answer is a plan without checkpointing and with micro-batches, the plan just before it peaks
#            below the usable bytes yet does not fit (the CUDA context and the allocator's reserve tip it: a
#            plan_for that reads measure(plan)["peak"] instead of ["fits"] returns it), and checkpointing the whole
#            batch fits as well (a plan_for that tries fewer micro-batches before no checkpointing returns that).
# The LoRA ranks of the "qlora" and "lora" kinds do not overlap, so a rank written into plan_for fails a kind.
# Batches are small (2 or 4 sequences: divisors 1, 2, 4; the "lora" kind, whose answer checkpoints, 2), so a walk
# measures few plans; memlab.fit keeps each measured step on disk, and sequences are drawn at the two ends of each
# kind's range (where the tests prove the kind), so that later runs and a class's later learners read most of the
# judge's runs back.
RANKS = (8, 16, 32, 64)
FAMILY = {
    "qlora": {"model": "llama-3.1-8b", "gpu": "T4-16GB", "seq": (768, 1024), "headroom": (0.04, 0.10),
              "ranks": (8, 16, 32), "offload_ok": None},
    "lora": {"model": "llama-3.1-8b", "gpu": "L4-24GB", "seq": (384, 512), "headroom": (0.05, 0.08),
             "ranks": (64,), "offload_ok": False, "batches": (2,)},
    "offload": {"model": "llama-2-7b", "gpu": "L4-24GB", "seq": (512, 640), "headroom": None,
                "ranks": RANKS, "offload_ok": True},
}
BATCHES = (2, 4)
VISIBLE_PROBLEM = {"model": "llama-2-7b", "gpu": "L4-24GB", "batch": 4, "seq": 512, "headroom": 0.05, "lora_r": 16,
                   "offload_ok": False}


def sizes(kind) -> list[tuple[int, int]]:
    """(batch, seq) of the problems of `kind`: the ends of its seq range, where tests/test_checks_ex08.py proves the
    kind's answer (few sizes: the judge's memlab.fit runs are read back from its disk cache run after run)."""
    return [(b, seq) for b in FAMILY[kind].get("batches", BATCHES) for seq in FAMILY[kind]["seq"]]


def draw_problem(kind, r):
    """A problem of `kind`. The "offload" kind's headroom comes from memlab.fit's runs of its branch (refs.py): the
    sizes are drawn again until one has a window (every size of the family has one: tests/test_checks_ex08.py)."""
    f = FAMILY[kind]
    order = sizes(kind)
    r.shuffle(order)
    for batch, seq in order:
        p = {"model": f["model"], "gpu": f["gpu"], "batch": batch, "seq": seq, "headroom": 0.0,
             "lora_r": r.choice(f["ranks"]),
             "offload_ok": r.random() < 0.5 if f["offload_ok"] is None else f["offload_ok"]}
        if f["headroom"] is not None:
            return {**p, "headroom": round(r.uniform(*f["headroom"]), 3)}
        from .refs import trap_headroom
        h = trap_headroom(p, r)
        if h is not None:
            return {**p, "headroom": h}
    raise RuntimeError(f"no size of the {kind!r} kind has a headroom window: memlab.fit's numbers changed "
                       f"(see refs.trap_windows and tests/test_checks_ex08.py)")


def plan_cases(hidden, r):
    if not hidden:
        return [{"problem": VISIBLE_PROBLEM}]
    kinds = list(FAMILY)
    r.shuffle(kinds)
    return [{"problem": draw_problem(k, r), "kind": k} for k in kinds]
