"""HybridCache: one cache per kind of layer of a model whose layers attend over different windows (Gemma 2 and 3
alternate sliding and global layers; Mistral slides every layer), so each layer stores what it can see.

::

    windows  [512, 512, 512, 512, 512, None, ...]        each layer's attention window (None: global)
    parts    {None: KVCache(3 layers, max_len),           the global layers: every key
              512: SinkCache(15 layers, window=512)}      a sliding layer of window W: a ring of its last W - 1 keys

A model step is made once per window (:class:`multihead.hf.cache.MultiheadCache` keeps one step per window):
``reserve(s, attention_window=w)`` reserves the slots of the part of window ``w``, and a layer's ``update`` goes to
its part with those slots. ``advance`` commits every part. The parts are of one kind (full, quantized, sinks +
window) with each part's own form of it: :func:`multihead.hf.cache.new_cache` builds them (a full cache's sliding
part is a ring of the window, a quantized cache's a ring of code groups, :class:`~.quantized.QuantizedKVCache` with
``window``), so ``bytes`` equals transformers' own cache after the same tokens (its sliding layers keep
``window - 1`` keys).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from torch import Tensor, nn

from multihead.cache.base import Cache, Slots
from multihead.cache.view import KVView
from multihead.errors import MultiheadError


def _key(window: int | None) -> str:
    return "global" if window is None else f"sliding_{window}"


class HybridCache(Cache):
    """Layers of several attention windows, each window's layers in a cache of their own (``parts``: window ->
    cache of that many layers, None the global layers); ``windows`` gives each layer's window in model order."""

    def __init__(self, parts: Mapping[int | None, Cache], windows: Sequence[int | None]) -> None:
        windows = list(windows)
        counts: dict[int | None, int] = {}
        for w in windows:
            counts[w] = counts.get(w, 0) + 1
        if set(counts) != set(parts):
            raise MultiheadError(f"a HybridCache's parts are for windows {sorted(map(str, parts))} but its layers "
                                 f"have windows {sorted(map(str, counts))}: give one part per window")
        for w, part in parts.items():
            if not isinstance(part, Cache):
                raise MultiheadError(f"the part of window {w} must be a cache of keys and values, not "
                                     f"{type(part).__name__}")
            if part.n_layers != counts[w]:
                raise MultiheadError(f"the part of window {w} holds {part.n_layers} layers but {counts[w]} layers "
                                     "have that window")
        first = next(iter(parts.values()))
        for w, part in parts.items():
            if (part.batch, part.n_kv_heads, part.head_dim) != (first.batch, first.n_kv_heads, first.head_dim):
                raise MultiheadError(f"the parts of a HybridCache must share (batch, n_kv_heads, head_dim): window "
                                     f"{w}'s {(part.batch, part.n_kv_heads, part.head_dim)} against "
                                     f"{(first.batch, first.n_kv_heads, first.head_dim)}")
        global_part = parts.get(None)
        super().__init__(batch=first.batch, n_kv_heads=first.n_kv_heads, head_dim=first.head_dim,
                         n_layers=len(windows), max_len=global_part.max_len if global_part is not None else None,
                         device=first.lengths.device)
        self.windows = windows
        self.parts = nn.ModuleDict({_key(w): part for w, part in parts.items()})
        seen: dict[int | None, int] = {}
        self._where: list[tuple[int | None, int]] = []  # layer -> (its window, its index in that part)
        for w in windows:
            self._where.append((w, seen.get(w, 0)))
            seen[w] = seen.get(w, 0) + 1
        self.positional = all(part.positional for part in parts.values())

    def part(self, window: int | None) -> Cache:
        """The cache of the layers of this window (None: the global layers)."""
        key = _key(window)
        if key not in self.parts:
            have = ", ".join(str(w) for w in dict.fromkeys(self.windows))
            raise MultiheadError(f"this HybridCache has no layer of window {window}: its layers' windows are {have} "
                                 "(a step is made per window: reserve(s, attention_window=w))")
        return cast(Cache, self.parts[key])

    def _parts(self) -> list[Cache]:
        return [cast(Cache, p) for p in self.parts.values()]

    @property
    def bytes(self) -> int:
        return sum(part.bytes for part in self._parts())

    def reset(self) -> None:
        super().reset()
        for part in self._parts():
            part.reset()

    def reserve(self, s: int, positions: Tensor | None = None, *, need_positions: bool = False,
                attention_window: int | None = None, validate: bool = True, shortcuts: bool = True) -> Slots:
        """The slots of the part whose layers have this ``attention_window`` (the step's; None for the global
        layers): the steps of one forward pass are made one per window, each checking that every part has room."""
        self.check_room(s)
        return self.part(attention_window).reserve(s, positions, need_positions=need_positions,
                                                   attention_window=attention_window, validate=validate,
                                                   shortcuts=shortcuts)

    def next_positions(self, s: int) -> Tensor:
        self.check_room(s)
        return self._parts()[0].next_positions(s)

    def check_room(self, s: int) -> None:
        for part in self._parts():
            part.check_room(s)

    def update(self, layer: int, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False) -> KVView:
        """Layer ``layer``'s update in its window's part, with the slots that part reserved."""
        self._check_layer(layer)
        window, index = self._where[layer]
        return self.part(window).update(index, k, v, slots, read_only=read_only)

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        parts = self._parts()
        for part in parts:
            part.advance(s, lengths=lengths)
        self._follow(parts[0])

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{'global' if w is None else f'window {w}'}: {type(self.part(w)).__name__} of "
                          f"{self.part(w).n_layers} layers" for w in dict.fromkeys(self.windows))
        return f"{kinds}, bytes={self.bytes:,}"
