"""SinkCache: attention sinks plus a sliding window (StreamingLLM, Xiao et al. 2023), at constant memory."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from multihead.cache.base import Cache, Slots, check_count
from multihead.cache.view import DenseKV
from multihead.errors import MultiheadError


class SinkCache(Cache):
    """Attention sinks plus a sliding window (StreamingLLM, Xiao et al. 2023), at constant memory.

    Each layer keeps the first ``sink_tokens`` tokens of every sequence and the last ``window - 1`` ones, in
    ``sink_tokens + window - 1`` slots; a query at position p sees the sinks and the keys in ``(p - window, p]``
    (itself included)::

        sees(p, j) = j <= p and (j > p - window or j < sink_tokens)

    ``sink_tokens=0`` is a plain sliding window (the cache StreamingLLM shows failing once the first tokens leave
    it; with the layer's own window, what a sliding layer of Gemma 2/3 or Mistral can see: transformers' sliding
    layers keep the same ``window - 1`` keys). ``max_len``: the tokens the cache is for, when known, so a run
    shorter than the window allocates no more slots than it fills (and more tokens raise, as a KVCache's do).
    Keys keep the positions they had in the text (RoPE is applied before they are cached), so this equals
    the uncached model under the mask above (:func:`sink_keep`), token for token. The sequences of a batch hold one
    length (prompts of different lengths: one cache each). :meth:`update` keeps a step's tokens beside the slots
    until :meth:`advance` places the ones that stay, so a chunk of many tokens attends exactly as one token at a
    time would.
    """

    addressed = False
    positional = False
    k: Tensor
    v: Tensor
    slot_positions: Tensor

    def __init__(self, *, batch: int, n_kv_heads: int, head_dim: int, window: int, sink_tokens: int = 4,
                 n_layers: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, max_len: int | None = None) -> None:
        super().__init__(batch=batch, n_kv_heads=n_kv_heads, head_dim=head_dim, n_layers=n_layers, max_len=max_len,
                         device=device)
        self.window = check_count("window", window, least=1)
        self.sink_tokens = check_count("sink_tokens", sink_tokens, least=0)
        if sink_tokens > window:
            raise MultiheadError(f"sink_tokens ({sink_tokens}) must not exceed the window ({window}): the sinks are "
                                 "a few first tokens kept beside a longer window")
        slots = sink_tokens + window - 1  # a new token joins them: it sees the sinks and the last `window` keys
        if max_len is not None:
            slots = min(slots, max_len)  # a run of max_len tokens never fills more (a ring slot is then its position)
        shape = (n_layers, batch, n_kv_heads, slots, head_dim)  # (L, b, g, slots, d)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # the text position each slot holds (-1: empty); slots fill in order, so the held ones are a prefix
        self.register_buffer("slot_positions", torch.full((slots,), -1, dtype=torch.long, device=device),
                             persistent=False)
        self._held = 0
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def capacity(self) -> int:
        """Tokens held between steps: the sinks and the ``window - 1`` keys before the next token (at most
        ``max_len`` where one is given: the tokens the cache is for)."""
        return int(self.k.shape[3])

    @property
    def bytes(self) -> int:
        """Bytes of the key and value slots: 2 * n_layers * b * g * (sink_tokens + window - 1) * d * element size."""
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        super().reset()
        self.slot_positions.fill_(-1)
        self._held = 0
        self._pending.clear()

    def _span(self, s: int) -> int:
        return self._held + s

    def _keep(self, q_positions: Tensor | None, s: int, attention_window: int | None) -> Tensor | None:
        return held_keep(self.slot_positions, self._held, q_positions, s, attention_window, window=self.window,
                         sink_tokens=self.sink_tokens, at=None if torch.compiler.is_compiling() else self._used)

    def update(self, layer: int, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False) -> DenseKV:
        """The held slots and the new keys and values (b, g, held + s, d); the new ones wait for :meth:`advance`
        (``read_only``: they are not kept)."""
        self._check_keys(layer, k)
        held = self._held
        keys = torch.cat([self.k[layer, :, :, :held], k.to(self.k.dtype)], dim=2)  # (b, g, held + s, d)
        values = torch.cat([self.v[layer, :, :, :held], v.to(self.v.dtype)], dim=2)
        if not read_only:
            self._pending[layer] = (k, v)
        return DenseKV(keys, values)

    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Keep the sinks and the last ``window`` tokens of what the layers wrote this step; evict the rest."""
        self._check_commit(s, lengths, self._pending)
        keep_sinks_and_window(self._pending, lambda layer: (self.k[layer], self.v[layer]), self.slot_positions,
                              first=self._used, s=s, sink_tokens=self.sink_tokens, window=self.window)
        self._pending.clear()
        self._held = min(self._used + s, self.capacity)
        super().advance(s)

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, n_kv_heads={self.n_kv_heads}, "
                f"sink_tokens={self.sink_tokens}, window={self.window}, head_dim={self.head_dim}, "
                f"dtype={self.k.dtype}, bytes={self.bytes:,}")


