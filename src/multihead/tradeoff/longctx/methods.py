"""The KV-saving methods the long-context trade-off measures: one cache kind on one model each, and the head plans
a head-wise cache reads."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multihead.cache.spec import CacheSpec


@dataclass(frozen=True)
class Method:
    """One cache kind on one model. ``keep``: the share of the prompt length a sinks + window cache holds
    (``sinks + window - 1 = round(keep * length)`` slots, so 0.5 holds the bytes kvpress keeps at 50% compression);
    ``window``: an absolute window instead; ``bits``: a quantized cache; ``plan``: a head-wise cache made by the
    :class:`~multihead.cache.HeadPlan` saved in that file (each KV head full or its sinks + window);
    ``equal_to``: a sinks + window cache holding as many slots per KV head as that plan's cache holds on average
    at each length (the uniform control at equal bytes); none of them: the full cache. ``layers``: "global" puts a
    windowed or quantized method on a hybrid model's global layers only, its sliding layers keeping their window
    (:func:`multihead.hf.cache.new_cache`; on a model whose every layer is global, as our Llama port's, the same as
    "all")."""

    name: str
    series: str
    model: str = "original"
    keep: float | None = None
    window: int | None = None
    sinks: int = 0
    bits: int | None = None
    group: int = 32
    residual: int = 128
    plan: str | None = None
    equal_to: str | None = None
    layers: str = "all"

    def window_at(self, length: int) -> int | None:
        if self.keep is not None:
            return max(1, round(self.keep * length) - self.sinks + 1)
        if self.equal_to is not None:
            return max(1, equal_bytes_slots(load_plan(self.equal_to), length) - self.sinks + 1)
        return self.window

    def spec(self, length: int, max_len: int) -> CacheSpec:
        """The :class:`~multihead.cache.CacheSpec` of this method's cache for a prompt of ``length`` tokens (room
        for ``max_len`` in a full one)."""
        if self.plan is not None:
            return CacheSpec(max_len, plan=load_plan(self.plan))
        window = self.window_at(length)
        if window is not None:
            return CacheSpec(window=window, sink_tokens=self.sinks, layers=self.layers)
        if self.bits is not None:
            return CacheSpec(max_len, bits=self.bits, group=self.group, residual=self.residual, layers=self.layers)
        return CacheSpec(max_len)

    def cache(self, model: Any, length: int, max_len: int) -> Any:
        """This method's real cache for a prompt of ``length`` tokens (room for ``max_len`` in a full one): the
        model's ``new_cache(1, spec=self.spec(length, max_len))``."""
        return model.new_cache(1, spec=self.spec(length, max_len))

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


def load_plan(path: str) -> Any:
    """The :class:`~multihead.cache.HeadPlan` saved at ``path`` (read again only when the file changes)."""
    try:
        stamp = Path(path).stat().st_mtime_ns
    except OSError:
        stamp = -1  # HeadPlan.load says what is wrong with the path
    return _load_plan(path, stamp)


@functools.lru_cache(maxsize=32)
def _load_plan(path: str, stamp: int) -> Any:
    from multihead.cache import HeadPlan

    return HeadPlan.load(path)


def equal_bytes_slots(plan: Any, length: int) -> int:
    """Slots per KV head of a sinks + window cache holding the bytes of ``plan``'s head-wise cache at ``length``
    tokens: a full KV head holds ``length``, a streaming one ``min(length, sinks + window - 1)``.

    A plan of a model with sliding layers (``plan.hybrid``) is matched by a sinks + window cache on the global
    layers only (``layers="global"``), every sliding layer keeping a ring of its window: the slots per global KV
    head that make the two caches' totals equal (the plan's sliding heads hold their window when full, sinks and
    a window within it when streaming)."""
    stream: int = min(length, plan.sinks + plan.window - 1)
    if not plan.hybrid:
        share: float = plan.full_fraction
        return max(1, round(share * length + (1 - share) * stream))
    held = 0  # the plan's slots beyond what the control holds on the sliding layers
    for layer, w in enumerate(plan.windows):
        for full in plan.full[layer]:
            if w is None:
                held += length if full else stream
            else:
                ring = min(length, w - 1)
                held += ring if full else min(length, plan.sinks + min(plan.window, w) - 1)
                held -= ring  # the control's ring on this sliding layer
    slots: int = round(held / (len(plan.global_layers) * plan.n_kv_heads))
    return max(1, slots)


def control_key(plan: Any) -> tuple[Any, ...]:
    """What a plan's uniform control depends on: plans with one key share one control (their caches hold the same
    bytes): the share of full KV heads, sinks and window, and on a model with sliding layers its windows and the
    full heads among its global layers and among each window's sliding ones."""
    if not plan.hybrid:
        return (plan.full_fraction, plan.sinks, plan.window)
    by_window: dict[int | None, int] = {}
    for layer, w in enumerate(plan.windows):
        by_window[w] = by_window.get(w, 0) + sum(plan.full[layer])
    return (plan.windows, plan.sinks, plan.window, tuple(sorted(by_window.items(), key=lambda kv: kv[0] or 0)))


def control_name(plan: Any, sinks: int) -> str:
    """The table's name of the uniform control of ``plan`` (``sinks``: the run's sink count)."""
    if plan.hybrid:
        return (f"{sinks} sinks + window = bytes of {plan.global_full_fraction:.0%} of global full, "
                f"{plan.sinks} + {plan.window}, global layers")
    return f"{sinks} sinks + window = bytes of {plan.full_fraction:.0%} full, {plan.sinks} + {plan.window}"


def plan_label(path: str) -> str:
    """A plan's name in tables: its file name without ``-plan.json`` / ``.json``."""
    name = Path(path).name
    for end in ("-plan.json", ".json"):
        if name.endswith(end):
            return name[:-len(end)]
    return name


__all__ = ["Method", "control_key", "control_name", "equal_bytes_slots", "load_plan", "plan_label"]
