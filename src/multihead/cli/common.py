"""Flag groups and helpers that several subcommands share: --tp over processes, --out folders, --json."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

from multihead.cli.flags import POSITIVE
from multihead.cli.model import TP_HELP


def add_tp(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=POSITIVE, default=1, metavar="N",
                   help=f"{TP_HELP} (default 1); here run for real: start under torchrun --nproc-per-node N")
    p.set_defaults(tp_processes=True)  # --tp here is processes (count's and compare's --tp sizes devices)


def add_json(p: argparse.ArgumentParser, what: str = "print one JSON object") -> None:
    p.add_argument("--json", action="store_true", help=what)


def is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


@contextlib.contextmanager
def out_folder(out: str | Path) -> Iterator[Path]:
    """The output folder, made and checked before the long work (multihead.heads.report.prepare_out_dir); if the
    command then fails or is interrupted, the folders this made are removed again where they are still empty, so a
    failed run leaves nothing it created (a folder that holds results, such as a checkpoint, stays)."""
    from multihead.heads.report import prepare_out_dir

    path = Path(out)
    made = []  # the folders that do not exist yet, deepest first
    for folder in (path, *path.parents):
        try:
            if folder.exists():
                break
        except OSError:  # a name too long, say: prepare_out_dir reports it
            break
        made.append(folder)
    folder = prepare_out_dir(path)
    try:
        yield folder
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty
        raise


def say_model(model: str | None, engine: str, *, quiet: bool = False, default: str = "smollm2") -> None:
    """One line on stdout before the model loads (none when ``quiet``: --json): the model --model names and which
    engine runs it, as --engine decided (:func:`multihead.models.route.route`); a model that cannot be routed
    raises, naming it (the command's one error line, on stderr)."""
    from multihead.models.route import route

    found = route(model, engine, default=default)
    if not quiet:
        print(f"model: {found.describe()}", flush=True)
