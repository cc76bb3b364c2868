"""The positive divisors of an integer, from its prime factorisation (for the messages that suggest valid head counts,
e.g. "choose n_kv_heads in 1, 2, 4, 8")."""

from __future__ import annotations

import math


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending (used to suggest valid head counts in messages).

    Made from n's prime factorisation (trial division by small primes, then Miller-Rabin and Pollard's rho), so a
    width of 10^12 or 10^30 answers at once instead of dividing by every number up to n.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return []
    out = [1]
    for prime, power in sorted(_factorise(n).items()):
        out = [d * prime**e for d in out for e in range(power + 1)]
    return sorted(out)


def _factorise(n: int) -> dict[int, int]:
    factors: dict[int, int] = {}
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    stack = [n] if n > 1 else []
    while stack:
        m = stack.pop()
        if _is_prime(m):
            factors[m] = factors.get(m, 0) + 1
            continue
        d = _rho(m)
        stack += [d, m // d]
    return factors


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first 12 primes as bases: exact below 3.3 * 10^24, and wrong past it with a
    probability below 4^-12."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n in small:
        return True
    if any(n % p == 0 for p in small):
        return False
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _rho(n: int) -> int:
    """A non-trivial factor of the composite n (Pollard's rho, Brent's cycle finding)."""
    for c in range(1, 100):
        y, m, g, r, q = 2, 128, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += m
            r *= 2
        if g == n:
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise ValueError(f"no factor found for {n}")  # not reached for composites
