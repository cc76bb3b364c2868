"""Exact path patching (Wang et al. 2022, the IOI circuit): a sender head's clean output patched into the corrupted run
only along its direct path into receivers' queries, keys or values (or into the final stream, ``"logits"``), by a
second forward: nothing is linearised.

1. **Sender forward** (one per sender): the corrupted prompt with every head's z and every MLP's output frozen to
   the corrupted run's, except the sender's z, copied from the clean run. The stream at a later layer is then the
   corrupted one plus exactly the sender's change of write, and each receiver's q, k or v is computed from it
   through the layer's own norm and projections (RoPE included); the final stream is recorded too.
2. **Receiver forward** (batched over receiver groups, one copy of the batch per group, ``chunk`` groups per
   forward): the corrupted prompt with each group's receivers' q, k or v replaced by the sender forward's, and, for
   ``"logits"`` in a group, the final stream given the sender's change of write (final + sender-forward final -
   corrupted final); everything downstream runs freely.

The figure is the recovered fraction, as in :func:`multihead.heads.patching.activation_patching`:
``(m(patched) - m(corrupted)) / (m(clean) - m(corrupted))``, pooled over the batch and per row.

A receiver (layer, head) names a query head; its keys and values are its KV head's (head // (h / g)), shared with
its group under GQA and MQA, so patching a receiver's k or v patches what its whole group reads. When a group holds
every path the sender has (the heads of all later layers and ``"logits"``, in a model whose MLPs write nothing),
path patching equals activation patching of the sender (tested).

Models: those :func:`multihead.heads.attribution.read_model` reads (our Llama port, transformers models of the
families of :data:`multihead.hf.LAYOUTS` after ``hf.enable``). In Gemma 2/3 a layer's write passes its
post-attention norm: the sender's change of write is that norm's output with the sender's z clean and the other heads'
frozen at the corrupted run's. A final logit softcap is no obstacle (nothing is linearised).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.heads.attribution import read_model, recording
from multihead.heads.patching import Metric, recovered_fraction
from multihead.layers.hooks import HookPoint

Receiver = tuple[int, int] | str  # (layer, query head), or "logits": the final stream
QKV = ("hook_q", "hook_k", "hook_v")


@dataclass
class PathPatching:
    """One sender's effect through each receiver group: ``effects`` (n_groups,) recovered fraction pooled over the
    batch, ``per_pair`` (n_groups, b) per row (NaN where a row's clean and corrupted metrics are equal)."""

    sender: tuple[int, int]
    receivers: list[list[Receiver]]
    points: tuple[str, ...]
    clean: float
    corrupted: float
    effects: np.ndarray
    per_pair: np.ndarray


def _receiver(item: Any, sender: int, layers: Sequence[Any]) -> Receiver:
    if item == "logits":
        return "logits"
    ok = isinstance(item, tuple) and len(item) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                            for v in item)
    if not ok:
        raise MultiheadError(f"receiver {item!r} must be (layer, head) or 'logits'")
    lr, h = int(item[0]), int(item[1])
    if not sender < lr < len(layers) or not 0 <= h < layers[lr].n_heads:
        raise MultiheadError(f"receiver {item!r}: its layer must come after the sender's ({sender}) and both be in "
                             f"range (layers 0 .. {len(layers) - 1}, heads 0 .. {layers[-1].n_heads - 1})")
    return (lr, h)


def _groups(receivers: Sequence[Any] | None, sender: int, layers: Sequence[Any]) -> list[list[Receiver]]:
    if receivers is None:  # every head of every later layer, each alone
        return [[(lr, h)] for lr in range(sender + 1, len(layers)) for h in range(layers[lr].n_heads)]
    groups: list[list[Receiver]] = []
    for item in receivers:
        single = isinstance(item, str) or (isinstance(item, tuple) and len(item) == 2
                                           and all(isinstance(v, int) for v in item))
        group = [_receiver(r, sender, layers) for r in ([item] if single else list(item))]
        if not group:
            raise MultiheadError("a receiver group is empty")
        groups.append(group)
    if not groups:
        raise MultiheadError("no receivers given")
    return groups


