"""Fixtures shared by several test files."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

_FIT_CACHE = None


def pytest_configure(config):
    """With pytest-xdist workers (-n), one CPU thread per process: the workers, the notebook kernels, the class
    runs' sandboxes and judges and every other process they start already number at least the cores, and OpenMP
    threads of two busy processes wait on each other. Run side by side on this 2-core machine, lessons 01 and 04
    took 41 s and 71 s with 2 threads each, 17.5 s and 58 s with one. A thread count already set is kept.

    One MEMLAB_FIT_CACHE folder for the whole run (memlab/fitting/run.py): memlab.fit's runs measured in one
    process - a pytest-xdist worker, a class run's judge, a memlab-fit command - are read by the others instead of
    run again. Made by the first process to get here (the controller under xdist) and inherited by every process
    it starts; an MEMLAB_FIT_CACHE already set is kept (set it empty to measure every run afresh)."""
    global _FIT_CACHE
    if getattr(config.option, "numprocesses", None):
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    if "MEMLAB_FIT_CACHE" not in os.environ:
        _FIT_CACHE = os.environ["MEMLAB_FIT_CACHE"] = tempfile.mkdtemp(prefix="memlab-fit-cache-")


def pytest_unconfigure(config):
    if _FIT_CACHE:
        shutil.rmtree(_FIT_CACHE, ignore_errors=True)
        del os.environ["MEMLAB_FIT_CACHE"]


@pytest.fixture
def one_thread():
    """Judge and time with one CPU thread, as the grader does: small models and many tiny matmuls run steadier when
    other jobs share the cores (with several threads each op waits for its slowest one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# whole notebooks and class runs: 15-100 s a test (see the --durations list CI prints)
_LONGEST_FILES = ("test_trusted_grading.py", "test_notebooks.py", "test_wrong_submissions.py", "test_book.py")


def pytest_collection_modifyitems(items):
    """The longest tests first, then the others marked slow, then the rest, each in file order. With
    --maxschedchunk 1 (.ci/run) pytest-xdist hands each worker its next test as it frees up, so the two workers
    share the long tests at the start and finish together on short ones (in plain file order the notebooks and
    class runs came last, and one worker could run on alone for a minute at the end)."""
    book = [i for i in items if i.path.name == "test_book.py"]

    def rank(item):
        if item in book[1:]:      # the site is built once, by the first book test: the others come at the end,
            return 2              # not beside it, where the second worker would wait on the build's lock
        return (0 if item.path.name in _LONGEST_FILES else 1 if item.get_closest_marker("slow") else 2)
    items.sort(key=rank)                                   # stable: file order within each rank
