"""Every code block of README.md runs (issue 42 item 5: its first snippet failed as pasted).

- ```python blocks run in order, one namespace per ``##`` section (a later block of a section may continue from an
  earlier one; the first block of a section stands alone, as a reader pastes it). They run in a fresh folder that
  holds a link to the checkout's docs/, so `docs/experiments/...` paths resolve and written files land there. The
  real models load once: ``load_llama()`` and ``load_sentence_encoder()`` are memoised, nothing else is set up.
- ```sh blocks: every `multihead ...` command line (also under torchrun) is parsed by the command's own parser, and
  the cheap commands (shapes, count, compare, presets) run for real; `make` targets must exist in the Makefile,
  `benchmarks/...` scripts and `python -m` modules must exist.
- The sections that load a real model are marked ``slow`` (``pytest -m "not slow"`` leaves them out).
- A block in any other language, a line of an sh block the test cannot check, or a python block that raises fails
  the test: nothing is skipped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from multihead.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LANGUAGES = {"python", "sh", ""}  # "": a block of plain text (the architecture tree)
RUN = {"shapes", "count", "compare", "presets"}  # cheap commands (no model): run for real
# a placeholder a reader replaces, and what the test puts there
CONFIG = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
          "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
          "tie_word_embeddings": True}


@dataclass(frozen=True)
class Block:
    language: str
    line: int  # of the opening fence, 1-based
    section: str  # the ## heading above it
    code: str


def readme_blocks() -> list[Block]:
    blocks, section, fence, body, start = [], "", None, [], 0
    for number, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            opened = re.fullmatch(r"```\s*(\S*)\s*", line)
            if opened:
                fence, body, start = opened[1], [], number
        elif line.strip() == "```":
            blocks.append(Block(fence, start, section, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"README.md:{start}: a code block is never closed"
    return blocks


BLOCKS = readme_blocks()
SECTIONS = list(dict.fromkeys(b.section for b in BLOCKS if b.language == "python"))
REAL_MODELS = ("load_llama(", "load_sentence_encoder(", "hf.load(")  # a section that loads one is a slow test


def _section(name: str) -> object:
    real = any(m in b.code for b in BLOCKS if b.section == name for m in REAL_MODELS)
    return pytest.param(name, marks=pytest.mark.slow) if real else name


def test_every_block_is_in_a_language_the_test_runs() -> None:
    odd = [f"README.md:{b.line} ```{b.language}" for b in BLOCKS if b.language not in LANGUAGES]
    assert not odd, f"blocks this test cannot run: {odd}"
    assert len([b for b in BLOCKS if b.language == "python"]) >= 10  # the parser found them


@pytest.fixture(scope="module")
def readme_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh folder with docs/ linked, the real models memoised, and the environment torchrun gives one process
    (for the parallel section's `parallel.init()`)."""
    import multihead.models as models

    folder = tmp_path_factory.mktemp("readme")
    (folder / "docs").symlink_to(ROOT / "docs")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.setenv("MPLBACKEND", "Agg")
        for name in ("load_llama", "load_sentence_encoder"):
            mp.setattr(models, name, functools.cache(getattr(models, name)))
        yield folder


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """What `torchrun --nproc-per-node 1` sets, and the group torn down after."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        try:
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.mark.parametrize("section", [_section(name) for name in SECTIONS])
def test_python_blocks_run(section: str, readme_folder: Path) -> None:
    namespace: dict[str, object] = {"__name__": "__readme__"}
    uses_torchrun = any("parallel.init()" in b.code for b in BLOCKS if b.section == section)
    with one_process_group() if uses_torchrun else contextlib.nullcontext(), \
            contextlib.redirect_stdout(io.StringIO()):
        for block in (b for b in BLOCKS if b.section == section and b.language == "python"):
            code = compile(block.code, f"README.md:{block.line}", "exec")
            exec(code, namespace)  # a failure's traceback names README.md and the block's line


@dataclass(frozen=True)
class Command:
    line: int
    words: tuple[str, ...]


def sh_commands() -> list[Command]:
    """Each command of the sh blocks: continuation lines joined, comments dropped."""
    found = []
    for block in (b for b in BLOCKS if b.language == "sh"):
        text = block.code.replace("\\\n", " ")
        for offset, line in enumerate(text.splitlines(), 1):
            words = shlex.split(line, comments=True)
            if words:
                found.append(Command(block.line + offset, tuple(words)))
    return found


COMMAND_LINES = sh_commands()


def _multihead_args(words: tuple[str, ...]) -> list[str] | None:
    """The arguments of `multihead ...`, `python -m multihead ...` or `torchrun ... -m multihead ...`."""
    if words[0] == "multihead":
        return list(words[1:])
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "multihead":
            return list(words[i + 2:])
    return None


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


@pytest.mark.parametrize("command", COMMAND_LINES, ids=[f"{c.line}-{' '.join(c.words)[:50]}" for c in COMMAND_LINES])
def test_sh_commands_parse_and_the_cheap_ones_run(command: Command, readme_folder: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    words = command.words
    where = f"README.md:{command.line}: {' '.join(words)}"
    for path in re.findall(r"\b(?:docs|benchmarks)/[\w./-]+\.\w+", " ".join(words)):
        assert (ROOT / path).exists(), f"{where}: {path} does not exist"
    args = _multihead_args(words)
    if args is not None:
        assert args and args[0] in COMMANDS, where
        if "--help" in args:
            with pytest.raises(SystemExit) as done:
                main(args)
            assert done.value.code == 0, where
            assert "examples:" in capsys.readouterr().out, where
            return
        parsed = build_parser(args[0]).parse_args(args)  # raises CliError (the test fails) on a bad flag or value
        assert parsed.command == args[0], where
        if args[0] in RUN:
            if "path/to/config.json" in args:
                import json

                (readme_folder / "config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
                args = [str(readme_folder / "config.json") if a == "path/to/config.json" else a for a in args]
            status = main(args)
            err = capsys.readouterr().err
            assert status == 0, f"{where}: status {status}: {err}"
        return
    if words[0] == "make":
        assert set(words[1:]) <= _makefile_targets(), f"{where}: no such Makefile target"
        return
    if re.fullmatch(r"(\.venv/bin/)?python3?", words[0]):
        if words[1] == "-m":
            assert importlib.util.find_spec(words[2]) is not None, f"{where}: no module {words[2]}"
        else:
            assert (ROOT / words[1]).is_file(), f"{where}: no script {words[1]}"
        return
    if words[0] in ("bash", "sh"):  # a script of the repository run by the shell
        words = words[1:]
    if words[0].startswith("benchmarks/") or words[0].endswith(".sh"):
        assert (ROOT / words[0]).is_file(), f"{where}: no script {words[0]}"
        return
    pytest.fail(f"{where}: an sh line this test does not know how to check")


def test_the_sh_blocks_show_every_command() -> None:
    shown = {args[0] for c in COMMAND_LINES if (args := _multihead_args(c.words))}
    assert shown == set(COMMANDS)
