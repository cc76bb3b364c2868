"""LayeredCache: one single-layer cache per layer, for models whose layers hold different numbers of KV heads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from torch import Tensor, nn

from multihead.cache.base import Cache, Slots
from multihead.cache.view import KVView
from multihead.errors import MultiheadError


class LayeredCache(Cache):
    """One single-layer cache per layer, for models whose layers hold different numbers of KV heads (a pruned model):
    every part is the same kind and advances together, so the slots of a step (positions, masks, spans) is the
    first part's, and each layer's update goes to its own part."""

    def __init__(self, parts: Sequence[Cache]) -> None:
        parts = list(parts)
        if not parts or any(not isinstance(p, Cache) or p.n_layers != 1 for p in parts):
            raise MultiheadError("a LayeredCache takes one single-layer cache per layer")
        first = parts[0]
        if any(type(p) is not type(first) or p.batch != first.batch or p.head_dim != first.head_dim for p in parts):
            raise MultiheadError("the parts of a LayeredCache must be of one kind, batch and head_dim")
        super().__init__(batch=first.batch, n_kv_heads=first.n_kv_heads, head_dim=first.head_dim,
                         n_layers=len(parts), max_len=first.max_len, device=first.lengths.device)
        self.parts = nn.ModuleList(parts)
        self.positional = first.positional

    def _part(self, index: int) -> Cache:
        return cast(Cache, self.parts[index])

    @property
    def bytes(self) -> int:
        return sum(self._part(i).bytes for i in range(self.n_layers))

    def layer_kv_heads(self, index: int) -> int:
        return self._part(index).n_kv_heads

    def reset(self) -> None:
        super().reset()
        for i in range(self.n_layers):
            self._part(i).reset()

    def reserve(self, s: int, positions: Tensor | None = None, *, need_positions: bool = False,
                attention_window: int | None = None, validate: bool = True, shortcuts: bool = True) -> Slots:
        return self._part(0).reserve(s, positions, need_positions=need_positions, attention_window=attention_window,
                                     validate=validate, shortcuts=shortcuts)

    def next_positions(self, s: int) -> Tensor:
        return self._part(0).next_positions(s)

    def check_room(self, s: int) -> None:
        self._part(0).check_room(s)

    def update(self, layer: int, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False) -> KVView:
        self._check_layer(layer)
        return self._part(layer).update(0, k, v, slots, read_only=read_only)

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        for i in range(self.n_layers):
            self._part(i).advance(s, lengths=lengths)
        self._follow(self._part(0))
