"""The cache protocol: what every kind shares, and the one way a model step uses a cache.

::

    slots = cache.reserve(s)                     once per step (multihead.layers.step.build_step): where the s new
                                                 tokens go, how many keys each layer reads, which keys each query
                                                 sees
    view  = cache.layer(i).update(k, v, slots)   in every layer, one verb: place the layer's new keys and values
                                                 and get back a view of what the layer attends to, the new ones
                                                 included (:mod:`multihead.cache.view`)
    cache.advance(s)                             once, after the step: the commit (``lengths=`` for a padded prompt)

Caches only store. A kind says how it holds tokens and returns them in that form: :class:`~.view.DenseKV` (every
key a row: the full and sink caches), :class:`~.view.QuantizedKV` (codes, scales and a full-precision tail),
:class:`~.view.GroupedKV` (a head-wise layer: each group of KV heads its own keys). Which kernel reads a view is
:func:`multihead.kernels.attend`'s decision alone; no cache imports a kernel, and the layer never asks which kind
it holds.

One rule for every kind: ``update`` returns what the step attends to, and the tokens it placed count as held only
when ``advance`` commits them. Until then the cache holds what it held before the step: :class:`~.full.KVCache`
places them in room its lengths do not count (each sequence's slots from its length on), the sink and quantized
caches keep them beside what they store. A step that is never advanced (a later layer raised; ``explain``) leaves the
held tokens as they were, and the next step's update replaces what it placed. Positions given to a slot-addressed
kind (:attr:`BaseCache.addressed`) name its slots, held or not, and are written where they point: that is how a
caller rewrites a sequence's past. ``update(..., read_only=True)`` returns the same view from a copy and places
nothing (``explain``).

Per-sequence lengths live on the device (``lengths``, read by the kernels' masks) and on the host (``used``, the
longest, and whether all are equal), so overflow and the slice write are decided without a device sync.

The head-wise kind (:class:`~.headwise.HeadwiseCache`: each KV head of a layer full, or sinks + window): its KV
heads hold different numbers of keys, so one layer's keys are not one (b, g, t, d) tensor. It reserves one
:class:`Slots` per kind of KV head (``Slots.parts``, each with its own t and mask, made by the cache at reserve)
and its layers' update returns a :class:`~.view.GroupedKV`, one group per kind present, each group carrying its
keys, values and mask; the kernels attend once per group, with the query heads of that group's KV heads, and put z
back in head order. The step and the kernels' call know no cache kind: the view carries what differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from multihead.cache.view import KVView
from multihead.errors import MultiheadError
from multihead.layers.masks import MaskSpec


@dataclass(frozen=True)
class Slots:
    """One step's slots in a cache, reserved once (:meth:`BaseCache.reserve`) and used by every layer of the step.

    ``s`` new tokens per sequence; ``t`` the keys each layer holds after its update; ``positions`` (b, s) the new
    tokens' text positions, None when nothing reads them (no RoPE, a slice write, a plain causal mask); ``start``
    the slot where every sequence continues (one slice copy), None to place by positions; ``aligned`` True when the
    queries are the last s of the t keys of every sequence (a plain bottom-right causal mask is exact, no mask by
    positions); ``positional`` True when slot j holds position j (the causal mask by positions is right), False for a
    kind that evicts, whose ``keep`` ((b|1, 1, s, t) bool, None: every key) is then the whole mask. ``mask``: the
    step's mask when the cache makes it itself (a head-wise cache: its first part's), None when the step makes it
    from the fields above. ``parts``: a head-wise kind's own slots, one Slots per kind of KV head
    (:class:`~.headwise.HeadwiseCache`: full, streaming; None for a kind no layer has), each with its own t and
    mask, which its layers' views carry (:class:`~.view.KVGroup`); None for the one-group kinds. Only the cache that
    reserved them reads ``parts``.
    """

    s: int
    t: int
    positions: Tensor | None
    start: int | None
    aligned: bool
    positional: bool = True
    keep: Tensor | None = None
    mask: MaskSpec | None = None
    parts: tuple[Slots | None, ...] | None = None


def check_count(name: str, value: object, *, least: int) -> int:
    """``value`` as an int of at least ``least``, or a MultiheadError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MultiheadError(f"{name} ({value!r}) must be an int of at least {least}")
    return value


