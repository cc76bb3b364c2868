"""Progress bars for the analyses' long work, on stderr, each of whose lines is written once.

On a terminal a bar redraws itself in place (tqdm's carriage returns). Anywhere else (a log file, a pipe, a test's
captured stream) every redraw stays in the text, and tqdm's close draws the finished bar again after its last update
did: the last line appeared twice. There a bar writes only its first line and its finished one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def progress_bar(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str, unit: str,
                 progress: bool, leave: bool = True) -> Any:
    """A tqdm bar on stderr (``progress`` False: none) that redraws in place on a terminal and elsewhere writes
    its start and its end only, each once."""
    from tqdm import tqdm

    stream = sys.stderr
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not progress, leave=leave, file=stream,
                mininterval=0.1 if _is_terminal(stream) else math.inf)


__all__ = ["progress_bar"]
