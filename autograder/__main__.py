"""`python -m autograder ...`: the same as `memlab-grade ...` (autograder/cli.py)."""

from .cli import main

main()
