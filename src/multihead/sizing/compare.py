"""One model as MHA, GQA, MQA and MLA side by side: what the number of KV heads (or a latent) does to the cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from multihead.config import MLAConfig
from multihead.divisors import divisors
from multihead.errors import MultiheadError
from multihead.files import save_figure
from multihead.sizing import cost
from multihead.sizing.presets import ModelConfig

if TYPE_CHECKING:
    from multihead.sizing import FitModel, ModelSize
    from multihead.sizing.hardware import Hardware


@dataclass(frozen=True)
class Variant:
    variant: str
    n_kv_heads: int
    group_size: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    ratio_to_mha: float
    params_per_layer: int
    max_context: int | None  # the context that fits (count's answer for the model's own row); None: any
    is_model: bool
    weight_bytes: int | None = None  # the whole model's weights with this attention, when its config says enough
    max_context_by_memory: int | None = None  # before the model's own context caps it
    note: str | None = None  # why a row has no answer (a --tp this head count cannot split)
    weight_bytes_per_device: int | None = None  # one device's share under --tp (replicated parts whole)
    prefill_seconds: float | None = None  # with a hardware: multihead.sizing.hardware.estimate's prefill of seq tokens
    decode_tokens_per_second: float | None = None  # ... and its decode, per sequence, at the context seq
    decode_bound: str | None = None
    devices_per_kv_head: int = 1  # > 1: fewer KV heads than --tp devices, each on this many (multihead.sizing.kv_share)
    kv_cache_bytes_per_device: int | None = None  # one device's share under --tp (sizing.kv_on_device)


def variant_model(model: ModelConfig, n_kv_heads: int | None = None, mla: MLAConfig | None = None) -> ModelConfig:
    """The model with another KV head count (its layers' windows kept), or with ``mla`` on every layer."""
    if mla is not None:
        return dataclasses.replace(model, mla=mla)
    g = model.attention.n_kv_heads if n_kv_heads is None else n_kv_heads
    assert g is not None
    return dataclasses.replace(model, attention=dataclasses.replace(model.attention, n_kv_heads=g), mla=None)


def compare_variants(
    model: ModelConfig, *, seq: int, batch: int = 1, dtype: str = "bf16", memory_bytes: int | None = None,
    fitting: FitModel | None = None, hardware: Hardware | None = None,
) -> list[Variant]:
    """The model's attention with every valid KV head count (each divisor of n_heads), MHA first, MQA last, and MLA.

    The context that fits is `multihead count`'s (multihead.sizing's one fit model, ``fitting``: weights, KV cache,
    prefill activations and reserve per device, capped at the model's own context) where the config describes the
    whole model; the KV cache alone (less the reserve) where it gives only the attention's sizes. With ``hardware``
    (a whole model only, as `count --hardware`): each variant's prefill and decode estimate
    (:func:`multihead.sizing.hardware.estimate`) on ``fitting.tp`` such devices."""
    from multihead import sizing
    from multihead.sizing import FitModel, check_tp, kv_bytes, kv_max_context, largest_context

    sizing.check_seq(model, seq)
    fitting = fitting or FitModel(dtype=dtype, weights_dtype=dtype)
    whole = model.hf is not None and "vocab_size" in model.hf
    if (memory_bytes is not None or hardware is not None) and whole:
        try:  # a fit answer counts the weights: a family the count does not know gets none (not the KV cache alone)
            sizing.model_size(model)
        except sizing.NotCounted as err:
            raise sizing.cannot_fit(model, memory_bytes or (hardware.memory if hardware else 0), str(err)) from None
    if hardware is not None and not whole:
        raise MultiheadError("--hardware estimates the whole model's speed: describe the whole model with --preset "
                             "or --config (--d-model and --heads describe its attention alone)")
    base = model.attention
    counts = sorted(divisors(base.n_heads), reverse=True)
    candidates: list[tuple[str, ModelConfig, bool]] = []
    for g in counts:
        a = dataclasses.replace(base, n_kv_heads=g)
        candidates.append((a.variant if a.variant != "GQA" else f"GQA-{g}", variant_model(model, g),
                           g == base.n_kv_heads and model.mla is None))
    mla = model_mla(model)
    if mla is not None:
        name = "MLA" if model.mla is not None else f"MLA (r {mla.kv_lora_rank}, rope {mla.qk_rope_head_dim})"
        candidates.append((name, variant_model(model, mla=mla), model.mla is not None))
    rows = []
    mha_bytes = None
    for name, m, is_model in candidates:
        total = kv_bytes(m, context=seq, batch=batch, dtype=dtype)
        mha_bytes = total if mha_bytes is None else mha_bytes
        per_layer = (cost.mla_parameters(m.mla).total if m.mla is not None else cost.parameters(m.attention).total)
        size = _size(m)
        weights = None if size is None else parts_weight_bytes(size.parts, fitting.weights_dtype, name=size.name)
        context, by_memory, note = None, None, None
        per_device, speed = None, None
        try:
            check_tp(m, fitting.tp)
        except MultiheadError:
            note = f"--tp {fitting.tp} neither divides nor is a multiple of {m.attention.n_kv_heads} KV heads"
        fit_m = fitting if m.mla is None or fitting.cache in ("full", "latent") else dataclasses.replace(
            fitting, cache="full")
        if note is None and size is not None:
            per_device = sizing.fit(m, size, seq=seq, batch=batch, memory=memory_bytes or 0, tp=fit_m.tp,
                                    **sizing.fit_kwargs(fit_m)).weights_per_device
        if memory_bytes is not None and note is None:
            if size is not None:
                context, by_memory, _ = largest_context(m, size, seq=seq, batch=batch, memory=memory_bytes,
                                                        fitting=fit_m)
            else:
                heads, _ = sizing.kv_share(m, fitting.tp)  # one device holds heads of the g KV heads' cache
                room = max(0, memory_bytes - fitting.reserve) * (1 if m.mla is not None else
                                                                 int(m.attention.n_kv_heads or 1) // heads)
                by_memory = kv_max_context(m, memory=room, batch=batch, dtype=dtype,
                                           cache="full" if m.mla is not None else fitting.cache)
                limit = model.hf.context_limit if model.hf is not None else model.max_context
                context = by_memory if limit is None or by_memory is None else min(by_memory, limit)
        if hardware is not None and note is None and size is not None:
            from multihead.sizing.hardware import estimate

            speed = estimate(m, size, hardware, seq=seq, batch=batch, dtype=dtype, weights_dtype=fit_m.weights_dtype,
                             tp=fit_m.tp, cache=fit_m.cache)
        rows.append(Variant(
            variant=name,
            n_kv_heads=1 if m.mla is not None else int(m.attention.n_kv_heads or 0),
            group_size=base.n_heads // (1 if m.mla is not None else int(m.attention.n_kv_heads or 1)),
            kv_bytes_per_token=sum(cost.layer_cache_bytes_per_token(m.attention, layer, dtype=dtype, mla=m.mla)
                                   for layer in m.layers()),
            kv_cache_bytes=total,
            kv_cache_bytes_per_device=sizing.kv_on_device(m, total, fitting.tp) if note is None else None,
            ratio_to_mha=total / mha_bytes if mha_bytes else 0.0,
            params_per_layer=per_layer,
            max_context=context,
            is_model=is_model,
            weight_bytes=weights,
            max_context_by_memory=by_memory,
            note=note,
            weight_bytes_per_device=per_device,
            prefill_seconds=None if speed is None else speed["prefill"]["seconds"],
            decode_tokens_per_second=None if speed is None else speed["decode"]["tokens_per_second_per_sequence"],
            decode_bound=None if speed is None else speed["decode"]["bound"],
            devices_per_kv_head=1 if m.mla is not None or note else sizing.kv_share(m, fitting.tp)[1],
        ))
    return rows


def _size(model: ModelConfig) -> ModelSize | None:
    """The whole model's parameters (multihead.sizing), or None when the config does not describe the whole model
    (sizes given on the command line)."""
    from multihead.sizing import model_size

    if model.hf is None or "vocab_size" not in model.hf:
        return None
    try:
        return model_size(model)
    except MultiheadError:
        return None


def parts_weight_bytes(parts: dict[str, int], dtype: str, *, name: str) -> int:
    from multihead.sizing import parts_weight_bytes as wb

    return wb(parts, dtype, name=name)


def model_mla(model: ModelConfig) -> MLAConfig | None:
    """The model's own MLA layer, or one in DeepSeek's proportions at its width and heads (latent 4 * head_dim,
    RoPE key head_dim / 2, like V2/V3's 512 and 64 for heads of 128); None where those would compress nothing."""
    if model.mla is not None:
        return model.mla
    a = model.attention
    latent, rope = 4 * a.head_dim, max(2, a.head_dim // 2 // 2 * 2)
    if latent >= a.n_heads * 2 * a.head_dim:  # MLAConfig: narrower than the K and V it expands to
        return None
    return MLAConfig(d_model=a.d_model, n_heads=a.n_heads, kv_lora_rank=latent, qk_nope_head_dim=a.head_dim,
                     qk_rope_head_dim=rope, v_head_dim=a.head_dim, bias=a.bias)


def plot_series(model: ModelConfig, rows: list[Variant], *, batch: int, dtype: str, seq: int,
                fitting: FitModel | None = None) -> dict[str, list[tuple[int, int]]]:
    """What :func:`plot_variants` draws: for each row with an answer, (context, bytes on one device) at powers of two
    from 64 to twice the larger of ``seq`` and the model's context. The bytes are those the table's context counts:
    multihead.sizing.fit's per-device total (weights, KV cache, activations and reserve, split over ``fitting.tp``)
    where the config describes the whole model, else one device's KV cache plus the reserve."""
    from multihead import sizing

    fitting = fitting or sizing.FitModel(dtype=dtype, weights_dtype=dtype)
    top = max(seq, sizing.context_limit(model) or 0, 1024) * 2
    contexts = [2**k for k in range(6, top.bit_length() + 1)]
    mla = model_mla(model)
    out: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        if r.note is not None:  # no answer for this row (a --tp it cannot split): no line either
            continue
        m = variant_model(model, mla=mla) if r.variant.startswith("MLA") and mla is not None else variant_model(
            model, r.n_kv_heads)
        fit_m = fitting if m.mla is None or fitting.cache in ("full", "latent") else dataclasses.replace(
            fitting, cache="full")
        size = _size(m) if r.weight_bytes is not None else None
        if size is not None:
            ys = [sizing.fit(m, size, seq=c, batch=batch, memory=0, tp=fit_m.tp, **sizing.fit_kwargs(fit_m)).per_device
                  for c in contexts]
        else:
            ys = [sizing.kv_on_device(m, sizing.kv_bytes(m, context=c, batch=batch, dtype=dtype,
                                                         cache="full" if m.mla is not None else fit_m.cache),
                                      fit_m.tp) + fit_m.reserve for c in contexts]
        out[r.variant] = list(zip(contexts, ys, strict=True))
    return out


def plot_variants(
    model: ModelConfig,
    rows: list[Variant],
    path: str | Path,
    *,
    batch: int,
    dtype: str,
    seq: int,
    memory_bytes: int | None = None,
    fitting: FitModel | None = None,
) -> str:
    """A PNG of one device's memory against context length (:func:`plot_series`: what the table's context
    counts), a line per variant, one for the device memory, and the model's own context."""
    from multihead import sizing
    from multihead.errors import require

    matplotlib = require("matplotlib", "plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fitting = fitting or sizing.FitModel(dtype=dtype, weights_dtype=dtype)
    series = plot_series(model, rows, batch=batch, dtype=dtype, seq=seq, fitting=fitting)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    gib = 2**30
    mla = model_mla(model)
    whole = any(r.weight_bytes is not None for r in rows)
    for r in rows:
        if r.variant not in series:
            continue
        if r.variant.startswith("MLA") and mla is not None:
            label = f"{r.variant} (one latent of {mla.latent_dim} per token)"
        else:
            label = f"{r.variant} ({r.n_kv_heads} KV head{'s' if r.n_kv_heads > 1 else ''})"
        xs, ys = zip(*series[r.variant], strict=True)
        ax.plot(xs, [y / gib for y in ys], marker="o", markersize=3, linewidth=2.5 if r.is_model else 1.5,
                linestyle="--" if r.variant.startswith("MLA") else "-",
                label=label + (" - the model" if r.is_model else ""))
    if memory_bytes is not None:
        ax.axhline(memory_bytes / gib, color="black", linestyle="--",
                   label=f"device memory {memory_bytes / gib:.1f} GiB")
    ax.axvline(seq, color="grey", linestyle=":", label=f"context {seq:,}")
    limit = sizing.context_limit(model)
    if limit is not None:
        ax.axvline(limit, color="grey", linestyle="-.", label=f"the model's own context {limit:,}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)  # linear: the gap to the device's memory is what the table's context reads
    ax.set_xlabel("context length (tokens)")
    tp = f" (tp {fitting.tp})" if fitting.tp > 1 else ""
    ax.set_ylabel(f"memory per device{tp} (GiB)")
    what = ("weights + KV cache + prefill activations" if whole else "KV cache") + (
        " + reserve" if fitting.reserve else "")
    ax.set_title(f"{model.name}: {what} per device{', over ' + str(fitting.tp) + ' devices' if fitting.tp > 1 else ''}"
                 f"\n{model.n_layers} layers, batch {batch}, {dtype}"
                 + (f", weights {fitting.weights_dtype}" if whole else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out = Path(path)
    try:
        save_figure(fig, out, make_folder=False)  # (a --plot path in a folder that does not exist is refused)
    finally:
        plt.close(fig)
    return str(out)
