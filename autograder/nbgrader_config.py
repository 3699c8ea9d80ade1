"""nbgrader configuration for GPU Memory Lab.

solutions/<assignment>/  is the SOURCE (nbgrader's "source" folder: solutions + hidden tests)
exercises/<assignment>/  is the RELEASE (generated from solutions/, committed)
autograder/submitted|autograded|feedback/ and autograder/gradebook.db are working
folders, ignored by git. Paths are absolute so the commands work from any folder.
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "autograder")

c = get_config()  # noqa: F821  (provided by traitlets when nbgrader loads this file)

c.CourseDirectory.course_id = "gpu-memory-lab"
c.CourseDirectory.root = ROOT
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
c.CourseDirectory.submitted_directory = "autograder/submitted"
c.CourseDirectory.autograded_directory = "autograder/autograded"
c.CourseDirectory.feedback_directory = "autograder/feedback"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(HERE, "gradebook.db")

# Released notebooks must carry no outputs; the generated files are committed.
c.ClearOutput.enabled = True
# Each graded cell gets this long before the kernel is interrupted.
c.ExecutePreprocessor.timeout = 300
# A submission that errors in one cell still gets the rest graded.
c.Execute.interrupt_on_timeout = True
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.CsvExportPlugin.to = os.path.join(ROOT, "grades.csv")
# nbgrader's exchange, where its release/collect buttons move notebooks between accounts on one machine: inside
# the course (autograder/work/ is ignored by git) so that Formgrader finds it instead of warning that
# /usr/local/share/nbgrader/exchange is missing. `python3 course.py start --instructor` creates the folder.
c.Exchange.root = os.path.join(HERE, "work", "exchange")
