"""Offline training text: CPython standard-library sources plus generated arithmetic problems."""

from __future__ import annotations

import pathlib
import sysconfig

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "ensurepip"}


def stdlib_files() -> list[pathlib.Path]:
    """Sorted `.py` files of the running interpreter's standard library, tests and site-packages excluded."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & SKIP_DIRS)]
    return sorted(files)


def stdlib_texts(max_chars: int = 200_000) -> list[str]:
    """Source texts (each file cut to `max_chars`), undecodable files skipped."""
    out = []
    for path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append(text[:max_chars])
    return out
