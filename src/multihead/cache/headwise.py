"""HeadwiseCache: each KV head of a layer keeps every key (full) or attention sinks + a window (streaming), as a
:class:`~multihead.cache.HeadPlan` says; what a streaming head does not keep is never stored.

::

    per layer l, F_l its full KV heads, S_l its streaming ones (the plan's row l), W_l the layer's own attention
    window (None for a global layer; a sliding layer of Gemma 2/3 or Mistral):
    full heads, global layer      (b, |F_l|, max_len, d)                       every token, at its position
    full heads, sliding layer     (b, |F_l|, W_l - 1, d)                       a ring of the layer's own window
    streaming heads               (b, |S_l|, sinks + min(window, W_l) - 1, d)  the sinks and a ring of the last keys
    (each ring at most max_len slots: a run shorter than a ring allocates only what it fills)
    slot positions                one (slots,) buffer per kind of ring          the position each ring slot holds

``bytes`` is the sum of those tensors' nbytes (:func:`multihead.sizing.cost.headwise_cache_bytes` predicts it): a
streaming head costs its ring whatever the context, and so does every head of a sliding layer.

The protocol's head-wise case (:mod:`multihead.cache.base`): :meth:`reserve` makes one :class:`~.base.Slots` per
kind of store (``Slots.parts``: part 0 the full stores, part 1 + i ring kind i; None for a kind no layer has), each
with its own t and mask (made here, once a step), and a layer's :meth:`update` returns a :class:`~.view.GroupedKV`,
one :class:`~.view.KVGroup` (keys, values, which KV heads, their mask) per store of that layer.
:func:`multihead.kernels.attend` attends once per group with the query heads of the group's KV heads (query head i
reads KV head i // (h / g)) under the group's mask (full: causal by position; a ring: :func:`~multihead.cache.sink_keep`
over its slots), each within the step's attention window (a sliding layer's step passes it: a key past the layer's
window is not seen, sinks included), and puts z back in head order. A layer whose KV heads share one store is one
group, without a gather. A chunk's streaming heads attend over their held slots and the chunk only, so their prefill
compute is their window, not the context.

Hook points with this cache: ``hook_q`` (b, h, s, d), ``hook_z`` (b, h, s, d) and ``hook_out`` work as always (q
before the groups are taken from it, z after it is put back in head order); ``hook_k``, ``hook_v`` and
``hook_pattern`` raise a MultiheadError, since one layer's keys are not one (b, g, t, d) tensor (use a KVCache
with the equivalent mask, :meth:`HeadPlan.mask`, to read them). ``return_weights`` is refused for the same reason.

Sequences of a batch hold one length (as in :class:`~multihead.cache.SinkCache`); the full heads hold ``max_len``
tokens at most (overflow raises before any layer writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from multihead.cache.base import Cache, Slots, check_count, write_slots
from multihead.cache.plan import HeadPlan
from multihead.cache.sink import held_keep, keep_sinks_and_window
from multihead.cache.view import DenseKV, GroupedKV, KVGroup
from multihead.errors import MultiheadError
from multihead.layers.masks import MaskSpec, build_mask

FULL = 0  # the index of the full stores' Slots in Slots.parts; rings follow


@dataclass(frozen=True)
class Ring:
    """A sinks + window store: the first ``sinks`` tokens and a ring of the ``window - 1`` before the next one."""

    sinks: int
    window: int

    @property
    def capacity(self) -> int:
        """Tokens the ring holds between steps: the sinks and the ``window - 1`` keys before the next token."""
        return self.sinks + self.window - 1


@dataclass(frozen=True)
class _Group:
    part: int  # FULL or 1 + the ring's index
    heads: tuple[int, ...]  # the layer's KV heads in this store, in order

    @cached_property
    def first(self) -> int | None:
        """The first head when the heads are consecutive (one run), else None."""
        run = self.heads == tuple(range(self.heads[0], self.heads[0] + len(self.heads)))
        return self.heads[0] if run else None


class HeadwiseCache(Cache):
    """Per (layer, KV head): every key, or sinks + a window, as ``plan`` says; the streaming heads' other keys are
    not stored. Equals the uncached model under :meth:`HeadPlan.mask` (and each layer's own window), token by token
    and chunk by chunk.

    ``HeadwiseCache(plan, batch=b, max_len=n)``, or ``model.new_cache(b, n, plan=plan)`` (checked against the
    model's shape); ``windows``: each layer's own attention window (None: global; default every layer global).
    """

    addressed = False
    positional = False

    def __init__(self, plan: HeadPlan, *, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, windows: Sequence[int | None] | None = None) -> None:
        if not isinstance(plan, HeadPlan):
            raise MultiheadError(f"plan must be a HeadPlan, got {type(plan).__name__}")
        n_layers, _, g, d = plan.shape
        super().__init__(batch=batch, n_kv_heads=g, head_dim=d, n_layers=n_layers, max_len=max_len, device=device)
        self.max_len: int = max_len
        self.head_plan = plan
        self.sink_tokens, self.window = plan.sinks, plan.window
        self.windows = self._check_windows(windows, n_layers)
        self.rings: list[Ring] = []
        self._groups: list[tuple[_Group, ...]] = []
        for layer in range(n_layers):
            self._groups.append(self._layout(layer, plan))
            for gi, group in enumerate(self._groups[layer]):
                length = max_len if group.part == FULL else self._ring_slots(group.part - 1)
                shape = (batch, len(group.heads), length, d)  # (b, |heads|, max_len or ring slots, d)
                for name in ("k", "v"):
                    self.register_buffer(f"{name}_{layer}_{gi}", torch.zeros(shape, dtype=dtype, device=device),
                                         persistent=False)
                if len(self._groups[layer]) > 1:
                    self.register_buffer(f"heads_{layer}_{gi}", torch.tensor(group.heads, device=device),
                                         persistent=False)
            if len(self._groups[layer]) > 1:  # the order that puts [group 0's heads, group 1's] back in head order
                order = torch.tensor([h for group in self._groups[layer] for h in group.heads], device=device)
                self.register_buffer(f"order_{layer}", torch.argsort(order), persistent=False)
        for i in range(len(self.rings)):
            self.register_buffer(f"slot_positions_{i}", torch.full((self._ring_slots(i),), -1, dtype=torch.long,
                                                                   device=device), persistent=False)
        self._parts_used = {group.part for groups in self._groups for group in groups}
        self._held = [0] * len(self.rings)
        self._pending: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (layer, group) of a ring: new keys
        self._placed: set[int] = set()

    @staticmethod
    def _check_windows(windows: Sequence[int | None] | None, n_layers: int) -> list[int | None]:
        if windows is None:
            return [None] * n_layers
        found = list(windows)
        if len(found) != n_layers:
            raise MultiheadError(f"windows gives {len(found)} layers' windows for a plan of {n_layers} layers")
        for i, w in enumerate(found):
            if w is not None:
                check_count(f"window of layer {i}", w, least=2)
        return found

    def _ring_slots(self, i: int) -> int:
        """Slots of ring kind i: its sinks and window, or fewer when the cache is for fewer tokens (``max_len``: a
        short run allocates no more than it fills, so it is never larger than a full cache of that run)."""
        return min(self.rings[i].capacity, self.max_len)

    def _ring(self, ring: Ring) -> int:
        """The part of a ring kind (1 + its index), added on first use."""
        if ring not in self.rings:
            self.rings.append(ring)
        return 1 + self.rings.index(ring)

    def _layout(self, layer: int, plan: HeadPlan) -> tuple[_Group, ...]:
        """The stores of a layer: its full heads' (every key in a global layer, a ring of the layer's window in a
        sliding one) and its streaming heads' (sinks and the plan's window, within the layer's); heads that share a
        store are one group."""
        w = self.windows[layer]
        full, stream = plan.full_heads(layer), plan.streaming_heads(layer)
        by_part: dict[int, list[int]] = {}
        if full:
            by_part.setdefault(FULL if w is None else self._ring(Ring(0, w)), []).extend(full)
        if stream:
            window = plan.window if w is None else min(plan.window, w)
            by_part.setdefault(self._ring(Ring(plan.sinks, window)), []).extend(stream)
        return tuple(_Group(part, tuple(sorted(heads))) for part, heads in by_part.items())

    @property
    def capacity(self) -> int:
        """Tokens a streaming head of a global layer holds between steps: the sinks and the ``window - 1`` keys
        before the next."""
        return self.sink_tokens + self.window - 1

    @property
    def slot_positions(self) -> Tensor:
        """The positions the streaming heads' ring of a global layer holds (-1: empty)."""
        return self._positions(self._ring_index(Ring(self.sink_tokens, self.window)))

    def _ring_index(self, ring: Ring) -> int:
        if ring not in self.rings:
            raise MultiheadError(f"this cache has no ring of {ring.sinks} sinks and window {ring.window}")
        return self.rings.index(ring)

    def _positions(self, i: int) -> Tensor:
        found: Tensor = getattr(self, f"slot_positions_{i}")
        return found

    @property
    def bytes(self) -> int:
        """Bytes of the key and value tensors held: 2 * b * d * element size * the sum over layers and stores of
        (heads * tokens held): max_len for a global layer's full heads, the ring's slots for the rest."""
        return sum(t.nbytes for name, t in self.named_buffers() if name.startswith(("k_", "v_")))

    def _tensors(self, layer: int, gi: int) -> tuple[Tensor, Tensor]:
        return getattr(self, f"k_{layer}_{gi}"), getattr(self, f"v_{layer}_{gi}")

    def reset(self) -> None:
        super().reset()
        for i in range(len(self.rings)):
            self._positions(i).fill_(-1)
        self._held = [0] * len(self.rings)
        self._pending.clear()
        self._placed.clear()

    # ------------------------------------------------------------------ the slots of a step
    def reserve(self, s: int, positions: Tensor | None = None, *, need_positions: bool = False,
                attention_window: int | None = None, validate: bool = True, shortcuts: bool = True) -> Slots:
        """One Slots per kind of store, in ``parts`` (FULL, then each ring; None for a kind no layer has): the full
        stores' (t = the tokens held and the new ones, causal by position) and each ring's (t = its held slots + s,
        ``keep`` by :func:`sink_keep` within ``attention_window``, the step's), each with its ``mask``
        (validated as ``validate`` says), which the layers' views carry. The top-level fields are the first present
        part's.

        Under torch.compile the step reads no host-known length (the full heads' t is max_len, their write and mask
        go by position), so one graph serves every decode step once the rings are full; the room is then checked by
        :meth:`advance`, outside the graph."""
        if positions is not None:
            raise MultiheadError("a HeadwiseCache places new tokens after the cached ones: positions cannot be given")
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self.check_room(s)
        pos = self.lengths[:, None] + torch.arange(s, device=self.lengths.device)  # (b, s)
        b, h = self.batch, self.head_plan.shape[1]
        parts: list[Slots | None] = [None] * (1 + len(self.rings))
        if FULL in self._parts_used:
            t = self._span(s)
            aligned = not compiling  # one length for every sequence: the queries are the last s
            mask = build_mask(batch=b, n_heads=h, s=s, t=t, causal=True, window=attention_window,
                              q_positions=None if aligned else pos, device=pos.device, validate=validate)
            parts[FULL] = Slots(s=s, t=t, positions=pos, start=None if compiling else self._used, aligned=aligned,
                                mask=mask)
        for i, ring in enumerate(self.rings):
            keep = held_keep(self._positions(i), self._held[i], pos, s, attention_window, window=ring.window,
                             sink_tokens=ring.sinks, at=None if compiling else self._used)
            t = self._held[i] + s
            parts[1 + i] = Slots(s=s, t=t, positions=pos, start=None, aligned=False, positional=False, keep=keep,
                                 mask=MaskSpec(batch=b, n_heads=h, s=s, t=t, keep=keep))
        first = next(part for part in parts if part is not None)
        return Slots(s=s, t=first.t, positions=pos, start=first.start, aligned=first.aligned,
                     positional=first.positional, keep=first.keep, mask=first.mask, parts=tuple(parts))

    # ------------------------------------------------------------------ a layer's verb
    def update(self, layer: int, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False) -> GroupedKV:
        """Place one layer's new keys and values (b, g, s, d): the full stores' in their slots (as a KVCache), the
        rings' beside their held slots until :meth:`advance`. Returns one :class:`~.view.KVGroup` per store of this
        layer and the order that puts them back in head order. ``read_only``: the same, nothing placed."""
        self._check_keys(layer, k)
        if slots.parts is None or len(slots.parts) != 1 + len(self.rings):
            raise MultiheadError("these slots were not reserved by this HeadwiseCache: make the step with this cache")
        layout = self._groups[layer]
        several = len(layout) > 1
        groups: list[KVGroup] = []
        for gi, group in enumerate(layout):
            heads = getattr(self, f"heads_{layer}_{gi}") if several else None
            first = group.first if several else None
            if heads is None:
                kg, vg = k, v
            elif first is not None:  # consecutive KV heads: views
                kg, vg = k.narrow(1, first, len(group.heads)), v.narrow(1, first, len(group.heads))
            else:
                kg, vg = k.index_select(1, heads), v.index_select(1, heads)
            keys, values = self._tensors(layer, gi)
            if group.part == FULL:
                part = slots.parts[FULL]
                assert part is not None
                if read_only:
                    keys, values = keys.clone(), values.clone()
                write_slots(part, 2, (keys, kg), (values, vg))
                kv = DenseKV(keys.narrow(2, 0, part.t), values.narrow(2, 0, part.t))  # (b, |heads|, t, d)
            else:
                held = self._held[group.part - 1]
                kv = DenseKV(torch.cat([keys[:, :, :held], kg.to(keys.dtype)], dim=2),
                             torch.cat([values[:, :, :held], vg.to(values.dtype)], dim=2))  # (b, |heads|, held + s, d)
                if not read_only:
                    self._pending[(layer, gi)] = (kg, vg)
            reserved = slots.parts[group.part]
            assert reserved is not None and reserved.mask is not None
            groups.append(KVGroup(kv, heads, reserved.mask, first))
        if not read_only:
            self._placed.add(layer)
        return GroupedKV(tuple(groups), getattr(self, f"order_{layer}") if several else None, self.n_kv_heads)

    # ------------------------------------------------------------------ the commit
    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Commit the step: the full stores' tokens were placed at update; each ring keeps its sinks and the last
        ``window - 1`` of what the layers wrote, the rest is evicted."""
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise MultiheadError(f"advance takes a non-negative number of tokens, got {s!r}")
        self._check_commit(s, lengths, dict.fromkeys(self._placed))
        self.check_room(s)
        for i, ring in enumerate(self.rings):
            pending = {layer: kv for (layer, gi), kv in self._pending.items()
                       if self._groups[layer][gi].part == 1 + i}
            store = {layer: self._tensors(layer, gi) for (layer, gi) in self._pending
                     if self._groups[layer][gi].part == 1 + i}
            keep_sinks_and_window(pending, store.__getitem__, self._positions(i), first=self._used, s=s,
                                  sink_tokens=ring.sinks, window=ring.window)
            self._held[i] = min(self._used + s, self._ring_slots(i))
        self._pending.clear()
        self._placed.clear()
        super().advance(s)

    def extra_repr(self) -> str:
        sliding = sorted({w for w in self.windows if w is not None})
        return (f"n_layers={self.n_layers}, batch={self.batch}, n_kv_heads={self.n_kv_heads}, "
                f"full={self.head_plan.full_fraction:.0%} of KV heads, max_len={self.max_len}, "
                f"sink_tokens={self.sink_tokens}, window={self.window}, head_dim={self.head_dim}"
                + (f", sliding layers' windows {sliding}" if sliding else "") + f", bytes={self.bytes:,}")
