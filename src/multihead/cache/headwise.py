"""HeadwiseCache: each KV head of a layer keeps every key (full) or attention sinks + a window (streaming), as a
:class:`~multihead.cache.HeadPlan` says; what a streaming head does not keep is never stored.

::

    per layer l, F_l its full KV heads, S_l its streaming ones (the plan's row l):
    k_full_l, v_full_l       (b, |F_l|, max_len, d)                  every token, at its position (as KVCache)
    k_stream_l, v_stream_l   (b, |S_l|, sinks + window - 1, d)       the sinks and a ring of the last window - 1
    slot_positions           (sinks + window - 1,)                   the position each streaming slot holds

``bytes`` is the sum of those tensors' nbytes (:func:`multihead.cost.headwise_cache_bytes` predicts it): a
streaming head costs (sinks + window - 1) slots whatever the context.

The protocol's head-wise case (:mod:`multihead.cache.base`): :meth:`reserve` makes one :class:`~.base.Slots` per
kind of KV head (``Slots.parts``: full, streaming), each with its own t and mask, and a layer's :meth:`update`
returns a :class:`~.view.GroupedKV`, one :class:`~.view.KVGroup` (keys, values, which KV heads, which mask) per kind
present in that layer. :func:`multihead.kernels.attend` attends once per group with the query heads of the group's
KV heads (query head i reads KV head i // (h / g)) under the group's mask (full: causal by position; streaming:
:func:`~multihead.cache.sink_keep`) and puts z back in head order. A layer whose KV heads are all full or all
streaming is one group, without a gather. A chunk's streaming heads attend over their held slots and the
chunk only, so their prefill compute is their window, not the context.

Hook points with this cache: ``hook_q`` (b, h, s, d), ``hook_z`` (b, h, s, d) and ``hook_out`` work as always (q
before the groups are taken from it, z after it is put back in head order); ``hook_k``, ``hook_v`` and
``hook_pattern`` raise a MultiheadError, since one layer's keys are not one (b, g, t, d) tensor (use a KVCache
with the equivalent mask, :meth:`HeadPlan.mask`, to read them). ``return_weights`` is refused for the same reason.

Sequences of a batch hold one length (as in :class:`~multihead.cache.SinkCache`); the full heads hold ``max_len``
tokens at most (overflow raises before any layer writes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from multihead.cache.base import Cache, Slots, write_slots
from multihead.cache.plan import HeadPlan
from multihead.cache.sink import held_keep, keep_sinks_and_window
from multihead.cache.view import DenseKV, GroupedKV, KVGroup
from multihead.errors import MultiheadError

FULL, STREAMING = 0, 1  # the index of each kind's Slots in Slots.parts (and of its mask in Step.masks)


class HeadwiseCache(Cache):
    """Per (layer, KV head): every key, or sinks + a window, as ``plan`` says; the streaming heads' other keys are
    not stored. Equals the uncached model under :meth:`HeadPlan.mask`, token by token and chunk by chunk.

    ``HeadwiseCache(plan, batch=b, max_len=n)``, or ``model.new_cache(b, n, plan=plan)`` (checked against the
    model's shape).
    """

    addressed = False
    positional = False
    slot_positions: Tensor

    def __init__(self, plan: HeadPlan, *, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        if not isinstance(plan, HeadPlan):
            raise MultiheadError(f"plan must be a HeadPlan, got {type(plan).__name__}")
        n_layers, _, g, d = plan.shape
        super().__init__(batch=batch, n_kv_heads=g, head_dim=d, n_layers=n_layers, max_len=max_len, device=device)
        self.max_len: int = max_len
        self.head_plan = plan
        self.sink_tokens, self.window = plan.sinks, plan.window
        ring = self.slots
        self._full: list[bool] = []  # whether layer l has full KV heads (its tensors are buffers, found by name)
        self._stream: list[bool] = []
        for layer in range(n_layers):
            full, stream = plan.full_heads(layer), plan.streaming_heads(layer)
            for kind, heads, length, present in (("full", full, max_len, self._full),
                                                 ("stream", stream, ring, self._stream)):
                present.append(bool(heads))
                if not heads:
                    continue
                shape = (batch, len(heads), length, d)  # (b, |F_l| or |S_l|, max_len or slots, d)
                for name in ("k", "v"):
                    self.register_buffer(f"{name}_{kind}_{layer}", torch.zeros(shape, dtype=dtype, device=device),
                                         persistent=False)
            if full and stream:  # two groups: gather each one's heads, and put z back in head order
                order = torch.tensor(full + stream, device=device)
                for name, value in (("full", torch.tensor(full, device=device)),
                                    ("stream", torch.tensor(stream, device=device)),
                                    ("order", torch.argsort(order))):
                    self.register_buffer(f"{name}_heads_{layer}", value, persistent=False)
        self._kinds = (any(self._full), any(self._stream))
        self.register_buffer("slot_positions", torch.full((ring,), -1, dtype=torch.long, device=device),
                             persistent=False)
        self._held = 0
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}  # streaming heads' new keys, kept at advance
        self._placed: set[int] = set()

    @property
    def slots(self) -> int:
        """Tokens a streaming head holds between steps: the sinks and the ``window - 1`` keys before the next."""
        return self.sink_tokens + self.window - 1

    @property
    def bytes(self) -> int:
        """Bytes of the key and value tensors held: 2 * b * d * element size * sum over layers of
        (|F_l| * max_len + |S_l| * (sinks + window - 1))."""
        return sum(t.nbytes for name, t in self.named_buffers() if name.startswith(("k_", "v_")))

    def _tensors(self, layer: int, kind: str) -> tuple[Tensor, Tensor]:
        return getattr(self, f"k_{kind}_{layer}"), getattr(self, f"v_{kind}_{layer}")

    def heads(self, layer: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """(full KV heads, streaming KV heads, the order that puts [full, streaming] back in head order) of a layer
        with both kinds, as long tensors; None for a layer of one kind."""
        if not (self._full[layer] and self._stream[layer]):
            return None
        return (getattr(self, f"full_heads_{layer}"), getattr(self, f"stream_heads_{layer}"),
                getattr(self, f"order_heads_{layer}"))

    def reset(self) -> None:
        super().reset()
        self.slot_positions.fill_(-1)
        self._held = 0
        self._pending.clear()
        self._placed.clear()

    # ------------------------------------------------------------------ the slots of a step
    def reserve(self, s: int, positions: Tensor | None = None, *, need_positions: bool = False,
                window: int | None = None, validate: bool = True, shortcuts: bool = True) -> Slots:
        """One Slots per kind of KV head, in ``parts`` (FULL, STREAMING; None for a kind no layer has): the full
        heads' (t = the tokens held and the new ones, causal by position) and the streaming heads' (t = held slots
        + s, ``keep`` by :func:`sink_keep`). The top-level fields are the first present part's.

        Under torch.compile the step reads no host-known length (the full heads' t is max_len, their write and mask
        go by position), so one graph serves every decode step once the streaming slots are full; the room is then
        checked by :meth:`advance`, outside the graph."""
        if positions is not None:
            raise MultiheadError("a HeadwiseCache places new tokens after the cached ones: positions cannot be given")
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self.check_room(s)
        pos = self.lengths[:, None] + torch.arange(s, device=self.lengths.device)  # (b, s)
        full = stream = None
        if self._kinds[FULL]:
            full = Slots(s=s, t=self._span(s), positions=pos, start=None if compiling else self._used,
                         aligned=not compiling)  # one length for every sequence: the queries are the last s keys
        if self._kinds[STREAMING]:
            stream = Slots(s=s, t=self._held + s, positions=pos, start=None, aligned=False, positional=False,
                           keep=self._keep(pos, s, window))
        first = full if full is not None else stream
        assert first is not None
        return Slots(s=s, t=first.t, positions=pos, start=first.start, aligned=first.aligned,
                     positional=first.positional, keep=first.keep, parts=(full, stream))

    def _keep(self, q_positions: Tensor | None, s: int, window: int | None) -> Tensor | None:
        """The streaming heads' keep (1, 1, s, held + s), or None when each query sees every held slot."""
        return held_keep(self.slot_positions, self._held, q_positions, s, window, store_window=self.window,
                         sink_tokens=self.sink_tokens)

    # ------------------------------------------------------------------ a layer's verb
    def update(self, layer: int, k: Tensor, v: Tensor, slots: Slots, *, read_only: bool = False) -> GroupedKV:
        """Place one layer's new keys and values (b, g, s, d): the full heads' in their slots (as a KVCache), the
        streaming heads' beside their held slots until :meth:`advance`. Returns one :class:`~.view.KVGroup` per kind
        in this layer, full first, and the order that puts them back in head order. ``read_only``: the same,
        nothing placed."""
        self._check_keys(layer, k)
        if slots.parts is None:
            raise MultiheadError("these slots were not reserved by a HeadwiseCache: make the step with this cache")
        index = self.heads(layer)
        groups: list[KVGroup] = []
        if self._full[layer]:
            part = slots.parts[FULL]
            assert part is not None
            kf, vf = (k, v) if index is None else (k.index_select(1, index[0]), v.index_select(1, index[0]))
            keys, values = self._tensors(layer, "full")
            if read_only:
                keys, values = keys.clone(), values.clone()
            write_slots(part, 2, (keys, kf), (values, vf))
            groups.append(KVGroup(DenseKV(keys.narrow(2, 0, part.t), values.narrow(2, 0, part.t)),
                                  None if index is None else index[0], FULL))  # (b, |F_l|, t, d)
        if self._stream[layer]:
            ks, vs = (k, v) if index is None else (k.index_select(1, index[1]), v.index_select(1, index[1]))
            held, (keys, values) = self._held, self._tensors(layer, "stream")
            groups.append(KVGroup(DenseKV(torch.cat([keys[:, :, :held], ks.to(keys.dtype)], dim=2),
                                          torch.cat([values[:, :, :held], vs.to(values.dtype)], dim=2)),
                                  None if index is None else index[1], STREAMING))  # (b, |S_l|, held + s, d)
            if not read_only:
                self._pending[layer] = (ks, vs)
        if not read_only:
            self._placed.add(layer)
        return GroupedKV(tuple(groups), None if index is None else index[2], self.n_kv_heads)

    # ------------------------------------------------------------------ the commit
    def advance(self, s: int, *, lengths: Sequence[int] | Tensor | None = None) -> None:
        """Commit the step: the full heads' tokens were placed at update; the streaming heads keep the sinks and
        the last ``window - 1`` of what the layers wrote, the rest is evicted."""
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise MultiheadError(f"advance takes a non-negative number of tokens, got {s!r}")
        self._check_commit(s, lengths, dict.fromkeys(self._placed))
        self.check_room(s)
        keep_sinks_and_window(self._pending, lambda layer: self._tensors(layer, "stream"), self.slot_positions,
                              first=self._used, s=s, sink_tokens=self.sink_tokens, window=self.window)
        self._pending.clear()
        self._placed.clear()
        self._held = min(self._used + s, self.slots)
        super().advance(s)

    def extra_repr(self) -> str:
        return (f"n_layers={self.n_layers}, batch={self.batch}, n_kv_heads={self.n_kv_heads}, "
                f"full={self.head_plan.full_fraction:.0%} of KV heads, max_len={self.max_len}, "
                f"sink_tokens={self.sink_tokens}, window={self.window}, head_dim={self.head_dim}, "
                f"bytes={self.bytes:,}")
