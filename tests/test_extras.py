"""`import multihead` needs torch and numpy only; the models, head tools and plots say which extra they need."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

# every finder answers "no such module" for the blocked packages, as when they are not installed
BLOCK = """
import sys
class Hidden:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {%s}:
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
"""


def _run(code: str, blocked: set[str]) -> subprocess.CompletedProcess[str]:
    names = ", ".join(repr(n) for n in sorted(blocked))
    return subprocess.run([sys.executable, "-c", BLOCK % names + code], capture_output=True, text=True, timeout=120,
                          check=False)


def test_the_core_imports_and_runs_with_torch_and_numpy_only() -> None:
    blocked = {"safetensors", "tokenizers", "gguf", "jinja2", "matplotlib", "tqdm", "transformers"}
    done = _run("""
import torch, multihead
from multihead import MultiHeadAttention, KVCache
from multihead.layers import hooks
from multihead.sizing import cost, presets
from multihead.sizing.shapes import shape_walk
from multihead.cli import main
layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2)
_, cache = hooks.run_with_cache(layer, torch.randn(1, 3, 32))
assert len(cache) == 6
assert main(["shapes", "--d-model", "64", "--heads", "4"]) == 0
print("ok", sorted(m for m in sys.modules if m.split('.')[0] in {'safetensors', 'tokenizers', 'gguf', 'jinja2',
                                                                   'matplotlib', 'tqdm'}))
""", blocked)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok []")


def test_a_part_whose_extra_is_missing_names_the_extra() -> None:
    done = _run("""
from multihead.cli import main
import multihead.errors
try:
    import multihead.models
except multihead.errors.MultiheadError as err:
    print(err)
raise SystemExit(main(["generate", "hi", "--max-new-tokens", "1"]))
""", {"gguf"})
    assert "needs 'gguf', which is not installed: pip install 'multihead[models]'" in done.stdout
    assert done.returncode == 2 and "pip install 'multihead[models]'" in done.stderr
    assert "Traceback" not in done.stderr


def _pyproject_extras() -> dict[str, set[str]]:
    """pyproject.toml's optional dependencies by extra, ``multihead[...]`` expanded (packaging parses each line)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[1]
    table = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]

    def expand(extra: str) -> set[str]:
        out: set[str] = set()
        for line in table[extra]:
            req = Requirement(line)
            out |= set().union(*map(expand, req.extras)) if req.name == "multihead" else {req.name}
        return out

    return {extra: expand(extra) for extra in table}


def test_extras_are_pyprojects_optional_dependencies() -> None:
    from multihead.errors import EXTRAS

    assert {extra: set(names) for extra, names in EXTRAS.items()} == _pyproject_extras(), (
        "EXTRAS differs from pyproject.toml: after editing it, reinstall (the installed metadata is what is read)")
    assert all(len(set(names)) == len(names) for names in EXTRAS.values())


def test_without_the_installed_metadata_the_extras_come_from_the_checkouts_pyproject(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.metadata

    from multihead.errors import _read_extras

    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", absent)
    assert {extra: set(names) for extra, names in _read_extras().items()} == _pyproject_extras()
    assert _read_extras(tmp_path / "pyproject.toml") == {}  # nor a checkout: nothing known, nothing checked up front
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n[project.optional-dependencies]\nx = ["y"]\n')
    assert _read_extras(tmp_path / "pyproject.toml") == {}


def test_the_packages_the_parts_check_are_importable_by_those_names() -> None:
    from multihead.errors import EXTRAS

    for extra in ("models", "heads"):  # each imports them by these names (require_extra)
        assert EXTRAS[extra] and all(importlib.util.find_spec(name) is not None for name in EXTRAS[extra]), extra
