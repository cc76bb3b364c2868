"""The KV trade-off on a sentence encoder (all-MiniLM-L6-v2): what fewer KV heads, quantized keys and values, and
pruned heads cost, measured as 1 - cosine between each text's embedding and the original model's.

An encoder keeps no cache, but its keys and values are the same tensors a cache would hold, so the methods that
apply are the ones acting on them: KV heads mean-pooled into fewer (hook_k / hook_v), keys and values quantized
as a cache would store them (keys per channel over token groups, values per token over channel groups), and heads
pruned by ablation importance (their outputs zeroed at hook_z, which for the function is pruning them). Sinks and
windows are for causal decoding and do not apply. Each text is encoded alone, so no padding enters a group.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from multihead.cache import check_bits, fake_quantize_keys, fake_quantize_values
from multihead.errors import MultiheadError
from multihead.layers.hooks import HookFn, HookPoint, hooks, pool_kv_hook, zero_heads


@dataclass(frozen=True)
class EncoderSettings:
    texts: int = 256
    calibration: int = 32
    kv_heads: tuple[int, ...] = (6, 4, 3, 2, 1)
    bits: tuple[int, ...] = (8, 4, 2)
    group: int = 32
    prune: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5)

    def __post_init__(self) -> None:
        from multihead.tradeoff.prune import check_fraction

        for name in ("texts", "calibration", "group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MultiheadError(f"{name} ({value!r}) must be a positive integer")
        for b in self.bits:
            check_bits(b)
        for f in self.prune:
            check_fraction(f)


def quantize_hook(bits: int, group: int, kind: str) -> HookFn:
    """A hook on hook_k (kind "k") or hook_v ("v") replacing the tensor by its quantized copy."""

    def fn(x: Tensor, point: HookPoint) -> Tensor:
        return fake_quantize_keys(x, bits, group) if kind == "k" else fake_quantize_values(x, bits, group)
    return fn


def paragraphs(text: str, held_out: float = 0.2) -> tuple[list[str], list[str]]:
    """The text's paragraphs of 8 words or more, split by position: (first part, held-out last part)."""
    paras = [p for p in text.split("\n\n") if len(p.split()) >= 8]
    cut = int(len(paras) * (1 - held_out))
    return paras[:cut], paras[cut:]


