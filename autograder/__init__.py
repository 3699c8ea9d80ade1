"""GPU Memory Lab's grading: nbgrader commands (grade.py) and the checks the
exercise notebooks' test cells call (checks/exNN.py)."""