def write_slots(slots: Slots, dim: int, *pairs: tuple[Tensor, Tensor]) -> None:
    """Place each ``new`` (b, .., s, ..) into its ``store`` (b, .., T, ..), ``pairs`` of (store, new), along ``dim``
    (1 or 2): one slice copy from ``slots.start``, or each sequence's tokens at its own ``slots.positions`` (b, s)."""
    if slots.start is not None:  # one slice of slots, no index arithmetic
        for store, new in pairs:
            store.narrow(dim, slots.start, new.shape[dim]).copy_(new)
        return
    positions = slots.positions
    if positions is None:
        raise MultiheadError("a cache write needs the new tokens' positions, or the slot where all continue")
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]  # (b, 1)
    for store, new in pairs:
        if dim == 1:
            store[rows, positions] = new.to(store.dtype)  # (b, s, ..) slots
        else:
            store.transpose(1, dim)[rows, positions] = new.transpose(1, dim).to(store.dtype)  # (b, s, .., ..) slots


class BaseCache(nn.Module):
    """What every cache kind shares: per-sequence lengths, the host-known longest length, overflow checks, the
    step's slots (:meth:`reserve`), the commit (:meth:`advance`) and the views of its layers (:meth:`layer`).

    A kind says how it stores tokens through three answers: ``addressed`` (True: slot j holds position j of a
    sequence and positions may be given; False: new tokens always continue every sequence), ``positional`` (the
    causal mask by positions is right; False: the kind evicts and :meth:`_keep` says which keys each query sees) and
    :meth:`_span` (the keys a layer reads). Its layers' verb is ``update`` on the view :meth:`layer` returns.
    """

    lengths: Tensor
    addressed: ClassVar[bool] = True
    positional: bool = True

    def __init__(self, *, batch: int, n_layers: int, max_len: int | None, device: torch.device | str | None,
                 sizes: Sequence[tuple[str, int]] = ()) -> None:
        super().__init__()
        for name, value in (("batch", batch), *sizes, ("n_layers", n_layers)) + (
                (("max_len", max_len),) if max_len is not None else ()):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MultiheadError(f"{type(self).__name__} {name} ({value!r}) must be a positive int")
        self.register_buffer("lengths", torch.zeros(batch, dtype=torch.long, device=device), persistent=False)
        self.max_len = max_len
        self.n_layers = n_layers
        self._batch = batch
        self._used = 0  # the longest sequence, known on the host: overflow is checked without a device sync
        self._uniform = True  # every sequence holds _used tokens (known on the host)

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def used(self) -> int:
        """Tokens held by the longest sequence."""
        return self._used

    @property
    def bytes(self) -> int:
        """Bytes of the tensors that hold keys and values (what :mod:`multihead.sizing.cost` predicts for this kind)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every sequence (the buffers are reused, not reallocated)."""
        self.lengths.zero_()
        self._used = 0
        self._uniform = True

    # ------------------------------------------------------------------ the slots of a step
    def reserve(self, s: int, positions: Tensor | None = None, *, need_positions: bool = False,
                attention_window: int | None = None, validate: bool = True, shortcuts: bool = True) -> Slots:
        """Where the next s tokens of each sequence go and what each layer reads: made once per step, before any
        layer runs, and raises if the tokens would not fit.

        ``positions`` (b, s): the slots to write instead of each sequence's next ones (slot-addressed kinds only;
        integers in [0, max_len), range-checked when ``validate`` and not under torch.compile).
        ``need_positions``: the step reads the positions (RoPE), so they are made even where the write and the mask
        would not need them. ``attention_window``: the layers' own, for a kind that evicts. ``shortcuts``: sequences
        that all continue at one host-known length are written as one slice copy, and one sequence continuing at its
        length attends with a plain bottom-right causal mask instead of a mask by positions (the same keys either
        way; never under torch.compile, where the full length and positions decide); the step passes
        :func:`multihead.kernels.cpu.enabled`.
        """
        if positions is not None:
            if not self.addressed:
                raise MultiheadError(f"a {type(self).__name__} places new tokens after the cached ones: positions "
                                     "cannot be given")
            self._check_slots(positions, validate)
            return Slots(s=s, t=self._span(s), positions=positions, start=None, aligned=False)
        self.check_room(s)
        shortcuts = shortcuts and not torch.compiler.is_compiling()
        start = self._used if self.addressed and shortcuts and self._uniform else None
        aligned = self.positional and shortcuts and self.batch == 1
        pos = None
        if need_positions or start is None or not aligned:  # made only when RoPE, the write or the mask reads them
            pos = self.lengths[:, None] + torch.arange(s, device=self.lengths.device)  # (b, s)
        keep = None if self.positional else self._keep(pos, s, attention_window)
        return Slots(s=s, t=self._span(s), positions=pos, start=start, aligned=aligned, positional=self.positional,
                     keep=keep)

    def next_positions(self, s: int) -> Tensor:
        """Positions (b, s) of the next s tokens of each sequence; raises if they would not fit."""
        self.check_room(s)
        return self.lengths[:, None] + torch.arange(s, device=self.lengths.device)  # (b, s)

    def check_room(self, s: int) -> None:
        """Raise if s more tokens would not fit."""
        if self.max_len is not None and self._used + s > self.max_len:
            raise MultiheadError(
                f"KV cache overflow: {s} more token(s) after {self._used} would need {self._used + s} positions "
                f"but max_len is {self.max_len}: make a cache with a larger max_len, or reset() it"
            )

    def _span(self, s: int) -> int:
        """Keys a layer reads after placing s more tokens. Slot-addressed: max_len under torch.compile (fixed
        shapes), else the slots in use (less work for short sequences)."""
        assert self.max_len is not None
        return self.max_len if torch.compiler.is_compiling() else min(self.max_len, self._used + s)

    def _keep(self, q_positions: Tensor | None, s: int, attention_window: int | None) -> Tensor | None:
        """For a kind that evicts: which of the :meth:`_span` keys each query (b|1, s) may see, (b|1, 1, s, t)
        bool, or None when every query sees every key."""
        return None

    def _check_slots(self, pos: Tensor, validate: bool) -> None:
        """Positions that index the slots: integers in [0, max_len) (the range check reads the tensor, so it
        follows ``validate`` and is skipped under torch.compile)."""
        if pos.is_floating_point():
            raise MultiheadError(f"positions into a KV cache index its slots: they must be integers, not {pos.dtype}")
        if validate and self.max_len is not None and pos.numel() and not torch.compiler.is_compiling():
            low, high = int(pos.min()), int(pos.max())
            if low < 0 or high >= self.max_len:
                raise MultiheadError(f"positions from {low} to {high} fall outside the cache's slots: with max_len "
                                     f"{self.max_len} they must lie in 0 .. {self.max_len - 1}")

    # ------------------------------------------------------------------ the commit
    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Record that s tokens were written for every sequence, or set the real lengths of a padded prefill."""
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise MultiheadError(f"advance takes a non-negative number of tokens, got {s!r}")
        if lengths is None:
            self.check_room(s)
            self.lengths += s
            self._used += s
            return
        new = torch.as_tensor(lengths, dtype=torch.long)
        if new.shape != (self.batch,):
            raise MultiheadError(f"lengths of shape {tuple(new.shape)} must be (b,) = ({self.batch},)")
        longest = int(new.max())
        if longest > self._used + s or int(new.min()) < 0:
            raise MultiheadError(
                f"lengths {new.tolist()} must lie between 0 and the {self._used + s} positions written"
            )
        self.lengths.copy_(new.to(self.lengths.device))
        self._used = longest
        self._uniform = int(new.min()) == longest

    def _check_commit(self, s: int, lengths: Sequence[int] | Tensor | None, placed: Mapping[int, object]) -> None:
        """Before a kind that keeps a step's tokens beside its store commits them: one length for every sequence,
        and every layer placed its tokens."""
        if lengths is not None:
            new = torch.as_tensor(lengths, dtype=torch.long).flatten()
            if new.numel() and bool((new != self._used + s).any()):
                raise MultiheadError(f"a {type(self).__name__} holds sequences of one length: lengths {new.tolist()} "
                                     f"differ from the {self._used + s} positions written (decode prompts of other "
                                     "lengths with a cache each, or a KVCache)")
        missing = [i for i in range(self.n_layers) if i not in placed]
        if s and missing:
            raise MultiheadError(f"advance({s}) but layer(s) {missing} wrote nothing this step: every layer of the "
                                 "cache must run before it advances")

    def _follow(self, other: BaseCache) -> None:
        """Take another cache's lengths (a cache made of parts that advance together)."""
        self.lengths.copy_(other.lengths)
        self._used, self._uniform = other._used, other._uniform

    # ------------------------------------------------------------------ layers
    def _check_layer(self, index: int) -> None:
        if not 0 <= index < self.n_layers:
            raise MultiheadError(f"layer {index} is out of range for a cache of {self.n_layers} layer(s)")


