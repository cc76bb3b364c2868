"""Every code block of README.md and of the guides, docs/guides/*.md, runs (issue 42 item 5: the README's first
snippet failed as pasted; issue 51 item 7 moved all but the newcomer's part of the README into the guides).

- ```python blocks run in order, one namespace per file and ``##`` section (a later block of a section may continue
  from an earlier one; the first block of a section stands alone, as a reader pastes it). They run in a fresh folder
  that
  holds a link to the checkout's docs/, so `docs/experiments/...` paths resolve and written files land there. The
  real models load once: ``load_llama()`` and ``load_sentence_encoder()`` are memoised, nothing else is set up.
- ```sh blocks: every `multihead ...` command line (also under torchrun) is parsed by the command's own parser, and
  the cheap commands (shapes, count, compare, presets) run for real; `make` targets must exist in the Makefile,
  `benchmarks/...` scripts and `python -m` modules must exist.
- The sections that load a real model are marked ``slow`` (``pytest -m "not slow"`` leaves them out). A test's id
  names the file and the section (``docs/guides/layer.md:The layer``).
- A block in any other language, a line of an sh block the test cannot check, or a python block that raises fails
  the test: nothing is skipped.
- Every relative link of these files points at a file of the checkout (and a ``#fragment`` into a Markdown file at
  one of its headings), and the README stays under 400 lines, linking every guide.
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
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
DOCS = [README, *GUIDES]
README_LINES = 400  # the README is what a newcomer reads (issue 51 item 7): under this many lines
LANGUAGES = {"python", "sh", ""}  # "": a block of plain text (the architecture tree)
RUN = {"shapes", "count", "compare", "presets"}  # cheap commands (no model): run for real
# a placeholder a reader replaces, and what the test puts there
CONFIG = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
          "num_hidden_layers": 30, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
          "tie_word_embeddings": True}


@dataclass(frozen=True)
class Block:
    file: str  # relative to the checkout: README.md, docs/guides/layer.md
    language: str
    line: int  # of the opening fence, 1-based
    section: str  # the ## heading above it
    code: str


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def doc_blocks(path: Path) -> list[Block]:
    name = _name(path)
    blocks, section, fence, body, start = [], "", None, [], 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            opened = re.fullmatch(r"```\s*(\S*)\s*", line)
            if opened:
                fence, body, start = opened[1], [], number
        elif line.strip() == "```":
            blocks.append(Block(name, fence, start, section, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{name}:{start}: a code block is never closed"
    return blocks


BLOCKS = [block for path in DOCS for block in doc_blocks(path)]
SECTIONS = list(dict.fromkeys((b.file, b.section) for b in BLOCKS if b.language == "python"))
REAL_MODELS = ("load_llama(", "load_sentence_encoder(", "hf.load(", "load_decoder(")  # a section loading one: slow


def _blocks_of(key: tuple[str, str]) -> list[Block]:
    return [b for b in BLOCKS if (b.file, b.section) == key]


def _section(key: tuple[str, str]) -> object:
    real = any(m in b.code for b in _blocks_of(key) for m in REAL_MODELS)
    return pytest.param(key, marks=[pytest.mark.slow] if real else [], id=f"{key[0]}:{key[1]}")


def test_every_block_is_in_a_language_the_test_runs() -> None:
    odd = [f"{b.file}:{b.line} ```{b.language}" for b in BLOCKS if b.language not in LANGUAGES]
    assert not odd, f"blocks this test cannot run: {odd}"
    assert len([b for b in BLOCKS if b.language == "python"]) >= 10  # the parser found them


def test_the_readme_is_short_and_links_every_guide() -> None:
    """What a newcomer reads; the rest is in the guides, each a title and a sentence saying what it covers."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < README_LINES, f"README.md has {len(text.splitlines())} lines"
    assert len(GUIDES) >= 8
    for guide in GUIDES:
        assert f"](docs/guides/{guide.name})" in text, f"README.md does not link {_name(guide)}"
        title, blank, sentence = guide.read_text(encoding="utf-8").splitlines()[:3]
        assert title.startswith("# ") and not blank and sentence.startswith("This guide covers "), _name(guide)


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


@pytest.mark.parametrize("section", [_section(key) for key in SECTIONS])
def test_python_blocks_run(section: tuple[str, str], readme_folder: Path) -> None:
    namespace: dict[str, object] = {"__name__": "__readme__"}
    blocks = _blocks_of(section)
    uses_torchrun = any("parallel.init()" in b.code for b in blocks)
    with one_process_group() if uses_torchrun else contextlib.nullcontext(), \
            contextlib.redirect_stdout(io.StringIO()):
        for block in (b for b in blocks if b.language == "python"):
            code = compile(block.code, f"{block.file}:{block.line}", "exec")
            exec(code, namespace)  # a failure's traceback names the file and the block's line


@dataclass(frozen=True)
class Command:
    file: str
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
                found.append(Command(block.file, block.line + offset, tuple(words)))
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


@pytest.mark.parametrize("command", COMMAND_LINES,
                         ids=[f"{c.file}:{c.line}-{' '.join(c.words)[:50]}" for c in COMMAND_LINES])
def test_sh_commands_parse_and_the_cheap_ones_run(command: Command, readme_folder: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    words = command.words
    where = f"{command.file}:{command.line}: {' '.join(words)}"
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
    overview = README.read_text(encoding="utf-8").split("\n## The command line\n")[1].split("\n## ")[0]
    assert {name for name in COMMANDS if f"`{name}`" not in overview} == set(), "the README's command table"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside code blocks and code spans, where a Markdown link is a link."""
    text = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.M | re.S)
    return re.sub(r"(`+).+?\1", "", text, flags=re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens, a repeated
    one numbered."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", re.sub(r"^```.*?^```[ \t]*$", "", path.read_text(
            encoding="utf-8"), flags=re.M | re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in found:
            n += 1
            anchor = f"{slug}-{n}"
        found.add(anchor)
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[_name(p) for p in DOCS])
def test_every_relative_link_points_at_a_file(doc: Path) -> None:
    links = LINK.findall(_prose(doc.read_text(encoding="utf-8")))
    assert links or doc is not README
    bad = []
    for link in links:
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        file, _, fragment = link.partition("#")
        target = (doc.parent / file).resolve() if file else doc
        if not target.is_file() or not target.is_relative_to(ROOT):
            bad.append(f"{link}: no such file")
        elif fragment and target.suffix == ".md" and fragment not in _anchors(target):
            bad.append(f"{link}: no heading #{fragment} in {_name(target)}")
    assert not bad, f"{_name(doc)}: {bad}"
