"""Names shared by the command line and the head tools, in a module that imports nothing (so the CLI can use them
without loading the models): the head engines and how a head is written for people."""

from __future__ import annotations

ENGINES = ("auto", "ours", "transformers")  # multihead.heads.adapters.load_head_model(engine=...)


def head_name(layer: int, head: int, *, kv: bool = False) -> str:
    """A head as TransformerLens writes it: layer 0, head 11 -> 'L0H11'; a key/value head -> 'L0KV3'."""
    return f"L{layer}{'KV' if kv else 'H'}{head}"
