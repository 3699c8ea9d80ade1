"""Checks whose judges misbehave, for tests/test_grading_containment.py: the judging process must bound them."""

import time

from autograder.checks.common import Task, tasks


def _cases(hidden, rng):
    return [{"n": 1}]


def _run(case, f):
    return f(case["n"])


def _judge_right(case, got):
    assert got == case["n"] + 1, f"f({case['n']}) should be {case['n'] + 1}"


def _judge_slow(case, got):
    time.sleep(60)


def _judge_hog(case, got):
    hog = [bytearray(2**28) for _ in range(64)]      # 16 GiB, over any budget the test gives
    assert hog


TASKS = tasks(Task("right", ("f",), _cases, _run, _judge_right),
              Task("slow", ("f",), _cases, _run, _judge_slow),
              Task("hog", ("f",), _cases, _run, _judge_hog))
