"""Values read from checkpoint files, checked where they are read: type, range, and (by the callers) agreement
with the tensors they describe, before anything is allocated from them.

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


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Values:
    """Typed reads of one file's values: ``integer``, ``number``, ``text``, ``flag``, ``token_id``."""

    def __init__(self, where: str | Any) -> None:
        self.where = str(where)

    def fail(self, key: str, value: Any, expected: str) -> MultiheadError:
        return MultiheadError(f"{self.where!r}: {key} = {_show(value)}: expected {expected}")

    def integer(self, key: str, value: Any, *, low: int = 0, high: int = 1 << 62) -> int:
        """An integer in [low, high]: a bool, a float (even 12.0), a string or null is refused."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, value, f"an integer from {low:,} to {high:,}")
        if not low <= value <= high:
            raise self.fail(key, value, f"an integer from {low:,} to {high:,}")
        return value

    def number(self, key: str, value: Any, *, low: float = -math.inf, high: float = math.inf,
              open_low: bool = False) -> float:
        """A finite number in [low, high] ((low, high] with ``open_low``); ints are accepted."""
        bound = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, value, f"a finite number in {bound}")
        number = float(value)
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
