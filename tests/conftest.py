"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest
import torch


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
    def rank(item):
        return (0 if item.path.name in _LONGEST_FILES else 1 if item.get_closest_marker("slow") else 2)
    items.sort(key=rank)                                   # stable: file order within each rank
