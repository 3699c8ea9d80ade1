"""GPU numbers recorded on a real CUDA GPU, for learners who have none.

`python benchmarks/record_gpu.py` runs the GPU-only experiments of lessons
01-04 (allocator rounding and segments, allocated vs reserved, fragmentation,
`empty_cache`, the CUDA context, cuBLAS's workspace, tensor-core matmul speed,
a real OOM and its recovery, a memory snapshot) and writes them to
`memlab/hardware/recordings/<gpu>.json`, labelled with the GPU, driver, CUDA and torch
versions, the date and the command. This module reads them back:

    rec = memlab.hardware.recorded.load()            # the newest recording, or None when there is none yet
    print(memlab.hardware.recorded.show("fragmentation"))   # labelled text, or a line saying there is no recording

Every text it returns starts with the label, so a recorded number is never
mistaken for one measured on the learner's machine. Byte fields end in
`_bytes` and print as KiB/MiB/GiB.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..core.track import format_bytes
from ..core.validate import is_number

__all__ = ["DIR", "SCHEMA", "NO_RECORDING", "Recording", "available", "load", "show", "file_stem"]

DIR = Path(__file__).resolve().parent / "recordings"
SCHEMA = 1
NO_RECORDING = ("No GPU recording yet (memlab/hardware/recordings/ holds none): "
                "`python benchmarks/record_gpu.py` on a CUDA "
                "machine records these experiments there.")
_META = ("gpu", "total_memory_bytes", "compute_capability", "driver", "cuda", "torch", "date", "command")


def file_stem(gpu_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (the recording's file name)."""
    if not isinstance(gpu_name, str) or not gpu_name.strip():
        raise ValueError(f"gpu_name must be a non-empty string, got {gpu_name!r}")
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


@dataclass(frozen=True)
class Recording:
    path: Path
    meta: dict
    experiments: dict

    @classmethod
    def from_file(cls, path: Path) -> "Recording":
        if not isinstance(path, Path):
            raise TypeError(f"path must be a pathlib.Path, got {type(path).__name__}")
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path.name} is not valid JSON: {e}") from e
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{path.name}: schema {data.get('schema')!r}, this memlab reads schema {SCHEMA}")
        missing = [k for k in _META if k not in data.get("meta", {})]
        if missing or not isinstance(data.get("experiments"), dict):
            raise ValueError(f"{path.name}: not a recording of benchmarks/record_gpu.py "
                             f"(missing {missing or 'experiments'})")
        return cls(path, data["meta"], data["experiments"])

    @property
    def gpu(self) -> str:
        return self.meta["gpu"]

    @property
    def snapshot(self) -> Path | None:
        """The memory snapshot recorded beside it (open it at https://pytorch.org/memory_viz), or None."""
        p = self.path.with_name(f"{self.path.stem}.snapshot.pickle")
        return p if p.exists() else None

    def label(self) -> str:
        m = self.meta
        return (f"RECORDED on {m['gpu']} ({format_bytes(m['total_memory_bytes'])}, compute capability "
                f"{m['compute_capability']}), driver {m['driver']}, CUDA {m['cuda']}, torch {m['torch']}, "
                f"{m['date']}, by `{m['command']}` - not measured on this machine")

    def experiment(self, name: str) -> dict:
        if not isinstance(name, str) or name not in self.experiments:
            raise ValueError(f"name must be one of {sorted(self.experiments)}, got {name!r}")
        return self.experiments[name]

    def show(self, name: str | None = None) -> str:
        """The label, then one experiment (or all of them) as readable text."""
        names = list(self.experiments) if name is None else [name]
        parts = [self.label()]
        for n in names:
            parts.append(f"[{n}]\n" + _format(self.experiment(n)))
        return "\n".join(parts)


def _value(key: str, v) -> str:
    if key.endswith("_bytes") and is_number(v):
        return format_bytes(v)
    return str(v)


def _format(exp: dict, indent: str = "  ") -> str:
    lines = []
    for key, v in exp.items():
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            lines.append(f"{indent}{key}:")
            cols = list(dict.fromkeys(k for r in v for k in r))
            rows = [[_value(c, r.get(c, "")) for c in cols] for r in v]
            widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
            lines.append(indent + "  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
            lines += [indent + "  " + "  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in rows]
        elif isinstance(v, dict):
            lines.append(f"{indent}{key}:\n" + _format(v, indent + "  "))
        elif isinstance(v, str) and "\n" in v:
            lines.append(f"{indent}{key}:\n" + "\n".join(indent + "  " + s for s in v.splitlines()))
        else:
            lines.append(f"{indent}{key}: {_value(key, v)}")
    return "\n".join(lines)


def available(directory: Path | None = None) -> list[Path]:
    """The recording files in `directory` (default: memlab/hardware/recordings/), sorted by name."""
    d = DIR if directory is None else directory
    if not isinstance(d, Path):
        raise TypeError(f"directory must be a pathlib.Path or None, got {type(d).__name__}")
    return sorted(d.glob("*.json")) if d.is_dir() else []


def load(gpu: str | None = None, directory: Path | None = None) -> Recording | None:
    """The recording whose GPU name contains `gpu` (case-insensitive; None: the newest one), or None when there
    is no such recording. A file that is not a valid recording raises ValueError naming it."""
    if gpu is not None and (not isinstance(gpu, str) or not gpu.strip()):
        raise ValueError(f"gpu must be a non-empty string (part of a GPU name, e.g. 'T4') or None, got {gpu!r}")
    recs = [Recording.from_file(p) for p in available(directory)]
    if gpu is not None:
        recs = [r for r in recs if gpu.lower() in r.gpu.lower() or file_stem(gpu) in r.path.stem]
    return max(recs, key=lambda r: r.meta["date"]) if recs else None


def show(name: str | None = None, gpu: str | None = None, directory: Path | None = None) -> str:
    """Labelled text of a recorded experiment (None: all of them), or `NO_RECORDING` when there is none."""
    rec = load(gpu, directory)
    if rec is None:
        return NO_RECORDING if gpu is None else f"No GPU recording of a {gpu!r} GPU yet. {NO_RECORDING}"
    return rec.show(name)
