"""`import multihead` needs torch and numpy only; the models, head tools and plots say which extra they need."""

from __future__ import annotations

import subprocess
import sys

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
from multihead import MultiHeadAttention, KVCache, cost, hooks, presets
from multihead.shapes import shape_walk
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
