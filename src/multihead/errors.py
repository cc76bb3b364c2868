"""The library's one exception type."""

from __future__ import annotations

import importlib
from types import ModuleType

# the optional parts of multihead and what each needs beyond torch and numpy (pyproject.toml's extras)
EXTRAS = {
    "models": ("safetensors", "tokenizers", "gguf", "jinja2"),
    "heads": ("safetensors", "tokenizers", "gguf", "jinja2", "matplotlib", "tqdm"),
    "plots": ("matplotlib",),
    "hf": ("transformers",),
}


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
