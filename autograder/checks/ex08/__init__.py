"""Checks for exercise 08, "Make it fit" (the contract: checks/common.py; the problems' models and the harness:
memlab.kit.ex08; the grader's references: refs.py).

- task8_1_train_step: the learner's train_step(model, optimizer, x, y, plan) on tiny models, for plans that
  cover every option (one micro-batch, one sequence per micro-batch, micro-batches that divide the batch and
  ones that do not; no, some and all blocks checkpointed; foreach and fused AdamW; GPT- and Llama-shaped
  models; three steps, so the optimizer's state is in play): the gradients handed to each step and the
  weights after the last must equal plain full-batch AdamW computed by the grader; the forward calls must
  match the plan (each checkpointed block runs twice). One full-size case: the step's steady-state peak on the
  virtual GPU must not exceed the grader's own implementation of the same plan.
- task8_2_make_it_fit: plan_for(problem) at full size on the problem's virtual GPU: steady state (memlab.clinic,
  as exercise 04) within capacity minus headroom, and on the tiny instance the same training as the recipe.
  Hidden: two problems a run, each with a drawn headroom, one tight (above 5%) and one loose (cases.py).
- task8_3_cheapest_plan: the plan fits (with the learner's step and with the grader's own), and no fitting plan
  of the option grid is cheaper on one count (blocks recomputed, micro-batches) and no dearer on the other; the
  grader finds the fitting plans by brute force.
Every result field is validated against the case before judging (present, exact type, length): an empty or short
list fails, never passes vacuously. Gradients are recorded as copies when the optimizer steps.
memlab.fit and memlab.fit_search (if this memlab has them) raise inside the learner's calls.
"""

from __future__ import annotations

from ..common import Task, tasks
from .cases import plan_cases, train_step_cases
from .judge import cheap_judge, fit_judge, train_step_judge
from .run import plan_run, train_step_run

TASKS = tasks(
    Task("task8_1_train_step", ("train_step",), train_step_cases, train_step_run, train_step_judge),
    Task("task8_2_make_it_fit", ("plan_for", "train_step"), plan_cases, plan_run, fit_judge),
    Task("task8_3_cheapest_plan", ("plan_for", "train_step"), plan_cases, plan_run, cheap_judge),
)
