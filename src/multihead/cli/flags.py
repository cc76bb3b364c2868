"""Flag types shared by every subcommand: a flag name means one thing, and parses one way, everywhere.

Each type is a small callable object that argparse calls on the text; it returns the value or raises
``argparse.ArgumentTypeError`` (argparse then reports ``argument --flag: <message>``: one line, exit status 2). The
objects keep their declared range (``low``, ``high``, ``names``) so that tests can judge a value without running it.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn

MAX_INT = 2**50  # sizes and counts: far above any real model, low enough that products stay exact and fast
MAX_SEED = 2**63 - 1


class CliError(Exception):
    """A bad command line: reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, raising CliError instead of printing usage and exiting (``multihead.cli.main`` prints it
    as every user error: ``multihead <command>: error: <message>``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # a value such as -24GiB or -1e3 is a (bad) value, not an unknown option: argparse's own rule takes only
        # plain negative numbers, and said "expected one argument"; the flag's type then names what is wrong
        self._negative_number_matcher = re.compile(r"^-\.?[0-9]")

    def error(self, message: str) -> NoReturn:
        raise CliError(message)


def show(text: str) -> str:
    """A flag's text as typed, shortened, with undecodable bytes shown as escapes."""
    shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return repr(shown if len(shown) <= 60 else shown[:57] + "...")


class Integer:
    """An integer from ``low`` to ``high``; ``below``: the message for one under ``low`` ({value} is the value)."""

    def __init__(self, low: int, high: int, what: str, *, below: str | None = None) -> None:
        self.low, self.high, self.what, self.below = low, high, what, below

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{show(text)} is not an integer") from None
        if value < self.low and self.below is not None:
            raise argparse.ArgumentTypeError(self.below.format(value=value))
        if not self.low <= value <= self.high:
            digits = str(value)
            shown = f"{value:,}" if len(digits) <= 30 else f"{digits[:12]}... ({len(digits)} digits)"
            raise argparse.ArgumentTypeError(f"{shown} must be {self.what} (from {self.low:,} to {self.high:,})")
        return value


POSITIVE = Integer(1, MAX_INT, "a positive integer")
COUNT = Integer(0, MAX_INT, "a count")
INT = Integer(-MAX_INT, MAX_INT, "an integer")
SEED = Integer(0, MAX_SEED, "a seed")


class Number:
    """A finite float in [low, high] ((low, high] with ``open_low``)."""

    def __init__(self, low: float, high: float, *, open_low: bool = False) -> None:
        self.low, self.high, self.open_low = low, high, open_low

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{show(text)} is not a number") from None
        if (not math.isfinite(value) or value < self.low or value > self.high
                or (self.open_low and value == self.low)):
            raise argparse.ArgumentTypeError(f"{show(text)} must be a finite number in "
                                             f"{'(' if self.open_low else '['}{self.low:g}, {self.high:g}]")
        return value


# Every spelling of an element type, by the one name the commands use for it.
DTYPE_SPELLINGS: dict[str, tuple[str, ...]] = {
    "fp32": ("fp32", "float32", "float", "f32"),
    "fp16": ("fp16", "float16", "half", "f16"),
    "bf16": ("bf16", "bfloat16"),
    "int8": ("int8",),
    "fp8": ("fp8",),
    "fp8_e4m3": ("fp8_e4m3", "float8_e4m3fn"),
    "fp8_e5m2": ("fp8_e5m2", "float8_e5m2"),
}
TORCH_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # torch's name of each float type


class Dtype:
    """The one ``--dtype`` parser: any spelling (bf16, bfloat16, torch.bfloat16, BF16, ...) -> its canonical name
    (a key of DTYPE_SPELLINGS), restricted to ``allowed``; ``many``: a comma-separated list of them. ``extra``:
    further names taken as they are (lowercased), such as --weights-dtype's int4 and GGUF types."""

    def __init__(self, allowed: tuple[str, ...] = tuple(DTYPE_SPELLINGS), *, many: bool = False,
                 extra: tuple[str, ...] = (), what: str = "dtype") -> None:
        self.allowed, self.many, self.extra, self.what = allowed, many, extra, what
        self.names = {s: name for name in allowed for s in DTYPE_SPELLINGS[name]} | {e: e for e in extra}

    def one(self, text: str) -> str:
        key = text.strip().lower().removeprefix("torch.")
        if key not in self.names:
            choices = ", ".join(list(self.allowed) + list(self.extra))
            raise argparse.ArgumentTypeError(f"{self.what} {show(text)[:80]} is unknown: choose one of {choices} "
                                             "(other spellings such as bfloat16 or float16 work too)")
        return self.names[key]

    def __call__(self, text: str) -> str | tuple[str, ...]:
        if not self.many:
            return self.one(text)
        return tuple(dict.fromkeys(self.one(part) for part in items(text, "dtypes, e.g. fp32,bf16")))


class Text:
    """Non-empty text: a path, a model name or a prompt (``what`` says which in the message)."""

    def __init__(self, what: str = "text", *, path: bool = False, blank: bool = False) -> None:
        self.what, self.path, self.blank = what, path, blank

    def __call__(self, text: str) -> str:
        if not (text if self.blank else text.strip()):
            raise argparse.ArgumentTypeError(f"{show(text)}: the {self.what} is empty")
        return text


class ModelName(str):
    """--model's value: a name (smollm2, minilm, ...) or a path. :func:`check_models` refuses a path (one holding a
    slash, or a .gguf file) that does not exist, saying so, when the command runs (the library's message for a name
    it does not know is its own); the parser takes it as written, so a README placeholder still parses."""

    def check(self, flag: str) -> None:
        import os

        looks_like_path = "/" in self or os.sep in self or self.lower().endswith(".gguf") or self.startswith(("~", "."))
        if looks_like_path and not os.path.exists(os.path.expanduser(self)):
            raise CliError(f"argument {flag}: model path {show(self)} does not exist: give an existing .gguf file or "
                           "model folder (or a model's name, as --model's help lists them)")


def check_models(args: argparse.Namespace) -> None:
    """Every :class:`ModelName` the command line gave, checked (``multihead.cli.main`` calls it before the run)."""
    for dest, value in vars(args).items():
        if isinstance(value, ModelName):
            value.check("--" + dest.replace("_", "-"))


class ModelArg(Text):
    """--model: non-empty text, kept as a :class:`ModelName`."""

    def __call__(self, text: str) -> str:
        return ModelName(super().__call__(text))


def kv_heads(n: int) -> str:
    """'1 KV head', '8 KV heads'."""
    return f"{n} KV head" + ("" if n == 1 else "s")


PATH = Text("path", path=True)
MODEL = ModelArg("model name or path", path=True)
TEXT = Text("text")
TOKEN = Text("token", blank=True)  # a token may be a space


def items(text: str, what: str) -> list[str]:
    """The items of a comma-separated list flag, stripped. A list with no item, or with an empty one (two commas in
    a row, a leading or a trailing comma: '1,,2' is not 1,2), is refused, naming the value and where the empty
    item is (argparse adds the flag: ``argument --heads: '1,,2' has an empty item ...``)."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError(f"{show(text)} must be comma-separated {what}: there are none")
    empty = [i for i, p in enumerate(parts, 1) if not p]
    if empty:
        where = ("a leading comma" if empty[0] == 1 else "a trailing comma" if empty[0] == len(parts)
                 else "two commas in a row")
        raise argparse.ArgumentTypeError(f"{show(text)} has an empty item (item {empty[0]} of {len(parts)}: "
                                         f"{where}): give comma-separated {what}")
    return parts


class Listed:
    """A comma-separated list, each item parsed by ``item`` (which raises ArgumentTypeError); ``none`` allows the
    word 'none' for an empty list. An empty item is refused (:func:`items`)."""

    def __init__(self, item: Callable[[str], object], what: str, *, none: bool = False) -> None:
        self.item, self.what, self.none = item, what, none

    def __call__(self, text: str) -> tuple[object, ...]:
        if self.none and text.strip().lower() == "none":
            return ()
        parts = items(text, self.what)
        try:
            return tuple(dict.fromkeys(self.item(p) for p in parts))
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{show(text)} must be comma-separated {self.what}: {err}") from None


class OneOf:
    """One of a fixed set of words, with a message that names them (argparse's ``choices``, in our words).

    ``names`` may be a function giving them, called on first use: a set defined in a module that imports torch is
    then read only when a value is parsed, not when the parser is built (``multihead <command> --help`` stays quick).
    """

    def __init__(self, names: tuple[str, ...] | Callable[[], tuple[str, ...]], message: str) -> None:
        self._names, self.message = names, message

    @property
    def names(self) -> tuple[str, ...]:
        if callable(self._names):
            self._names = self._names()
        return self._names

    def __call__(self, text: str) -> str:
        if text not in self.names:
            raise argparse.ArgumentTypeError(self.message.format(value=show(text)[:80], names=", ".join(self.names)))
        return text


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{show(text)} is not a number") from None
    if not 0 <= value <= 1:  # nan fails this too
        raise argparse.ArgumentTypeError(f"{show(text)} must be a fraction in [0, 1]")
    return value


def _quant_bits(text: str) -> int:
    from multihead.cache import check_bits
    from multihead.errors import MultiheadError

    try:
        return check_bits(COUNT(text))
    except MultiheadError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


FRACTIONS = Listed(_fraction, "fractions, e.g. 0.1,0.3 (or 'none')", none=True)
COUNTS = Listed(COUNT, "integers (counts), e.g. 1,4")
HEAD_COUNTS = Listed(POSITIVE, "integers (head counts), e.g. 1,4,16")
LENGTHS = Listed(POSITIVE, "integers (lengths in tokens), e.g. 2048,4096")
BITS = Listed(_quant_bits, "integers (cache widths), e.g. 8,4,2 (or 'none')", none=True)
BACKENDS = Listed(OneOf(("sdpa", "math", "flex"), "backend {value} is unknown: choose from {names}"), "backends")
DEVICE = OneOf(("cpu", "cuda"), "device {value} is not supported: choose cpu or cuda")
