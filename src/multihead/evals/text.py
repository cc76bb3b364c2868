"""The evaluation text: the Jargon File 4.4.7 (public domain), as Debian's ``jargon-text`` package ships it.

It is not the project's own writing and it comes from a package registry: ``make text`` (run by ``make demo`` and
``make test``) installs it with apt. About 1.7 MB of English prose (definitions, usage notes, history), 400k
SmolLM2 tokens. The file is reflowed (paragraph lines joined, box-drawing tables dropped) and split by position:
the first 80% is for training (uptraining), the last 20% is held out for every evaluation.

Caveat for the figures: the Jargon File is on the public web, so a model trained on web text may have seen it;
comparisons between methods on the same model stay fair, absolute perplexities are lower than on unseen text.
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from pathlib import Path

from multihead.errors import MultiheadError

JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
HELD_OUT = 0.2
_BOX = re.compile("[\u2500-\u257f]")  # box drawing: the tables of abbreviations


def read_text(path: str | Path | None = None) -> str:
    """The reflowed Jargon File (or another gzip or plain text file)."""
    file = Path(path) if path is not None else JARGON
    if not file.is_file():
        hint = (" (Debian's jargon-text package: run `make text`, or apt-get install jargon-text)" if path is None
                else "")
        raise MultiheadError(f"the evaluation text {file} is missing{hint}")
    try:
        raw = gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else err  # (an OSError's own text names
        raise MultiheadError(f"the evaluation text {file} cannot be read: {why}") from None  # the file again)
    return reflow(text)


def reflow(text: str) -> str:
    """Paragraphs as single lines separated by a blank line; table lines dropped, runs of spaces collapsed."""
    paragraphs: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if _BOX.search(line):
            continue
        if not line:
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(re.sub(r"\s+", " ", line))
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


@dataclass(frozen=True)
class Splits:
    train: list[int]
    test: list[int]

    def describe(self) -> str:
        return f"{len(self.train):,} training and {len(self.test):,} held-out tokens"


def token_splits(ids: list[int], *, held_out: float = HELD_OUT, least: int = 0) -> Splits:
    """The first (1 - held_out) of the tokens for training, the rest held out; raise if the held-out part is
    shorter than ``least`` tokens (one evaluation window)."""
    cut = int(len(ids) * (1 - held_out))
    splits = Splits(train=ids[:cut], test=ids[cut:])
    if len(splits.test) < least:
        raise MultiheadError(f"the text gives {len(splits.test):,} held-out tokens, fewer than one evaluation window "
                             f"of {least:,}: use a longer text or a shorter --context")
    return splits
