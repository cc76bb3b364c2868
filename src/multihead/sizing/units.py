"""Reading and writing sizes for people: bytes with units, large counts."""

from __future__ import annotations

import re
from decimal import Decimal

from multihead.errors import MultiheadError

MAX_BYTES = 2**80
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # a bare letter, as nvidia-smi, Slurm and docker write memory: powers of 1024 (a "24G" card holds 24 GiB)
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_bytes(text: str) -> int:
    """'80GB' -> 80 * 10**9, '24GiB' -> 24 * 2**30, '24G' -> 24 * 2**30 (a bare K, M, G or T is binary, as
    nvidia-smi and Slurm mean it), '1e9' -> 10**9 (decimal and binary units; no unit = bytes)."""
    if str(text).strip().startswith("-"):
        raise MultiheadError(f"size {text!r} is negative: give a size of more than 0 bytes, e.g. 24GiB")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]{1,5})?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise MultiheadError(
            f"size {text!r} is not understood: write a number with one of the units B, KB, MB, GB, TB "
            "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024; also K, M, G, T), e.g. 80GB or 24GiB"
        )
    value = Decimal(m.group(1)) * _UNITS[unit]  # exact: '1e400' is a number, not infinity
    if value > MAX_BYTES:
        raise MultiheadError(f"size {text!r} is larger than any memory ({MAX_BYTES:,} bytes, 1 YiB, at most)")
    return int(value)


def format_bytes(n: float) -> str:
    """Binary units: 524288 -> '512.0 KiB'; past YiB, powers of ten: '3.2e+06 YiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"):
        if abs(n) < 1024 or unit == "YiB":
            if unit == "B":
                return f"{n:.0f} {unit}"
            return f"{n:.1f} {unit}" if abs(n) < 10_000 else f"{n:.2g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_count(n: float, unit: str = "") -> str:
    """1.23e12 -> '1.23 T' (with the unit after the prefix); past 10^18, powers of ten."""
    n = float(n)
    if abs(n) >= 1e18:
        return f"{n:.3g} {unit}".rstrip()
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()