class BaseLayerCache:
    """One layer of a cache: what a layer is given (``cache.layer(i)``); its kind's verb is ``update``."""

    def __init__(self, cache: BaseCache, index: int) -> None:
        self.cache = cache
        self.index = index


class Cache(BaseCache):
    """A cache of keys and values, (b, g, *, d) per layer with g = n_kv_heads, the kinds
    :class:`multihead.layers.attention.MultiHeadAttention` reads: in full (:class:`~.full.KVCache`), as attention sinks
    plus a window (:class:`~.sink.SinkCache`), as low-bit codes (:class:`~.quantized.QuantizedKVCache`), one cache
    per layer of its own width (:class:`~.layered.LayeredCache`). Each implements :meth:`update`."""

    def __init__(self, *, batch: int, n_kv_heads: int, head_dim: int, n_layers: int, max_len: int | None,
                 device: torch.device | str | None) -> None:
        super().__init__(batch=batch, n_layers=n_layers, max_len=max_len, device=device,
                         sizes=(("n_kv_heads", n_kv_heads), ("head_dim", head_dim)))
        self._n_kv_heads, self._head_dim = n_kv_heads, head_dim

    @property
    def n_kv_heads(self) -> int:
        return self._n_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    def layer_kv_heads(self, index: int) -> int:
        """KV heads of one layer (the same for every layer except in a :class:`~.layered.LayeredCache`)."""
        return self.n_kv_heads

    def layer(self, index: int) -> LayerCache:
        """One layer of this cache (its handle), to pass to ``MultiHeadAttention(..., cache=...)``."""
        self._check_layer(index)
        return LayerCache(self, index)

    def update(self, layer: int, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False) -> KVView:
        """Place one layer's new keys and values (b, g, s, d) in the slots reserved; return a view of what the layer
        attends to, its t = ``slots.t`` keys, the new ones included (:mod:`multihead.cache.view`: the kind's own
        form). ``read_only``: the same from a copy, nothing placed. The tokens count as held at :meth:`advance`
        (the module's rule)."""
        raise NotImplementedError

    def _check_keys(self, layer: int, k: Tensor) -> None:
        b, g, _, d = k.shape
        if (b, g, d) != (self.batch, self.n_kv_heads, self.head_dim):
            raise MultiheadError(
                f"keys of shape {tuple(k.shape)} do not fit this cache: it holds (b, n_kv_heads, *, head_dim) = "
                f"{(self.batch, self.n_kv_heads, '*', self.head_dim)}"
            )
        self._check_layer(layer)


class LayerCache(BaseLayerCache):
    """One layer of a :class:`Cache` of keys and values: ``n_kv_heads`` and ``head_dim`` are its shape (read by the
    layer's checks without entering the cache)."""

    cache: Cache

    def __init__(self, cache: Cache, index: int) -> None:
        super().__init__(cache, index)
        self.n_kv_heads = cache.layer_kv_heads(index)
        self.head_dim = cache.head_dim

    def update(self, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False) -> KVView:
        """:meth:`Cache.update` of this layer."""
        return self.cache.update(self.index, k, v, slots, read_only=read_only)
