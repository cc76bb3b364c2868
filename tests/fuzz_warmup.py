"""Imported by the fuzz fork server only (tests/isolation.py): runs each kind of case once, so that what torch,
tokenizers and the loaders set up on first use (kernels, dispatch tables, caches) is done before the server forks,
not again in every child."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path


def _warm() -> None:
    from test_hostile_cli import run_cli
    from test_hostile_files import use_llama
    from tiny_checkpoints import write_tiny_gguf

    with tempfile.TemporaryDirectory() as folder:
        use_llama(write_tiny_gguf(Path(folder) / "warm.gguf"))
    with contextlib.redirect_stdout(io.StringIO()):
        run_cli(["count", "--preset", "gpt2", "--seq", "128"])


_warm()
