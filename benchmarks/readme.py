"""Write a benchmark's figures into benchmarks/README.md, so the page says what the script last printed.

A section of the README between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` belongs to one script: the
script calls `write_section(NAME, text)` when run with `--write`, and nothing else edits those lines.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"


def write_section(name: str, text: str, readme: Path = README) -> None:
    """Replace the lines between the markers of section `name` in `readme` with `text`."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_-]+", name):
        raise ValueError(f"name must be lower-case letters, digits, '_' or '-', got {name!r}")
    page = readme.read_text()
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    if page.count(start) != 1 or page.count(end) != 1:
        raise ValueError(f"{readme.name} must hold exactly one {start} ... {end} pair")
    head, rest = page.split(start)
    _, tail = rest.split(end)
    readme.write_text(f"{head}{start}\n{text.strip()}\n{end}{tail}")
