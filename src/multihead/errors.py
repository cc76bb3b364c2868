"""The library's one exception type."""

from __future__ import annotations


class MultiheadError(ValueError):
    """A bad input to multihead: the message names the values involved and, where there is one, the fix.

    It subclasses ValueError so that code which already catches ValueError keeps working.
    """


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending (used to suggest valid head counts in messages)."""
    return [k for k in range(1, n + 1) if n % k == 0]
