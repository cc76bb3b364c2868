"""The library's one exception type, and the optional parts' check for what they need."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from pathlib import Path
from types import ModuleType

_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"  # there in a source checkout only


def _read_extras(pyproject: Path = _PYPROJECT) -> dict[str, tuple[str, ...]]:
    """pyproject.toml's [project.optional-dependencies]: each extra's packages, with ``multihead[...]`` expanded and
    versions dropped.

    Read from the installed distribution's metadata (its ``Requires-Dist: name; extra == "..."`` lines); where
    multihead is not installed, from the pyproject.toml of the source checkout it runs from; where neither is there
    (or Python 3.10 has no tomllib to read it), no extras are known and the optional parts skip their check, so a
    missing package fails at its own import instead of naming the extra.
    """
    direct: dict[str, list[str]] = {}
    try:
        for line in importlib.metadata.requires("multihead") or []:
            requirement, _, marker = line.partition(";")
            extra = re.search(r"""\bextra\s*==\s*['"]([^'"]+)['"]""", marker)
            if extra is not None:  # the others are the core dependencies
                direct.setdefault(extra[1], []).append(requirement)
    except importlib.metadata.PackageNotFoundError:
        try:
            import tomllib
        except ImportError:
            return {}
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}) if pyproject.is_file() else {}
        if project.get("name") != "multihead":
            return {}
        direct = project.get("optional-dependencies", {})

    def packages(extra: str, seen: frozenset[str]) -> list[str]:
        out: list[str] = []
        for requirement in direct.get(extra, []):
            found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
            if found is None:
                continue
            name, extras = found[1], found[2]
            if re.sub(r"[-_.]+", "-", name).lower() != "multihead":
                out.append(name)
                continue
            for inner in sorted(e.strip() for e in (extras or "").split(",") if e.strip()):
                if inner not in seen:
                    out += packages(inner, seen | {inner})
        return list(dict.fromkeys(out))

    return {extra: tuple(packages(extra, frozenset({extra}))) for extra in direct}


# the optional parts of multihead and the packages each needs beyond torch and numpy (pyproject.toml's extras; the
# parts' packages are imported by these names)
EXTRAS = _read_extras()


class MultiheadError(ValueError):
    """A bad input to multihead: the message names the values involved and, where there is one, the fix.

    It subclasses ValueError so that code which already catches ValueError keeps working.
    """


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``, or raise a MultiheadError saying which extra of multihead brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MultiheadError(f"this part of multihead needs {module.split('.')[0]!r}, which is not installed: "
                             f"pip install 'multihead[{extra}]'") from err


def require_extra(extra: str) -> None:
    """Import every package that the extra brings (EXTRAS), or raise a MultiheadError naming the extra for the first
    one missing. Checks nothing where multihead's metadata is absent (EXTRAS is then empty)."""
    for module in EXTRAS.get(extra, ()):
        require(module, extra)
