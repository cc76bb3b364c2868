"""Output files that are whole or absent: written under a temporary name beside the target and renamed onto it only
once complete, so an interrupted run (Ctrl-C included) never leaves a half-written report, PNG or JSON."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from multihead.errors import MultiheadError


def output_file(path: str | Path, suffixes: Iterable[str] | None = None, *, make_folder: bool = True) -> Path:
    """``path`` checked as a file to write: not a folder, a suffix among ``suffixes`` (lower case, no dot) when
    given, its folder created if needed (``make_folder``; else a missing folder is refused, as for a single file a
    flag names: a typo in its folder should not make folders); a clear error otherwise."""
    target = Path(path)
    shown = str(path) if len(str(path)) <= 100 else str(path)[:97] + "..."
    if target.name in ("", ".", ".."):
        raise MultiheadError(f"{shown!r} is not a file name")
    if any(len(part.encode("utf-8", "surrogateescape")) > 255 for part in target.parts):
        raise MultiheadError(f"{shown!r}: a file or folder name is longer than 255 bytes")
    if target.is_dir():
        raise MultiheadError(f"{shown!r} is a folder: give a file name")
    if suffixes is not None:
        allowed = sorted(suffixes)
        if target.suffix.lstrip(".").lower() not in allowed:
            raise MultiheadError(f"{shown!r}: the file type {target.suffix[:20] or '(none)'!r} cannot be written; "
                                 f"use one of {', '.join('.' + a for a in allowed)}")
    blocking = next((a for a in reversed(target.parents) if a.exists() and not a.is_dir()), None)
    if blocking is not None:
        raise MultiheadError(f"cannot write {shown!r}: {str(blocking)!r} is a file, not a folder")
    if not make_folder and not target.parent.is_dir():
        raise MultiheadError(f"cannot write {shown!r}: the folder {str(target.parent)!r} does not exist: create it "
                             "first, or give a path in a folder that exists")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise MultiheadError(f"cannot create the folder of {shown!r}: {err.strerror or err}") from None
    return target


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write; renamed onto ``path`` when the block completes, removed otherwise.
    A failure of the file system (a folder in the way, no space, no permission) is one clear error."""
    target = output_file(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        yield partial
        os.replace(partial, target)
    except OSError as err:
        raise MultiheadError(f"cannot write {str(path)!r}: {err.strerror or err}") from None
    finally:
        if partial.exists():
            partial.unlink()


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all."""
    with atomic_path(path) as partial:
        partial.write_text(text, encoding="utf-8")
    return Path(path)


def save_figure(fig: Any, path: str | Path, *, make_folder: bool = True) -> Path:
    """``fig.savefig(path)`` whole or not at all (the format from the target's suffix); ``make_folder``: as
    :func:`output_file`."""
    target = output_file(path, fig.canvas.get_supported_filetypes(), make_folder=make_folder)
    with atomic_path(target) as partial:
        fig.savefig(partial, format=target.suffix.lstrip(".").lower())
    return target
