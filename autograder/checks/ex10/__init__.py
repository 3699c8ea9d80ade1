"""Checks for exercise 10, "Memory planning" (the contract: autograder/checks/common.py).

References, all computed by the grader (refs.py, judged in judge.py):
- task 10.1: each storage's lifetime found by a forward scan from its "alloc" event that counts the tensors on it,
  and the live-bytes bound by evaluating every birth time (tests/test_checks_ex10.py also sets both beside memlab's
  tracker replaying the same traces on real tensors);
- task 10.2: every pair of tensors alive together checked for shared bytes, every offset for its alignment, and on
  small traces the smallest arena found by exhaustive search over placement orders; on a recorded training step
  the arena is held within 25% of the live-bytes bound;
- task 10.3: a separable block written with torch.nn.functional on the check's own filters, trained one step by
  autograd (outputs, gradients, running statistics), its parameter bytes and the bytes its forward keeps for
  backward measured with memlab's tracker; the learner's prediction is set beside that measurement.
Off limits during the learner's calls (detected): memlab/planning/lifetimes.py, planner.py, memlab/core/allocator.py,
track.py and memlab/kit/ex10.py in tasks 10.1 and 10.2; memlab/planning/architectures.py in task 10.3, where
`block_bytes` may run no torch operation.

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import _block_run, _lifetimes_run, _plan_run

TASKS = tasks(
    Task("task10_1_lifetimes", ("tensor_lifetimes", "live_bytes_bound"), "_lifetimes_cases", _lifetimes_run,
         "_lifetimes_judge"),
    Task("task10_2_plan_offsets", ("plan_offsets",), "_plan_cases", _plan_run, "_plan_judge"),
    Task("task10_3_separable_block", ("SeparableBlock", "block_bytes"), "_block_cases", _block_run,
         "_block_judge"),
)
