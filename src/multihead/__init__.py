"""multihead: multi-head attention for PyTorch (MHA, GQA and MQA in one layer; MLA beside it).

The names below load on first use (PEP 562), so that importing a part that needs no torch (``multihead.cli`` for
``multihead --help``, ``multihead.errors``, ``multihead.names``) does not pay torch's import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multihead.cache import HeadPlan, HeadwiseCache, KVCache, LatentCache, QuantizedKVCache, SinkCache
    from multihead.config import AttentionConfig, MLAConfig, RopeConfig
    from multihead.errors import MultiheadError
    from multihead.kernels import KernelChoice
    from multihead.layers.attention import MultiHeadAttention
    from multihead.layers.latent import MultiHeadLatentAttention

__all__ = ["AttentionConfig", "HeadPlan", "HeadwiseCache", "KVCache", "KernelChoice", "LatentCache", "MLAConfig",
           "MultiHeadAttention", "MultiHeadLatentAttention", "MultiheadError", "QuantizedKVCache", "RopeConfig",
           "SinkCache"]
__version__ = "0.1.0"

# each public name -> the module that defines it
_WHERE = {
    "MultiHeadAttention": "layers.attention", "MultiHeadLatentAttention": "layers.latent", "KernelChoice": "kernels",
    "AttentionConfig": "config", "MLAConfig": "config", "RopeConfig": "config", "MultiheadError": "errors",
    **{name: "cache" for name in ("HeadPlan", "HeadwiseCache", "KVCache", "LatentCache", "QuantizedKVCache",
                                  "SinkCache")},
}


def __getattr__(name: str) -> Any:
    """A public name from its module, or a submodule (``multihead.sizing.cost`` after a bare ``import multihead``)."""
    if name in _WHERE:
        value = getattr(importlib.import_module(f"multihead.{_WHERE[name]}"), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"multihead.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"multihead.{name}":
                raise
            raise AttributeError(f"module 'multihead' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'multihead' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
