"""The trusted checks, one package per exercise (cases, run, references, judge: see common.py for the contract).

CHECKS is the one table that tells the grader which checks grade which assignment: add a row when you add an
exercise (CONTRIBUTING.md). 99_drill is the grading pipeline's own test exercise (tests/fixtures/solutions)."""

CHECKS = {
    "00_memory_hierarchy": "autograder.checks.ex00",
    "01_memory_profiler": "autograder.checks.ex01",
    "02_checkpointing": "autograder.checks.ex02",
    "03_mixed_precision": "autograder.checks.ex03",
    "04_oom_clinic": "autograder.checks.ex04",
    "05_efficient_attention": "autograder.checks.ex05",
    "06_zero": "autograder.checks.ex06",
    "07_qlora": "autograder.checks.ex07",
    "08_capstone": "autograder.checks.ex08",
    "09_parallelism": "autograder.checks.ex09",
    "10_memory_planning": "autograder.checks.ex10",
    "99_drill": "autograder.checks.ex99",
}
