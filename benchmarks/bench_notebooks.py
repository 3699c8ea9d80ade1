"""Time to execute each lesson and each exercise solution top to bottom on this
machine (nbclient, python3 kernel). Target: every notebook under 90 s on 2 CPU cores.

    python benchmarks/bench_notebooks.py [--write] [paths...]   # --write: the table into benchmarks/README.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.readme import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/README.md")
    args = ap.parse_args(argv)
    paths = [Path(p).resolve() for p in args.paths] or sorted((ROOT / "lessons").glob("*.ipynb")) + \
        sorted((ROOT / "solutions").glob("*/*.ipynb"))
    rows = ["| notebook | seconds | result |", "|---|---|---|"]
    print("\n".join(rows))
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
        rows.append(f"| {p.relative_to(ROOT)} | {took:.1f}{flag} | {result} |")
        print(rows[-1], flush=True)
    slowest = max(float(r.split("|")[2].split()[0]) for r in rows[2:]) if rows[2:] else 0.0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    summary = (f"**Result: slowest {slowest:.0f} s** (`python benchmarks/bench_notebooks.py --write`, "
               f"{time.strftime('%Y-%m-%d')}, load average {load:.1f} at the end).")
    print(summary)
    if args.write:
        write_section("notebooks", summary + "\n\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
