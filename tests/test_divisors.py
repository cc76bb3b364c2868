"""multihead.divisors: the divisors behind the messages that suggest valid head counts."""

from __future__ import annotations

from multihead.divisors import divisors


def test_divisors_come_from_the_factorisation_and_match_brute_force() -> None:
    for n in range(1, 3001):
        assert divisors(n) == [k for k in range(1, n + 1) if n % k == 0]
    assert len(divisors(10**12)) == 169 and len(divisors(10**30)) == 961  # answered at once, not by n divisions
    p, q = 2**61 - 1, 2**31 - 1  # two Mersenne primes: Pollard's rho splits their product
    assert divisors(p * q) == [1, q, p, p * q]
    assert divisors(0) == [] and divisors(-4) == []