def path_patching(model: Any, clean: Tensor, corrupted: Tensor, metric: Metric, *, sender: tuple[int, int],
                  receivers: Sequence[Any] | None = None,
                  points: str | Sequence[str] = QKV, chunk: int = 16) -> PathPatching:
    """Patch ``sender`` (layer, head) from the clean run into the corrupted one along its direct paths into each
    receiver group (default: every head of every later layer, each alone) at ``points`` (any of hook_q, hook_k,
    hook_v; default all three). See the module."""
    m = read_model(model)
    chosen = (points,) if isinstance(points, str) else tuple(points)
    if not chosen or any(p not in QKV for p in chosen):
        raise MultiheadError(f"points {chosen!r}: a path enters a head through {', '.join(QKV)}")
    if not isinstance(chunk, int) or chunk < 1:
        raise MultiheadError(f"chunk ({chunk!r}) must be a positive int")
    if not isinstance(clean, Tensor) or not isinstance(corrupted, Tensor) or clean.shape != corrupted.shape \
            or clean.ndim != 2:
        raise MultiheadError("clean and corrupted must be token id tensors (b, s) of the same shape")
    ls, hs = sender
    if not 0 <= ls < len(m.layers) or not 0 <= hs < m.layers[ls].n_heads:
        raise MultiheadError(f"sender {sender!r} does not exist: layers 0 .. {len(m.layers) - 1}, heads 0 .. "
                             f"{m.layers[0].n_heads - 1}")
    groups = _groups(receivers, ls, m.layers)
    b = corrupted.shape[0]
    last = m.layers[-1].resid_post

    def record(ids: Tensor, wanted: dict[str, HookPoint], edits: Sequence[tuple[HookPoint, Callable[..., Any]]] = ()
               ) -> tuple[Tensor, dict[str, Tensor]]:
        seen: dict[str, Tensor] = {}
        with recording(wanted, seen, edits):
            logits = m.forward(ids)
        return logits, seen

    z_points = {f"z{i}": layer.z for i, layer in enumerate(m.layers)}
    mlp_points = {f"mlp{i}": layer.mlp_out for i, layer in enumerate(m.layers)}
    with torch.no_grad():
        clean_logits, clean_seen = record(clean, {"z": m.layers[ls].z})
        corrupt_logits, frozen = record(corrupted, {**z_points, **mlp_points, "final": last})
        clean_rows, corrupt_rows = metric(clean_logits).detach(), metric(corrupt_logits).detach()
        m_clean, m_corrupt = float(clean_rows.mean()), float(corrupt_rows.mean())
        if m_clean == m_corrupt:
            raise MultiheadError(f"the metric is {m_clean:.6g} on both prompts: nothing to recover by patching")

        def freeze(key: str, sender_z: bool = False) -> Callable[[Tensor, HookPoint], Tensor]:
            def fn(x: Tensor, _p: HookPoint) -> Tensor:
                out = frozen[key].to(x.dtype).clone()
                if sender_z:
                    out[:, hs] = clean_seen["z"][:, hs].to(x.dtype)
                return out
            return fn

        edits = [(layer.z, freeze(f"z{i}", i == ls)) for i, layer in enumerate(m.layers)]
        edits += [(layer.mlp_out, freeze(f"mlp{i}")) for i, layer in enumerate(m.layers)]
        wanted = {f"{p}{lr}": getattr(m.layers[lr].attn, p) for lr in range(ls + 1, len(m.layers)) for p in chosen}
        _, sent = record(corrupted, {**wanted, "final": last}, edits)

        effects, per_pair = np.zeros(len(groups)), np.zeros((len(groups), b))
        for start in range(0, len(groups), chunk):
            batch = groups[start:start + chunk]
            k = len(batch)
            patches: list[tuple[HookPoint, Callable[..., Any]]] = []
            for lr in range(ls + 1, len(m.layers)):
                layer = m.layers[lr]
                r = layer.n_heads // layer.n_kv_heads
                for p in chosen:
                    units: list[tuple[int, int]] = []
                    for j, group in enumerate(batch):
                        for item in group:
                            if isinstance(item, tuple) and item[0] == lr:
                                units.append((j, item[1] if p == "hook_q" else item[1] // r))
                    if units:
                        patches.append((getattr(layer.attn, p), _copy_units(sent[f"{p}{lr}"], units, k, b)))
            to_logits = [j for j, group in enumerate(batch) if "logits" in group]
            if to_logits:
                delta = sent["final"] - frozen["final"]
                patches.append((last, _add_rows(delta, to_logits, k, b)))
            logits, _ = record(corrupted.repeat(k, 1), {}, patches)
            rows = metric(logits).detach().view(k, b)
            for j in range(k):
                effects[start + j] = (float(rows[j].mean()) - m_corrupt) / (m_clean - m_corrupt)
            per_pair[start:start + k] = recovered_fraction(rows.double() - corrupt_rows.double(),
                                                           clean_rows - corrupt_rows)
    return PathPatching((ls, hs), groups, chosen, m_clean, m_corrupt, effects, per_pair)


def _copy_units(source: Tensor, units: list[tuple[int, int]], k: int, b: int) -> Callable[[Tensor, HookPoint], Tensor]:
    """A hook copying head ``h`` of ``source`` (b, heads, s, d) into copy ``j`` of a batch of k copies."""

    def fn(x: Tensor, _p: HookPoint) -> Tensor:
        out = x.clone().view(k, b, *x.shape[1:])
        src = source.to(x.dtype)
        for j, h in units:
            out[j, :, h] = src[:, h]
        return out.view(x.shape)
    return fn


def _add_rows(delta: Tensor, copies: list[int], k: int, b: int) -> Callable[[Tensor, HookPoint], Tensor]:
    """A hook adding ``delta`` (b, s, D) to the given copies of a batch of k copies."""

    def fn(x: Tensor, _p: HookPoint) -> Tensor:
        out = x.clone().view(k, b, *x.shape[1:])
        out[copies] = out[copies] + delta.to(x.dtype)
        return out.view(x.shape)
    return fn
