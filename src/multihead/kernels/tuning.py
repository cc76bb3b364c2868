"""Tuning: measure, once per host, the CPU decisions :mod:`multihead.kernels.cpu` looks up, and write them to the host's
table.

::

    multihead tune --model smollm2 --dtype bfloat16      # or, in Python:
    tuning.tune_model(model, lengths=(1024, 4096, 8192))  # measures, writes cpu.table_path(), returns the entries

What is measured, each choice against the others in one process, alternating, the median of ``repeats`` passes:

- every one-row product shape of the model (its :class:`multihead.layers.linear.Linear` weights, and the tied
  head), each kind its cell allows (:func:`multihead.layers.linear.kinds`), over all of the model's weights of that
  shape in turn, with the CPU's last-level cache flushed before each pass, so the weights come from memory as they
  do in decoding (a weight in cache ranks the kinds differently); and for a float32 model each shape's product at a
  prefill chunk's 512 rows, F.linear (MKL's) against oneDNN's matmul;
- every decode attention shape of the model at each length asked (its power-of-two range of key counts): SDPA's
  GQA fold where the rule leaves it open, and the native dense kernel against SDPA where it fits, over one cache a
  layer in turn (flushed likewise).

A kind is kept only when its median is under KIND_MARGIN of the plain one's (F.linear, SDPA unfolded): close calls
keep the plain path. The table then holds the choices (and the medians measured, for the record); the forward
reads it and never measures, so every step of a process, and every process on the host, computes the same way
(:mod:`multihead.kernels.cpu`). Tuning runs the kernels for real: run it on an otherwise idle machine.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from multihead import kernels
from multihead.errors import MultiheadError
from multihead.kernels import cpu, native
from multihead.layers import linear
from multihead.layers.masks import build_mask

KIND_MARGIN = 0.95  # another kind is taken when its median time is under this fraction of the plain one's
REPEATS = 7
FLUSH_MAX = 1 << 29  # bytes written to flush the last-level cache before a pass, at most


# ---------------------------------------------------------------------------------------------- the table file
def write_table(entries: dict[str, str], measured: dict[str, dict[str, float]] | None = None, *,
                path: Path | None = None, replace: bool = False) -> Path:
    """Write decisions into this host's table (:func:`multihead.kernels.cpu.table_path`, or ``path``): merged into what
    it holds unless ``replace``, checked, whole or not at all; the process reads the new table at its next decision."""
    from multihead.files import write_text

    target = cpu.table_path() if path is None else path
    cpu.check_entries(entries, "the entries to write")
    old: dict[str, Any] = {}
    if target.exists() and not replace:
        try:
            old = cpu.read_table(target)
        except MultiheadError:  # a corrupt or old table is replaced, not merged
            old = {}
    merged = {**old.get("entries", {}), **entries}
    record = {**old.get("measured", {}), **(measured or {})}
    data = {"format": cpu.TABLE_FORMAT, "version": cpu.TABLE_VERSION, "host": cpu.host(),
            "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "entries": dict(sorted(merged.items())), "measured": dict(sorted(record.items()))}
    write_text(target, json.dumps(data, indent=1) + "\n")
    cpu.reload_table()
    return target


def clear_table(path: Path | None = None) -> bool:
    """Remove this host's table (the rules decide again); whether there was one."""
    target = cpu.table_path() if path is None else path
    existed = target.exists()
    if existed:
        target.unlink()
    cpu.reload_table()
    return existed


# ---------------------------------------------------------------------------------------------- measuring
def _cache_bytes() -> int:
    """The last-level cache's size, from sysfs (64 MiB where it cannot be read)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * unit)
        except ValueError:
            continue
    return best or (64 << 20)


class _Flush:
    """Writes a buffer larger than the last-level cache, so what a pass reads next comes from memory."""

    def __init__(self, enabled: bool = True) -> None:
        size = min(2 * _cache_bytes(), FLUSH_MAX) if enabled else 0
        self.buffer = torch.empty(size // 4, dtype=torch.float32) if size else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.fill_(1.0)


def measure(runs: dict[str, Callable[[], object]], *, repeats: int = REPEATS, flush: Callable[[], None] | None = None
            ) -> dict[str, float]:
    """The median seconds of each of ``runs`` (name -> a pass), taken in turn, the order rotated every round, after
    one untimed pass each (allocation, kernel set-up); ``flush`` runs before every pass."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for name in names:
            runs[name]()
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if flush is not None:
                    flush()
                began = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def fastest(medians: dict[str, float], plain: str) -> str:
    """The kind of the fastest median if it is under KIND_MARGIN of ``plain``'s, else ``plain``."""
    best = min(medians, key=medians.__getitem__)
    return best if best == plain or medians[best] < KIND_MARGIN * medians[plain] else plain


