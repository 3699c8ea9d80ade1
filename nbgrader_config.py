# nbgrader reads this when run from the repository root (and JupyterLab's formgrader does):
# the course's configuration lives in autograder/nbgrader_config.py.
import os

exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "autograder", "nbgrader_config.py")).read())
