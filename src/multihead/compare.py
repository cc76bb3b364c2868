"""One model as MHA, GQA, MQA and MLA side by side: what the number of KV heads (or a latent) does to the cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from multihead import cost
from multihead.config import MLAConfig
from multihead.divisors import divisors
from multihead.errors import MultiheadError
from multihead.files import save_figure
from multihead.presets import ModelConfig


@dataclass(frozen=True)
class Variant:
    variant: str
    n_kv_heads: int
    group_size: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    ratio_to_mha: float
    params_per_layer: int
    max_context: int | None
    is_model: bool
    weight_bytes: int | None = None  # the whole model's weights with this attention, when its config says enough


def compare_variants(
    model: ModelConfig, *, seq: int, batch: int = 1, dtype: str = "bf16", memory_bytes: int | None = None
) -> list[Variant]:
    """The model's attention with every valid KV head count (each divisor of n_heads), MHA first, MQA last."""
    base = model.attention
    counts = sorted(divisors(base.n_heads), reverse=True)
    rows = []
    mha_bytes = None
    others = _weights_without_attention(model)  # parameters outside attention, or None
    for g in counts:
        a = dataclasses.replace(base, n_kv_heads=g)
        total = cost.kv_cache_bytes(a, context=seq, batch=batch, n_layers=model.n_layers, dtype=dtype)
        mha_bytes = total if mha_bytes is None else mha_bytes
        weights = None if others is None else weight_bytes(others + model.n_layers * cost.parameters(a).total, dtype)
        room = memory_bytes if memory_bytes is None or weights is None else max(0, memory_bytes - weights)
        rows.append(Variant(
            variant=a.variant if a.variant != "GQA" else f"GQA-{g}",
            n_kv_heads=g,
            group_size=base.n_heads // g,
            kv_bytes_per_token=cost.kv_cache_bytes_per_token_per_layer(a, dtype) * model.n_layers,
            kv_cache_bytes=total,
            ratio_to_mha=total / mha_bytes if mha_bytes else 0.0,
            params_per_layer=cost.parameters(a).total,
            max_context=None if room is None else cost.max_context(
                a, memory_bytes=room, batch=batch, n_layers=model.n_layers, dtype=dtype),
            is_model=g == base.n_kv_heads and model.mla is None,
            weight_bytes=weights,
        ))
    mla = model_mla(model)
    if mla is not None:
        per_token = mla.latent_dim * cost.dtype_bytes(dtype) * model.n_layers
        total = cost.mla_cache_bytes(mla, context=seq, batch=batch, n_layers=model.n_layers, dtype=dtype)
        weights = None if others is None else weight_bytes(
            others + model.n_layers * cost.mla_parameters(mla).total, dtype)
        room = memory_bytes if memory_bytes is None or weights is None else max(0, memory_bytes - weights)
        rows.append(Variant(
            variant="MLA" if model.mla is not None else f"MLA (r {mla.kv_lora_rank}, rope {mla.qk_rope_head_dim})",
            n_kv_heads=1, group_size=base.n_heads, kv_bytes_per_token=per_token, kv_cache_bytes=total,
            ratio_to_mha=total / mha_bytes if mha_bytes else 0.0,
            params_per_layer=cost.mla_parameters(mla).total,
            max_context=None if room is None else room // (per_token * batch),
            is_model=model.mla is not None,
            weight_bytes=weights,
        ))
    return rows


def _weights_without_attention(model: ModelConfig) -> int | None:
    """The whole model's parameters outside its attention layers (multihead.sizing), or None when the config does
    not describe the whole model (sizes given on the command line)."""
    from multihead.sizing import model_size

    if model.hf is None or "vocab_size" not in model.hf:
        return None
    try:
        size = model_size(model)
    except MultiheadError:
        return None
    return size.total - size.parts["attention"]


def weight_bytes(params: int, dtype: str) -> int:
    from multihead.sizing import weight_bytes as wb

    return wb(params, dtype)


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


def plot_variants(
    model: ModelConfig,
    rows: list[Variant],
    path: str | Path,
    *,
    batch: int,
    dtype: str,
    seq: int,
    memory_bytes: int | None = None,
) -> str:
    """A PNG of KV-cache memory against context length, a line per variant and one for the device memory."""
    from multihead.errors import require

    matplotlib = require("matplotlib", "plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(seq, model.max_context or 0, 1024) * 2
    contexts = [2**k for k in range(6, top.bit_length() + 1)]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    gib = 2**30
    mla = model_mla(model)
    model_row = next((r for r in rows if r.is_model), rows[0])
    if model_row.weight_bytes is not None:
        ax.axhline(model_row.weight_bytes / gib, color="grey", linestyle="-.",
                   label=f"the model's weights alone ({dtype})")
    for r in rows:
        if r.variant.startswith("MLA") and mla is not None:
            ys = [cost.mla_cache_bytes(mla, context=c, batch=batch, n_layers=model.n_layers, dtype=dtype) / gib
                  for c in contexts]
            label = f"{r.variant} (one latent of {mla.latent_dim} per token)"
        else:
            a = dataclasses.replace(model.attention, n_kv_heads=r.n_kv_heads)
            ys = [cost.kv_cache_bytes(a, context=c, batch=batch, n_layers=model.n_layers, dtype=dtype) / gib
                  for c in contexts]
            label = f"{r.variant} ({r.n_kv_heads} KV head{'s' if r.n_kv_heads > 1 else ''})"
        if r.weight_bytes is not None:  # the whole model: its weights plus the cache
            ys = [y + r.weight_bytes / gib for y in ys]
        ax.plot(contexts, ys, marker="o", markersize=3, linewidth=2.5 if r.is_model else 1.5,
                linestyle="--" if r.variant.startswith("MLA") else "-",
                label=label + (" - the model" if r.is_model else ""))
    if memory_bytes is not None:
        ax.axhline(memory_bytes / gib, color="black", linestyle="--",
                   label=f"device memory {memory_bytes / gib:.1f} GiB")
    ax.axvline(seq, color="grey", linestyle=":", label=f"context {seq}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("weights + KV cache (GiB)" if model_row.weight_bytes is not None else "KV cache (GiB)")
    what = "weights + KV cache" if model_row.weight_bytes is not None else "KV cache"
    ax.set_title(f"{model.name}: {what}, {model.n_layers} layers, batch {batch}, {dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(path)
    save_figure(fig, out)
    plt.close(fig)
    return str(out)