def ring_slot(p: int, *, sink_tokens: int, window: int) -> int:
    """Slot of position p in a sinks + window store: the sinks in order, then a ring of ``window - 1`` slots."""
    if p < sink_tokens:
        return p
    return sink_tokens + (p - sink_tokens) % (window - 1)


def held_keep(slot_positions: Tensor, held: int, q_positions: Tensor | None, s: int, attention_window: int | None,
              *, window: int, sink_tokens: int, at: int | None = None) -> Tensor | None:
    """The keep (1, 1, s, held + s) of ``s`` new queries over a sinks + window store's ``held`` slots (their
    positions in ``slot_positions``) and the new keys: the store's ``sink_tokens`` and last ``window`` tokens,
    within ``attention_window``, the layer's own (None: global; a key past it is not seen, sinks included), or None
    when each query sees every held slot. ``at``: the first new position where the host knows it (a sink is within
    the layer's window until the queries pass it)."""
    sinks_seen = (sink_tokens == 0 or (at is not None and at < attention_window) if attention_window is not None
                  else True)
    if s == 1 and (attention_window is None or (attention_window >= window and sinks_seen)):
        return None  # one new token sees every held slot: the slots are exactly its sinks and window
    assert q_positions is not None
    new = q_positions[0]  # (s,): the sequences hold one length
    keys = torch.cat([slot_positions[:held], new])  # (t,)
    return sink_keep(new, keys, window=window, sink_tokens=sink_tokens, attention_window=attention_window)[None, None]


def keep_sinks_and_window(pending: Mapping[int, tuple[Tensor, Tensor]],
                          store: Callable[[int], tuple[Tensor, Tensor]], slot_positions: Tensor, *, first: int,
                          s: int, sink_tokens: int, window: int) -> None:
    """Commit a step of ``s`` tokens from position ``first`` to a sinks + window store (:class:`SinkCache`, the
    streaming heads of a head-wise cache): of what each layer wrote (``pending``: layer -> (k, v), (b, g, s, d)),
    the sink positions and the last ``window - 1`` are copied to their :func:`ring_slot` in ``store(layer)``'s
    (keys, values), (b, g, slots, d), and ``slot_positions`` records the position each slot now holds; the rest is
    evicted."""
    ring = window - 1
    kept = [(i, p) for i, p in enumerate(range(first, first + s))
            if p < sink_tokens or (ring and p >= first + s - ring)]
    if not kept or not pending:
        return
    device = slot_positions.device
    index = torch.tensor([i for i, _ in kept], device=device)
    slots = torch.tensor([ring_slot(p, sink_tokens=sink_tokens, window=window) for _, p in kept], device=device)
    for layer, (k, v) in pending.items():
        keys, values = store(layer)
        keys.index_copy_(2, slots, k.index_select(2, index).to(keys.dtype))
        values.index_copy_(2, slots, v.index_select(2, index).to(values.dtype))
    slot_positions.index_copy_(0, slots, torch.tensor([p for _, p in kept], device=device))


def sink_keep(q_positions: Tensor, k_positions: Tensor, *, window: int, sink_tokens: int,
              attention_window: int | None = None) -> Tensor:
    """(s, t) bool: query at position p may see the key at position j iff j <= p and (j > p - window or
    j < sink_tokens) (what a store of ``sink_tokens`` and the last ``window`` tokens holds), and, with an
    ``attention_window`` (a sliding layer's own), j > p - attention_window. With k_positions = q_positions = 0..n-1
    it is the uncached model's mask for a :class:`SinkCache`."""
    q = q_positions[:, None]  # (s, 1)
    j = k_positions[None, :]  # (1, t)
    keep = (j <= q) & ((j > q - window) | (j < sink_tokens)) & (j >= 0)
    return keep if attention_window is None else keep & (j > q - attention_window)
