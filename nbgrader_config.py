# nbgrader reads this when run from the repository root (and JupyterLab's formgrader does):
# the course's configuration lives in autograder/nbgrader_config.py.
import os

_course_config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autograder", "nbgrader_config.py")
exec(compile(open(_course_config).read(), _course_config, "exec"), {**globals(), "__file__": _course_config})
