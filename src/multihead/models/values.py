"""The typed, ranged reads of file values, kept here for the code that imports them from this path: they live in
:mod:`multihead.values` (the core), so that the config reader and the model loaders check values the same way."""

from multihead.values import MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, Values

__all__ = ["MAX_CONTEXT", "MAX_HEADS", "MAX_LAYERS", "MAX_VOCAB", "MAX_WIDTH", "Values"]
