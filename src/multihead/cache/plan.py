"""HeadPlan: which KV heads of a model keep every key (full) and which keep sinks + a window (streaming).

::

    full     (n_layers, n_kv_heads) bool     True = the KV head keeps every key; False = sinks + window
    sinks, window                             the streaming heads' keys: a query at p sees j < sinks and
                                              p - window < j <= p (:func:`~multihead.cache.sink_keep`'s meaning)
    model, shape                              the model it was made for: (n_layers, n_heads, n_kv_heads, head_dim)
    method, budget, scores                    how it was chosen (free text), the fraction of KV heads asked to be
                                              full (or None), the per-(layer, KV head) scores that chose it
    windows                                   each layer's own attention window in the model (None: a global
                                              layer), or None (every layer global, or not recorded)

On a model with sliding layers (Gemma 2/3) a plan is made over its global layers (``from_scores(..., windows=)``):
the sliding layers' KV heads are full, which there means a ring of the layer's window, and ``budget`` is the share
of the global layers' KV heads kept whole.

A plan is saved as JSON (:meth:`HeadPlan.save`, :meth:`HeadPlan.load`) with the model's name and shape, and a
model refuses a plan of another shape (:meth:`HeadPlan.check`). :class:`~multihead.cache.HeadwiseCache` stores what
it says; :meth:`HeadPlan.mask` is the uncached model's equivalent per-head mask.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from multihead.errors import MultiheadError

FORMAT = "multihead-head-plan"
VERSION = 1
SHAPE_NAMES = ("n_layers", "n_heads", "n_kv_heads", "head_dim")
FIELDS = ("format", "version", "model", "shape", "method", "budget", "sinks", "window", "full", "scores")
OPTIONAL = ("windows",)  # fields a plan written before them does not have (read as None)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(f"{n} {v}" for n, v in zip(SHAPE_NAMES, shape, strict=True)) + ")"


def _windows_text(windows: Sequence[int | None]) -> str:
    """Layer windows in a message: "global" or the window of each layer, runs of one value joined."""
    runs: list[tuple[int, int, int | None]] = []
    for i, w in enumerate(windows):
        if runs and runs[-1][2] == w and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, w)
        else:
            runs.append((i, i, w))
    return "(" + ", ".join(f"{'layer' if a == b else 'layers'} {a if a == b else f'{a}-{b}'} "
                           f"{'global' if w is None else f'window {w}'}" for a, b, w in runs) + ")"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class HeadPlan:
    """Which KV head of each layer is full (keeps every key) and which streams (keeps ``sinks`` first keys and the
    last ``window``), for the model named ``model`` of ``shape`` (n_layers, n_heads, n_kv_heads, head_dim).

    ``full`` is a (n_layers, n_kv_heads) matrix of bool (nested sequences or a bool tensor; stored as tuples).
    With GQA a KV head's choice is its query heads' (query head i reads KV head i // (n_heads / n_kv_heads)).
    ``method`` says how it was chosen ("retrieval", "duo", "uniform", ...), ``budget`` the fraction of KV heads
    asked to be full (None: not chosen by a budget), ``scores`` the (n_layers, n_kv_heads) floats that chose it.
    Every field is checked; a bad one raises a MultiheadError naming it and its value.
    """

    full: tuple[tuple[bool, ...], ...]
    sinks: int
    window: int
    model: str
    shape: tuple[int, int, int, int]
    method: str = ""
    budget: float | None = None
    scores: tuple[tuple[float, ...], ...] | None = None
    windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        self._validate("a HeadPlan")

    # ------------------------------------------------------------------ checks
    def _validate(self, where: str) -> None:
        """Check and normalise every field; ``where`` begins each message (the file when loading)."""
        def bad(field: str, value: object, want: str) -> MultiheadError:
            return MultiheadError(f"{where}: field {field!r} ({_short(value)}) {want}")

        shape = self.shape
        if (not isinstance(shape, (tuple, list)) or len(shape) != 4
                or not all(_is_int(v) and v >= 1 for v in shape)):
            raise bad("shape", shape, "must be 4 positive ints (n_layers, n_heads, n_kv_heads, head_dim)")
        _, n_heads, n_kv_heads, _ = shape
        if n_heads % n_kv_heads:
            raise bad("shape", shape, f"must have n_kv_heads ({n_kv_heads}) dividing n_heads ({n_heads})")
        object.__setattr__(self, "shape", tuple(shape))
        if not isinstance(self.model, str) or not self.model:
            raise bad("model", self.model, "must be the model's name, a non-empty string")
        if not isinstance(self.method, str):
            raise bad("method", self.method, "must be a string (how the plan was chosen)")
        for name in ("sinks", "window"):
            value = getattr(self, name)
            if not _is_int(value) or value < (0 if name == "sinks" else 1):
                raise bad(name, value, f"must be an int of at least {0 if name == 'sinks' else 1}")
        if self.sinks > self.window:
            raise bad("sinks", self.sinks, f"must not exceed the window ({self.window}): the sinks are a few first "
                      "tokens kept beside a longer window")
        object.__setattr__(self, "full", self._matrix("full", self.full, bool, bad))
        if self.scores is not None:
            object.__setattr__(self, "scores", self._matrix("scores", self.scores, float, bad))
        windows = self.windows
        if windows is not None:
            if (not isinstance(windows, (tuple, list)) or len(windows) != self.shape[0]
                    or not all(w is None or (_is_int(w) and w >= 2) for w in windows)):
                raise bad("windows", windows, f"must give each of the {self.shape[0]} layers' attention window (an "
                          "int of at least 2, or null for a global layer)")
            object.__setattr__(self, "windows", tuple(windows))
        budget = self.budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 <= budget <= 1.0:
                raise bad("budget", budget, "must be a fraction of the KV heads in [0, 1], or null")
            object.__setattr__(self, "budget", float(budget))

    def _matrix(self, field: str, value: Any, kind: type, bad: Any) -> tuple[tuple[Any, ...], ...]:
        n_layers, _, g, _ = self.shape
        if isinstance(value, Tensor):
            if (kind is bool) != (value.dtype == torch.bool):
                raise bad(field, f"tensor of {value.dtype}", f"must hold {kind.__name__} values")
            value = value.tolist()
        want = f"must be a (n_layers, n_kv_heads) = ({n_layers}, {g}) matrix of {kind.__name__}"
        if not isinstance(value, (tuple, list)) or len(value) != n_layers:
            raise bad(field, value, want)
        rows = []
        for row in value:
            if not isinstance(row, (tuple, list)) or len(row) != g:
                raise bad(field, value, want)
            if kind is bool:
                if not all(isinstance(x, bool) for x in row):
                    raise bad(field, row, want)
                rows.append(tuple(row))
            else:
                if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                           for x in row):
                    raise bad(field, row, want + " (finite numbers)")
                rows.append(tuple(float(x) for x in row))
        return tuple(rows)

    def check(self, *, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, model: str | None = None,
              windows: Sequence[int | None] | None = None) -> None:
        """Refuse a model of another shape, with both shapes named, or (``windows``: the model's layer windows, None
        for a global layer) of other sliding windows than the plan records. ``model`` (the model's name) only names
        it in the message: a plan fits any model of its shape (a local copy of the same checkpoint, say)."""
        other = (n_layers, n_heads, n_kv_heads, head_dim)
        named = f" {model}" if model else ""
        if other != self.shape:
            raise MultiheadError(
                f"this head plan was made for {self.model} of shape {_shape_text(self.shape)} but the "
                f"model{named} has shape {_shape_text(other)}: make a plan for this model"
            )
        if self.windows is not None:
            theirs = tuple(windows) if windows is not None else (None,) * n_layers
            if theirs != self.windows:
                raise MultiheadError(
                    f"this head plan was made for {self.model} with layer windows {_windows_text(self.windows)} but "
                    f"the model{named} has {_windows_text(theirs)}: make a plan for this model")

    # ------------------------------------------------------------------ what it says
    @property
    def n_layers(self) -> int:
        return self.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.shape[2]

    @property
    def full_fraction(self) -> float:
        """The fraction of KV heads that are full."""
        return sum(map(sum, self.full)) / (self.n_layers * self.n_kv_heads)

    @property
    def hybrid(self) -> bool:
        """Whether the plan's model has sliding and global layers (``windows`` recorded with both)."""
        return self.windows is not None and None in self.windows and any(w is not None for w in self.windows)

    @property
    def global_layers(self) -> list[int]:
        """The layers without a sliding window (every layer where ``windows`` is not recorded)."""
        if self.windows is None:
            return list(range(self.n_layers))
        return [i for i, w in enumerate(self.windows) if w is None]

    @property
    def global_full_fraction(self) -> float:
        """The fraction of the global layers' KV heads that are full (:attr:`full_fraction` on a model without
        sliding layers)."""
        layers = self.global_layers
        if not layers:
            return 0.0
        return sum(sum(self.full[i]) for i in layers) / (len(layers) * self.n_kv_heads)

    def full_heads(self, layer: int) -> list[int]:
        """The full KV heads of one layer, in order."""
        return [j for j, f in enumerate(self.full[layer]) if f]

    def streaming_heads(self, layer: int) -> list[int]:
        """The streaming KV heads of one layer, in order."""
        return [j for j, f in enumerate(self.full[layer]) if not f]

    def mask(self, length: int, *, device: torch.device | str | None = None) -> Tensor:
        """(n_layers, n_heads, length, length) bool, True = may attend: the uncached model's per-head equivalent of
        this plan over positions 0 .. length - 1. Query head i of a layer follows its KV head i // (h / g): causal
        where that KV head is full, :func:`~multihead.cache.sink_keep` (sinks + window) where it streams."""
        from multihead.cache.sink import sink_keep

        if not _is_int(length) or length < 1:
            raise MultiheadError(f"length ({length!r}) must be a positive int")
        _, h, g, _ = self.shape
        pos = torch.arange(length, device=device)
        causal = pos[None, :] <= pos[:, None]  # (n, n)
        stream = sink_keep(pos, pos, window=self.window, sink_tokens=self.sinks)  # (n, n)
        full = torch.tensor(self.full, dtype=torch.bool, device=device)  # (L, g)
        per_head = full.repeat_interleave(h // g, dim=1)  # (L, h): query head i -> KV head i // (h / g)
        return torch.where(per_head[:, :, None, None], causal, stream)  # (L, h, n, n)

    # ------------------------------------------------------------------ made from scores
    @classmethod
    def from_scores(cls, scores: Tensor | Sequence[Sequence[float]], fraction: float, *, sinks: int, window: int,
                    model: str, shape: Sequence[int], method: str,
                    windows: Sequence[int | None] | None = None) -> HeadPlan:
        """The plan whose full KV heads are the top ``round(fraction * n_layers * n_kv_heads)`` by score (higher =
        keeps every key). Equal scores are ranked in (layer, head) order: the earlier layer, then the lower head,
        is full first. ``budget`` records ``fraction`` and ``scores`` the scores.

        ``windows``: each layer's attention window (None: global). Where some layers slide, only the global layers'
        KV heads are ranked (the top ``round(fraction * global heads)``) and every sliding layer's are full: a
        sliding layer never holds more than its window, and a plan is about the keys beyond it."""
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise MultiheadError(f"fraction ({fraction!r}) must be a fraction of the KV heads in [0, 1]")
        shape4 = tuple(shape) if isinstance(shape, (tuple, list)) else shape
        ok = isinstance(shape4, tuple) and len(shape4) == 4 and all(_is_int(v) and v >= 1 for v in shape4)
        empty = tuple(tuple(False for _ in range(shape4[2])) for _ in range(shape4[0])) if ok else ()
        rows = scores.tolist() if isinstance(scores, Tensor) else scores
        probe = cls(full=empty, sinks=sinks, window=window, model=model, shape=shape4,  # type: ignore[arg-type]
                    method=method, scores=rows, windows=windows)  # type: ignore[arg-type]  # checks every field
        assert probe.scores is not None
        ranked = probe.global_layers if probe.hybrid else range(probe.n_layers)
        flat = [(-probe.scores[layer][head], layer, head) for layer in ranked for head in range(probe.n_kv_heads)]
        keep = round(fraction * len(flat))
        chosen = {(layer, head) for _, layer, head in sorted(flat)[:keep]}
        sliding = set(range(probe.n_layers)) - set(ranked)
        full = tuple(tuple(layer in sliding or (layer, head) in chosen for head in range(probe.n_kv_heads))
                     for layer in range(probe.n_layers))
        return cls(full=full, sinks=sinks, window=window, model=model, shape=probe.shape, method=method,
                   budget=float(fraction), scores=probe.scores, windows=probe.windows)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model,
                "shape": dict(zip(SHAPE_NAMES, self.shape, strict=True)), "method": self.method,
                "budget": self.budget, "sinks": self.sinks, "window": self.window,
                "full": [list(r) for r in self.full],
                "scores": None if self.scores is None else [list(r) for r in self.scores],
                **({} if self.windows is None else {"windows": list(self.windows)})}

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON (whole or absent: :func:`multihead.files.write_text`); returns the path."""
        from multihead.files import output_file, write_text

        return write_text(output_file(path, ("json",)), json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HeadPlan:
        """A plan from a JSON file of :meth:`save`, bounded (:func:`multihead.hf.config.read_json_object`). A file
        missing, too large, not JSON, of another format, or with a field missing or bad raises a MultiheadError
        naming the file, the field and its value."""
        from multihead.hf.config import read_json_object

        data = read_json_object(path, "head plan")
        text = str(path)
        where = f"head plan {text if len(text) <= 200 else text[:197] + '...'!r}"
        if data.get("format") != FORMAT:
            raise MultiheadError(f"{where}: field 'format' ({_short(data.get('format'))}) must be {FORMAT!r} (a "
                                 "file written by HeadPlan.save)")
        if data.get("version") != VERSION:
            raise MultiheadError(f"{where}: field 'version' ({_short(data.get('version'))}) must be {VERSION}")
        missing = [f for f in FIELDS if f not in data]
        if missing:
            raise MultiheadError(f"{where}: field {missing[0]!r} is missing")
        unknown = sorted(set(data) - set(FIELDS) - set(OPTIONAL))
        if unknown:
            raise MultiheadError(f"{where}: field {unknown[0]!r} is unknown (the fields are "
                                 f"{', '.join(FIELDS + OPTIONAL)})")
        shape = data["shape"]
        if not isinstance(shape, dict) or sorted(shape) != sorted(SHAPE_NAMES):
            raise MultiheadError(f"{where}: field 'shape' ({_short(shape)}) must be an object of "
                                 f"{', '.join(SHAPE_NAMES)}")
        plan = object.__new__(cls)
        values = {"full": data["full"], "sinks": data["sinks"], "window": data["window"], "model": data["model"],
                  "shape": tuple(shape[n] for n in SHAPE_NAMES), "method": data["method"],
                  "budget": data["budget"], "scores": data["scores"], "windows": data.get("windows")}
        for name, value in values.items():
            object.__setattr__(plan, name, value)
        plan._validate(where)
        return plan