def tune_products(weights: Iterable[Tensor], *, rows: int = 1, repeats: int = REPEATS, flush: bool = True,
                  progress: Callable[[str], None] | None = None) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """Decide the product kind of each shape among ``weights`` (all the weights of a shape are run in turn, as a
    model's layers run), for ``rows`` rows: the entries and the medians measured, by
    :func:`multihead.kernels.cpu.product_key`. Shapes the split does not take
    (:func:`multihead.kernels.cpu.split_product`) choose between F.linear and oneDNN in float32
    (:data:`multihead.layers.linear.MANY_ROW_KINDS`; a prefill's rows, past the split's, share one key) and are
    skipped otherwise: F.linear runs them anyway."""
    by_shape: dict[tuple[int, int, torch.dtype], list[Tensor]] = {}
    for w in weights:
        by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w.detach())
    entries: dict[str, str] = {}
    record: dict[str, dict[str, float]] = {}
    flusher = _Flush(flush)
    for (out_features, in_features, dtype), ws in sorted(by_shape.items(), key=lambda item: str(item[0])):
        x = torch.randn(rows, in_features).to(dtype)
        n = cpu.split_product(rows, ws[0], x)
        if n > 1:
            allowed = linear.kinds(rows, dtype)
        elif rows > 1 and cpu.onednn_fits(x, ws[0], None):  # a float32 product the split leaves: oneDNN's or MKL's
            allowed = linear.MANY_ROW_KINDS
        else:
            continue
        key = cpu.product_key(out_features, in_features, dtype, rows, n, cpu.intra_op_threads())
        runs = {kind: _product_pass(kind, x, ws, n) for kind in allowed}
        medians = measure(runs, repeats=repeats, flush=flusher)
        entries[key] = fastest(medians, "linear")
        record[key] = medians
        if entries[key] == "blas":  # oneDNN's switch cannot be compiled: the fastest of the others for a graph
            entries[key + " compiled"] = fastest({k: t for k, t in medians.items() if k != "blas"}, "linear")
        if progress is not None:
            progress(f"{key}: {entries[key]} (" + ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in medians.items()) + ")")
    return entries, record


def _product_pass(kind: str, x: Tensor, weights: Sequence[Tensor], n: int) -> Callable[[], object]:
    def run() -> None:
        for w in weights:
            linear.run(kind, x, w, None, n)
    return run


def tune_attention(shapes: Iterable[tuple[int, int, int, int]], lengths: Iterable[int], *, dtype: torch.dtype,
                   layers: int = 8, repeats: int = REPEATS, flush: bool = True,
                   progress: Callable[[str], None] | None = None) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """Decide, for each decode attention shape (b, h, g, d) at each length t (the power-of-two range of t), SDPA's
    GQA fold where the rule leaves it open and the native dense kernel against SDPA where it fits, over ``layers``
    caches of t keys in turn: the entries and the medians measured."""
    entries: dict[str, str] = {}
    record: dict[str, dict[str, float]] = {}
    flusher = _Flush(flush)
    threads = cpu.intra_op_threads()
    for b, h, g, d in sorted(set(shapes)):
        for t in sorted(set(lengths)):
            q = torch.randn(b, h, 1, d).to(dtype)
            caches = [(torch.randn(b, g, t, d).to(dtype), torch.randn(b, g, t, d).to(dtype)) for _ in range(layers)]
            spec = build_mask(batch=b, n_heads=h, s=1, t=t)
            scale = d ** -0.5
            fold_key = cpu.attention_key("fold", b, h, g, dtype, t, threads)
            fold = cpu.fold_gqa_decode(b, h, g, 1, q.device, False, t, dtype)
            items = b * g
            if g != h and not (h // g >= 4 or items % threads == 0 or items >= 2 * threads):  # the rule leaves it open
                runs = {kind: _sdpa_pass(q, caches, spec, scale, kind == "folded") for kind in cpu.FOLD_KINDS}
                medians = measure(runs, repeats=repeats, flush=flusher)
                entries[fold_key] = fastest(medians, "unfolded")
                record[fold_key] = medians
                fold = entries[fold_key] == "folded"
                _report(progress, fold_key, entries[fold_key], medians)
            if native.library() is not None and native.dense_fits(q, *caches[0]):
                key = cpu.attention_key("native-attention", b, h, g, dtype, t, threads)
                runs = {"sdpa": _sdpa_pass(q, caches, spec, scale, fold), "native": _native_pass(q, caches, scale)}
                medians = measure(runs, repeats=repeats, flush=flusher)
                entries[key] = fastest(medians, "sdpa")
                record[key] = medians
                _report(progress, key, entries[key], medians)
    return entries, record


def _report(progress: Callable[[str], None] | None, key: str, kind: str, medians: dict[str, float]) -> None:
    if progress is not None:
        progress(f"{key}: {kind} (" + ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in medians.items()) + ")")


def _sdpa_pass(q: Tensor, caches: Sequence[tuple[Tensor, Tensor]], spec: Any, scale: float, fold: bool
               ) -> Callable[[], object]:
    def run() -> None:
        for k, v in caches:
            kernels.sdpa_attention(q, k, v, spec, scale=scale, fold=fold)
    return run


