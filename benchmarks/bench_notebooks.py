"""Time to execute each lesson and each exercise solution top to bottom on this
machine (nbclient, python3 kernel). Target: every notebook under 90 s on 2 CPU cores.

    python benchmarks/bench_notebooks.py [paths...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.paths] or sorted((ROOT / "lessons").glob("*.ipynb")) + \
        sorted((ROOT / "solutions").glob("*/*.ipynb"))
    print("| notebook | seconds | result |")
    print("|---|---|---|")
    for p in paths:
        nb = nbformat.read(p, as_version=4)
        t0 = time.perf_counter()
        try:
            NotebookClient(nb, timeout=900, kernel_name="python3",
                           resources={"metadata": {"path": str(p.parent)}}).execute()
            result = "ok"
        except Exception as e:  # noqa: BLE001 - report and go on to the next notebook
            result = f"error: {type(e).__name__}"
        took = time.perf_counter() - t0
        flag = "" if took < 90 else " (over the 90 s target)"
        print(f"| {p.relative_to(ROOT)} | {took:.1f}{flag} | {result} |")


if __name__ == "__main__":
    main()