def run(settings: EncoderSettings, *, text_path: str | None = None, model_dir: str | None = None,
        progress: bool = True) -> dict[str, Any]:
    import platform
    from datetime import date

    from multihead.evals.text import read_text
    from multihead.models.bert import load_sentence_encoder

    began = time.perf_counter()
    say = print if progress else (lambda *_: None)
    model = load_sentence_encoder(model_dir)
    train, test = paragraphs(read_text(text_path))
    if len(test) < settings.texts or len(train) < settings.calibration:
        raise MultiheadError(f"the text has {len(test)} held-out and {len(train)} other paragraphs: fewer than "
                             f"--texts {settings.texts} or the calibration set of {settings.calibration}")
    texts = test[:settings.texts]
    cfg = model.encoder.config
    n_layers, h, d = cfg.n_layers, cfg.n_heads, cfg.d_model // cfg.n_heads

    def embed(items: Sequence[str], spec: dict[str, HookFn] | None = None) -> Tensor:
        out = []
        with torch.no_grad(), hooks(model.encoder, spec or {}):
            for t in items:
                out.append(model.embed([t]))
        return torch.cat(out)

    def distance(a: Tensor, b: Tensor) -> float:
        return float((1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).double().mean())

    reference = embed(texts)
    rows: list[dict[str, Any]] = []

    def add(name: str, series: str, kv_per_token: float, spec: dict[str, HookFn]) -> None:
        t0 = time.perf_counter()
        value = distance(embed(texts, spec), reference)
        rows.append({"method": name, "series": series, "kv_bytes_per_token": kv_per_token,
                     "kv_ratio": kv_per_token / full, "one_minus_cosine": value,
                     "seconds": round(time.perf_counter() - t0, 1)})
        say(f"{name:<28} K/V {kv_per_token:>7,.0f} B/token ({kv_per_token / full:6.1%})  1 - cos {value:.2e}")

    full = 2 * n_layers * h * d * 2.0  # bf16 keys and values of every layer, per token
    rows.append({"method": "original", "series": "full", "kv_bytes_per_token": full, "kv_ratio": 1.0,
                 "one_minus_cosine": 0.0, "seconds": 0.0})
    for g in settings.kv_heads:
        if g >= h or h % g:
            raise MultiheadError(f"KV head count {g} must divide the {h} heads and be fewer")
        add(f"{g} KV head{'s' if g > 1 else ''} (pooled)", "fewer KV heads", 2 * n_layers * g * d * 2.0,
            {"*.hook_k": pool_kv_hook(g), "*.hook_v": pool_kv_hook(g)})
    for b in settings.bits:
        if d % settings.group:
            raise MultiheadError(f"group ({settings.group}) must divide head_dim ({d})")
        per = 2 * n_layers * h * (d * b / 8 + 2 * 2 * d / settings.group)  # codes + float16 scale and minimum
        add(f"int{b} K/V (g{settings.group})", "quantized", per,
            {"*.hook_k": quantize_hook(b, settings.group, "k"), "*.hook_v": quantize_hook(b, settings.group, "v")})
    if settings.prune:
        calibration = train[:settings.calibration]
        base = embed(calibration)
        importance = np.zeros((n_layers, h))
        for layer in range(n_layers):
            for head in range(h):
                importance[layer, head] = distance(
                    embed(calibration, {f"layers.{layer}.attn.hook_z": zero_heads(head)}), base)
        from multihead.tradeoff.prune import groups_to_keep

        for fraction in settings.prune:
            keep = groups_to_keep(importance, fraction)
            spec = {f"layers.{i}.attn.hook_z": zero_heads([j for j in range(h) if j not in k])
                    for i, k in enumerate(keep) if len(k) < h}
            kept = sum(len(k) for k in keep)
            add(f"pruned {fraction:.0%} of heads", "pruned", 2 * kept * d * 2.0, spec)
    return {
        "model": "all-MiniLM-L6-v2", "metric": "mean 1 - cosine to the original embedding",
        "text": {"source": text_path or "Jargon File 4.4.7 (Debian jargon-text)", "texts": len(texts),
                 "calibration_texts": settings.calibration},
        "settings": dataclasses.asdict(settings), "rows": rows, "kv_bytes_dtype": "bf16",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": date.today().isoformat(), "seconds": round(time.perf_counter() - began, 1),
    }


def plot(result: dict[str, Any], path: Any) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from multihead.files import save_figure

    fig, ax = plt.subplots(figsize=(8, 5.2))
    for series, marker in {"fewer KV heads": "^", "quantized": "s", "pruned": "P"}.items():
        points = sorted((r for r in result["rows"] if r["series"] == series), key=lambda r: r["kv_bytes_per_token"])
        if not points:
            continue
        xs = [r["kv_bytes_per_token"] / 1024 for r in points]
        ys = [max(r["one_minus_cosine"], 1e-9) for r in points]
        ax.plot(xs, ys, marker=marker, label=series, markersize=7)
        for k, (r, x, y) in enumerate(zip(points, xs, ys, strict=True)):  # alternate sides: close points stay legible
            ax.annotate(r["method"], (x, y), textcoords="offset points", xytext=(5, 4 if k % 2 == 0 else -11),
                        fontsize=7)
    full = result["rows"][0]["kv_bytes_per_token"] / 1024
    ax.axvline(full, color="black", linewidth=0.6, linestyle=":", label="original (1 - cos = 0)")
    ax.set_yscale("log")
    ax.set_xlabel("keys and values per token, all layers, KiB (bf16)")
    ax.set_ylabel("1 - cosine to the original embedding (log scale)")
    ax.set_title(f"all-MiniLM-L6-v2 on {result['text']['texts']} held-out paragraphs", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return str(path)

