"""Values read from files (checkpoints, config.json), checked where they are read: type, range, and (by the
callers) agreement with the tensors they describe, before anything is allocated from them. The config reader
(:mod:`multihead.hf.config`) and the model loaders use these reads and these bounds.

Every error names the file, the key, the value and what was expected::

    values = Values("/models/x.gguf")
    n_heads = values.integer("llama.attention.head_count", raw, low=1, high=MAX_HEADS)
"""

from __future__ import annotations

import math
from typing import Any

from multihead.errors import MultiheadError

# Bounds far above any real model, far below what would exhaust memory before the tensors are compared.
MAX_WIDTH = 1 << 20  # d_model, head_dim, FFN width
MAX_HEADS = 1 << 14
MAX_LAYERS = 1 << 12
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 31  # positions: no table is allocated from it here (RoPE is computed per position)
MAX_FFN = 4 * MAX_WIDTH  # an MLP's (or an expert's) hidden width
MAX_EXPERTS = 1 << 16  # experts of a mixture-of-experts layer
# A model's parameters: past 2^61, their float32 bytes pass 2^63, which no int64 byte count (torch's storage size,
# the OS's) can hold, so no machine can allocate them.
MAX_PARAMETERS = ((1 << 63) - 1) // 4

# What each bound is, for messages: "expected an integer from 1 to 1,048,576 (MAX_WIDTH: ...)".
LIMITS = {
    "width": "MAX_WIDTH: far wider than any real model",
    "heads": "MAX_HEADS: far more heads than any real model",
    "layers": "MAX_LAYERS: far more layers than any real model",
    "vocab": "MAX_VOCAB: a far larger vocabulary than any real model's",
    "context": "MAX_CONTEXT: far more positions than any real model",
    "ffn": "MAX_FFN: far wider than any real model's MLP",
    "experts": "MAX_EXPERTS: far more experts than any real model",
}


def _show(value: Any, json: bool = False) -> str:
    if json and (value is None or isinstance(value, bool)):  # as the file spells them
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int) and value.bit_length() > 256:  # (repr of a 5,000-digit int raises ValueError)
        return f"{'-' if value < 0 else ''}<an integer of {int(value.bit_length() * math.log10(2)) + 1:,} digits>"
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # a list holding such an int, or nested past the recursion limit
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= 80 else text[:77] + "..."


class Values:
    """Typed reads of one file's values: ``integer``, ``number``, ``text``, ``flag``, ``token_id``."""

    def __init__(self, where: str | Any, *, json: bool = False) -> None:
        self.where = str(where)
        self.json = json  # show null, true and false as a JSON file spells them

    def fail(self, key: str, value: Any, expected: str) -> MultiheadError:
        return MultiheadError(f"{self.where!r}: {key} = {_show(value, self.json)}: expected {expected}")

    def integer(self, key: str, value: Any, *, low: int = 0, high: int = 1 << 62, limit: str = "") -> int:
        """An integer in [low, high]: a bool, a float (even 12.0), a string or null is refused. ``limit`` names
        the upper bound in the message (a key of :data:`LIMITS`, or a text)."""
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            why = LIMITS.get(limit, limit)
            raise self.fail(key, value, f"an integer from {low:,} to {high:,}" + (f" ({why})" if why else ""))
        return value

    def number(self, key: str, value: Any, *, low: float = -math.inf, high: float = math.inf,
              open_low: bool = False) -> float:
        """A finite number in [low, high] ((low, high] with ``open_low``); ints are accepted."""
        bound = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, value, f"a finite number in {bound}")
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            raise self.fail(key, value, f"a finite number in {bound}") from None
        if not math.isfinite(number) or number < low or number > high or (open_low and number == low):
            raise self.fail(key, value, f"a finite number in {bound}")
        return number

    def text(self, key: str, value: Any) -> str:
        if not isinstance(value, str):
            raise self.fail(key, value, "a string")
        return value

    def flag(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool | int) or value not in (0, 1):
            raise self.fail(key, value, "true or false")
        return bool(value)

    def token_id(self, key: str, value: Any, vocab: int) -> int | None:
        """None, or a token id of the vocabulary."""
        if value is None:
            return None
        return self.integer(key, value, low=0, high=vocab - 1)

    def strings(self, key: str, value: Any) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(key, value, "a list of strings")
        return value

    def integers(self, key: str, value: Any) -> list[int]:
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.fail(key, value, "a list of integers")
        return value
