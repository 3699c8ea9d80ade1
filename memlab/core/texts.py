"""Small texts shipped inside the kit (package data), so that every copy of the course reads them without the
network: a `course.py sync` working copy (my-work/), `memlab-grade public`, a pip install on Colab."""

from __future__ import annotations

from importlib import resources

__all__ = ["shipped_text", "shipped_texts"]


def shipped_texts() -> list[str]:
    """The names of the shipped texts."""
    return sorted(p.name for p in resources.files(__package__).joinpath("corpus").iterdir() if p.name.endswith(".txt"))


def shipped_text(name: str = "gettysburg.txt") -> bytes:
    """The bytes of a shipped text (lesson 08 trains its tiny model on gettysburg.txt)."""
    if not isinstance(name, str) or name not in shipped_texts():
        raise ValueError(f"name must be one of {shipped_texts()}, got {name!r}")
    return resources.files(__package__).joinpath("corpus", name).read_bytes()
