"""Checks for exercise 08, the capstone "Make it fit" (the contract: checks/common.py; the problems, plans and
tiny twins: memlab.kit.ex08; the grader's references: refs.py).

- task8_1_train_step: the learner's train_step(model, optimizer, x, y, plan) on the tiny twins (Hugging Face
  Llama models of both presets' kinds), three steps each, one case per rung in every hidden run: full fp32 with
  micro-batches that do not divide the batch and checkpointing; full pure bf16 with even micro-batches; full
  with bitsandbytes' AdamW8bit and one sequence per micro-batch; LoRA (peft) with checkpointing and the whole
  batch; QLoRA (bitsandbytes NF4 + peft, bf16 compute) with checkpointing and drawn micro-batches. The gradients
  handed to each step and the trained weights after the last must equal the same rung done plainly (the kit's
  model and optimizer, whole batch, one backward; tolerances 1e-4 in fp32, 6e-2 in bf16). What the step ran is
  counted where it cannot be pumped from outside: the embedding's forward passes (grad enabled, outside the
  backward) must see every row of the batch exactly once, at most micro_batch rows a call, in n_micro calls; with
  checkpointing every decoder layer must be replayed inside the backward (grad enabled) on every row once; the
  optimizer steps once per call. Memory: the second real step's peak on a wider twin (memlab's tracker), and a
  watched case large enough that judge.corroborate can set the sandbox's growth beside the reported peak.
- task8_2_state_bytes: state_bytes(problem, plan) -> {"parameters", "gradients", "optimizer"} bytes on the GPU
  just after the optimizer step, each within 3% (+ 2 MiB) of memlab.fit's model_states, and within half of what
  the smallest mistake weighs where that is less (QLoRA's NF4 constants, AdamW8bit's block constants: refs.
  mistake_weights). Hidden: both presets, the rungs split between them at random (full fp32 AdamW, full bf16
  AdamW8bit, LoRA in both precisions, ZeRO-Offload, QLoRA, full fp32 AdamW8bit), a drawn rank.
- task8_3_cheapest_plan: plan_for(problem, measure): a valid plan (micro-batch dividing the batch, the problem's
  rank, offload only where the host allows it) that memlab.fit says fits, with no plan earlier in the stated
  order that fits (the grader walks the grid with memlab.fit up to the learner's plan, skipping a branch whose
  model states alone exceed the usable bytes). Hidden: one problem of each kind of cases.FAMILY per run (only
  QLoRA with checkpointing; LoRA beats QLoRA; full fine-tuning with ZeRO-Offload and micro-batches, its headroom
  set from memlab.fit's runs so that the plan before the answer peaks below the usable bytes yet does not fit,
  and checkpointing the whole batch fits too), batch, seq, headroom and rank drawn.
Every result field is validated against the case before judging. memlab.fit's machinery is kept out of the
learner's calls of state_bytes and plan_for (run.py: its public names raise, a profile hook records any other call
into memlab/fitting but load_config; task 8.3's `measure` runs memlab.fit for it).

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import plan_run, state_run, train_step_run

TASKS = tasks(
    Task("task8_1_train_step", ("train_step",), "train_step_cases", train_step_run, "train_step_judge"),
    Task("task8_2_state_bytes", ("state_bytes",), "state_cases", state_run, "state_judge"),
    Task("task8_3_cheapest_plan", ("plan_for",), "plan_cases", plan_run, "plan_judge"),
)
