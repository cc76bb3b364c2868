"""``python -m multihead.kernels.native build``: build the native CPU kernels for this CPU (the explicit step; a forward
never builds them) and say where they are, or why they cannot be had (exit status 1). ``python -m
multihead.kernels.native`` alone says whether they are built."""

from __future__ import annotations

import sys

from multihead.kernels import native


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["build"]):
        print(f"usage: python -m multihead.kernels.native [build] (got {' '.join(args)!r})", file=sys.stderr)
        return 2
    why = native.build_now() if args == ["build"] else native.unavailable()
    if why is not None:
        print(f"multihead's native CPU kernels are not available: {why}", file=sys.stderr)
        return 1
    name = native.loaded_variant()
    assert name is not None
    print(f"multihead's native CPU kernels: variant {name}, {native.built(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