def _native_pass(q: Tensor, caches: Sequence[tuple[Tensor, Tensor]], scale: float) -> Callable[[], object]:
    def run() -> None:
        for k, v in caches:
            native.attend_dense(q, k, v, scale, check=False)
    return run


# ---------------------------------------------------------------------------------------------- a model
def model_shapes(model: nn.Module) -> tuple[list[Tensor], list[tuple[int, int, int]], int]:
    """A model's product weights (every :class:`multihead.layers.linear.Linear`, and a tied embedding used as the
    head), its attention layers' (h, g, d) shapes and their number, as decoding uses them."""
    from multihead.layers.attention import MultiHeadAttention

    weights = [m.weight for m in model.modules() if isinstance(m, linear.Linear)]
    embed = getattr(model, "embed", None)
    if getattr(model, "lm_head", "absent") is None and isinstance(embed, nn.Embedding):  # a tied head (our port)
        weights.append(embed.weight)
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    heads = sorted({(m.n_heads, m.local_kv_heads, m.head_dim) for m in layers})
    return weights, heads, len(layers)


PREFILL_ROWS = 512  # a prefill chunk's rows, measured for every prefill's products (they share one key)
LENGTHS = (256, 512, 1024, 2048, 4096, 8192)  # each stands for its power-of-two range of keys (256: a 260-key ring)


def tune_model(model: nn.Module, *, lengths: Sequence[int] = LENGTHS, batch: int = 1, repeats: int = REPEATS,
               flush: bool = True, write: bool = True, progress: Callable[[str], None] | None = None,
               heads: Sequence[tuple[int, int, int]] | None = None, n_layers: int | None = None) -> dict[str, str]:
    """Measure and record every decision a decoding ``model`` (batch ``batch``, contexts up to ``lengths``) looks
    up: its one-row products, a float32 prefill's products (:data:`PREFILL_ROWS` rows) and its decode attention at
    each length, in the model's dtype. Writes the host's table
    (unless ``write`` is False) and returns the entries. Turned off speed paths (:func:`multihead.kernels.cpu.disabled`)
    have nothing to tune.

    ``heads`` (with ``n_layers``): the (h, g, d) of attention layers that are not multihead's own modules, as a
    transformers model switched by :func:`multihead.hf.enable` has (its products are multihead's Linear there; the
    caller reads the heads from its config, :attr:`multihead.models.decoder.Decoder.shape`)."""
    if not cpu.enabled():
        raise MultiheadError("the CPU speed paths are off (multihead.kernels.cpu.disabled): there is nothing to tune")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in lengths) or not lengths:
        raise MultiheadError(f"lengths ({list(lengths)!r}) must be positive ints")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise MultiheadError(f"batch ({batch!r}) must be a positive int")
    weights, found_heads, found_layers = model_shapes(model)
    if heads is None:
        heads, n_layers = found_heads, found_layers
    elif not heads or any(len(x) != 3 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in x)
                          or x[0] % x[1] for x in heads):
        raise MultiheadError(f"heads ({list(heads)!r}) must be (h, g, d) positive ints, g dividing h")
    else:
        heads, n_layers = sorted(set(heads)), n_layers or found_layers or 8
    if not weights and not heads:
        raise MultiheadError(f"{type(model).__name__} has no multihead Linear or attention layer to tune")
    dtype = weights[0].dtype if weights else torch.float32
    entries, record = tune_products(weights, rows=batch, repeats=repeats, flush=flush, progress=progress)
    if dtype == torch.float32:  # a prefill's float32 products: oneDNN's matmul or MKL's (the rule guesses by vendor)
        more, more_record = tune_products(weights, rows=PREFILL_ROWS, repeats=repeats, flush=flush,
                                          progress=progress)
        entries.update(more)
        record.update(more_record)
    more, more_record = tune_attention([(batch, h, g, d) for h, g, d in heads], lengths, dtype=dtype,
                                       layers=max(1, min(n_layers, 8)), repeats=repeats, flush=flush,
                                       progress=progress)
    entries.update(more)
    record.update(more_record)
    if write:
        write_table(entries, record)
    return entries


def describe() -> str:
    """This host's table as text: where it is, what it is valid for, its decisions (or that there is none)."""
    path = cpu.table_path()
    lines = [f"tuning table: {path}", "host: " + json.dumps(cpu.host(), sort_keys=True)]
    if not path.exists():
        lines.append("no decisions measured here yet: the default rules decide (multihead tune measures them)")
    else:
        data = cpu.read_table(path)
        lines.append(f"written {data.get('written', '?')}, {len(data['entries'])} decisions:")
        lines += [f"  {key}: {kind}" for key, kind in data["entries"].items()]
    lines.append("default rules:")
    lines += [f"  {word}: {rule}" for word, rule in cpu.DEFAULTS.items()]
    if native.unavailable():
        lines.append(f"native kernels: not available ({native.unavailable()})")
    else:
        lines.append(f"native kernels: variant {native.loaded_variant()} (MULTIHEAD_NATIVE_VARIANT to choose; "
                     f"built in {native.cache_dir()})")
    return "\n".join(lines)
