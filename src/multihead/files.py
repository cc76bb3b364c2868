"""Output files that are whole or absent: written under a temporary name beside the target and renamed onto it only
once complete, so an interrupted run (Ctrl-C included) never leaves a half-written report, PNG or JSON."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write; renamed onto ``path`` when the block completes, removed otherwise."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        yield partial
        os.replace(partial, target)
    finally:
        if partial.exists():
            partial.unlink()


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all."""
    with atomic_path(path) as partial:
        partial.write_text(text, encoding="utf-8")
    return Path(path)


def save_figure(fig: Any, path: str | Path) -> Path:
    """``fig.savefig(path)`` whole or not at all (the format from the target's suffix)."""
    target = Path(path)
    with atomic_path(target) as partial:
        fig.savefig(partial, format=target.suffix.lstrip(".") or "png")
    return target
