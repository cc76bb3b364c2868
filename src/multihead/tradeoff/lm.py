"""Perplexity of a causal model under each KV-saving method, against the KV bytes each one holds.

Perplexity is measured over strided windows of the held-out text: windows of ``context`` tokens every ``stride``
tokens, each scoring its last ``stride`` tokens (so every scored token has at least ``context - stride`` tokens
before it), the way Hugging Face's perplexity guide does it. Every method sees the same windows.

A cache method runs the real cache: each window is fed through it in chunks of ``chunk`` tokens (a server's chunked
prefill), so a sink + window cache holds ``sinks + window - 1`` tokens whatever the context, and a quantized cache
reads back what it quantized. KV bytes come from :mod:`multihead.sizing.cost` for a context of ``context`` tokens in
bfloat16 (the serving dtype), and are checked against the run's real cache tensors (in the run's dtype).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from multihead.cache import Cache, CacheSpec, check_bits
from multihead.errors import MultiheadError
from multihead.models.llama import LlamaModel
from multihead.sizing import cost


@dataclass(frozen=True)
class Method:
    """One point of the chart: a cache kind (``cache``, the :class:`~multihead.cache.CacheSpec` the windows run
    through; None = a plain forward, which stands for the full cache) on a model (``model`` names it: "original", or
    one made by a model method such as "mqa")."""

    name: str
    series: str
    cache: CacheSpec | None = None
    model: str = "original"


@dataclass(frozen=True)
class Settings:
    context: int = 1024
    stride: int = 512
    windows: int = 10
    chunk: int = 64
    window: int = 256
    sinks: tuple[int, ...] = (1, 4)
    bits: tuple[int, ...] = (8, 4, 2)
    group: int = 32
    residual: int = 128
    prune: tuple[float, ...] = (0.1, 0.25, 0.5)

    def __post_init__(self) -> None:
        for name in ("context", "stride", "windows", "chunk", "window", "group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MultiheadError(f"{name} ({value!r}) must be a positive integer")
        if self.stride > self.context:
            raise MultiheadError(f"stride ({self.stride}) must not exceed the context ({self.context})")
        if self.window >= self.context:
            raise MultiheadError(f"window ({self.window}) must be shorter than the context ({self.context}): the "
                                 "window methods are about what happens once tokens leave it")
        for n in self.sinks:
            if n > self.window or n < 0:
                raise MultiheadError(f"sink count {n} must lie between 0 and the window ({self.window})")
        for b in self.bits:
            check_bits(b)
        if self.residual < 0:
            raise MultiheadError(f"residual ({self.residual}) must be non-negative")
        from multihead.tradeoff.prune import check_fraction

        for fraction in self.prune:
            check_fraction(fraction)

    def methods(self) -> list[Method]:
        out = [Method("full cache", "full")]
        out.append(Method(f"window {self.window}", "window", CacheSpec(window=self.window)))
        out += [Method(f"{n} sink{'s' if n > 1 else ''} + window {self.window}", "sinks + window",
                       CacheSpec(window=self.window, sink_tokens=n)) for n in self.sinks if n]
        out += [Method(f"int{b} (g{self.group}, r{self.residual})", "quantized",
                       CacheSpec(self.context, bits=b, group=self.group, residual=self.residual)) for b in self.bits]
        return out


def window_starts(n_tokens: int, settings: Settings) -> list[int]:
    """Starts of the evaluation windows: every ``stride`` tokens, as many as fit, at most ``windows``."""
    if n_tokens < settings.context:
        raise MultiheadError(f"the held-out text has {n_tokens:,} tokens, fewer than one window of "
                             f"{settings.context:,}: use a shorter --context")
    fit = (n_tokens - settings.context) // settings.stride + 1
    return [i * settings.stride for i in range(min(fit, settings.windows))]


def kv_bytes(model: LlamaModel, method: Method, settings: Settings, dtype: str = "bf16") -> int:
    """The cache bytes of one sequence of ``context`` tokens under this method, from multihead.sizing.cost (summed over
    layers, which a pruned model holds at different widths)."""
    spec = method.cache or CacheSpec(settings.context)
    total = 0
    for layer in range(model.config.n_layers):
        attn = model.config.attention(layer)
        if spec.kind == "window":
            assert spec.window is not None
            total += cost.sink_cache_bytes(attn, window=spec.window, sink_tokens=spec.sink_tokens, dtype=dtype)
        elif spec.kind == "quantized":
            assert spec.bits is not None
            total += cost.quantized_cache_bytes(attn, context=settings.context, bits=spec.bits, group=spec.group,
                                                residual=spec.residual, dtype=dtype)
        elif spec.kind == "full":
            total += cost.kv_cache_bytes(attn, context=settings.context, dtype=dtype)
        else:
            raise MultiheadError(f"{method.name}: the perplexity trade-off sizes full, window and quantized caches, "
                                 f"not a {spec.kind} one")
    return total


def _make_cache(model: LlamaModel, method: Method, settings: Settings) -> Cache:
    return model.new_cache(1, spec=method.cache or CacheSpec(settings.context))


@torch.no_grad()
def window_nll(model: LlamaModel, tokens: Tensor, method: Method, settings: Settings) -> tuple[Tensor, int]:
    """Negative log-likelihoods (stride,) of the last ``stride`` tokens of one window (1, context), and the bytes
    of the real cache that produced them (0 for a plain forward)."""
    if method.cache is None:
        logits = model(tokens)
        held = 0
    else:
        cache = _make_cache(model, method, settings)
        parts = []
        for start in range(0, tokens.shape[1], settings.chunk):
            parts.append(model(tokens[:, start:start + settings.chunk], cache=cache))
            cache.advance(parts[-1].shape[1])
        logits = torch.cat(parts, dim=1)
        held = cache.bytes
    logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)  # (context - 1, vocab)
    nll = -logp.gather(-1, tokens[0, 1:, None]).squeeze(-1)  # (context - 1,)
    return nll[-settings.stride:], held


@dataclass
class Row:
    method: str
    series: str
    model: str
    kv_bytes: int
    kv_bytes_per_token: float
    kv_ratio: float
    perplexity: float
    nll: float
    tokens: int
    seconds: float
    cache_bytes_checked: bool
    extra: dict[str, Any] = field(default_factory=dict)


def evaluate(models: dict[str, LlamaModel], methods: Sequence[Method], test: Sequence[int], settings: Settings, *,
             progress: Callable[[str], None] | None = None,
             extras: dict[str, dict[str, Any]] | None = None) -> list[Row]:
    """Perplexity and KV bytes of every method over the same windows of the held-out tokens."""
    starts = window_starts(len(test), settings)
    data = torch.tensor(test, dtype=torch.long)
    full = kv_bytes(models["original"], Method("full", "full"), settings)
    extras = extras or {}
    rows = []
    for method in methods:
        if method.model not in models:
            raise MultiheadError(f"method {method.name!r} needs the model {method.model!r}, which was not made")
        model = models[method.model]
        began = time.perf_counter()
        total, count, held = 0.0, 0, 0
        for start in starts:
            nll, held = window_nll(model, data[None, start:start + settings.context], method, settings)
            total += float(nll.double().sum())
            count += nll.numel()
        predicted = kv_bytes(model, method, settings, dtype=str(model.dtype))
        if method.cache is None:  # a plain forward: the cache it stands for, made and measured
            held = model.new_cache(1, settings.context).bytes
        checked = held == predicted
        if not checked:
            raise MultiheadError(f"{method.name}: the cache held {held:,} bytes but multihead.sizing.cost predicts "
                                 f"{predicted:,}")
        kv = kv_bytes(model, method, settings)
        row = Row(method=method.name, series=method.series, model=method.model, kv_bytes=kv,
                  kv_bytes_per_token=kv / settings.context, kv_ratio=kv / full, perplexity=math.exp(total / count),
                  nll=total / count, tokens=count, seconds=round(time.perf_counter() - began, 1),
                  cache_bytes_checked=checked, extra=dict(extras.get(method.model, {})))
        rows.append(row)
        if progress is not None:
            progress(f"{row.method:<28} KV {row.kv_bytes / 2**20:8.2f} MiB ({row.kv_ratio:6.1%})  "
                     f"perplexity {row.perplexity:8.3f}  ({row.seconds:.0f} s)")
    return rows


def pooled_model(model: LlamaModel, n_kv_heads: int) -> LlamaModel:
    """A copy of ``model`` whose layers have n_kv_heads KV heads, each the mean of the group it replaces
    (Ainslie et al. 2023's conversion, before any uptraining)."""
    from multihead.heads.convert import pooled_layer

    config = dataclasses.replace(model.config, n_kv_heads=n_kv_heads)
    pooled = LlamaModel(config, device=model.device, dtype=model.dtype)
    state = {k: v for k, v in model.state_dict().items() if ".attn.k_proj." not in k and ".attn.v_proj." not in k}
    pooled.load_state_dict(state, strict=False)
    for ours, theirs in zip(pooled.layers, model.layers, strict=True):
        new = pooled_layer(theirs.attn, n_kv_heads)  # type: ignore[arg-type]
        ours.attn.k_proj.load_state_dict(new.k_proj.state_dict())  # type: ignore[union-attr]
        ours.attn.v_proj.load_state_dict(new.v_proj.state_dict())  # type: ignore[union-attr]
    return pooled.eval()


def run(settings: Settings, *, model_path: str | None = None, text_path: str | None = None,
        uptrain_settings: Any = None, out: str | Path | None = None, resume: bool = False,
        progress: bool = True) -> dict[str, Any]:
    """The whole trade-off on a causal model (default SmolLM2-135M): every method's KV bytes and perplexity on the
    held-out text, MQA by pooling before and after uptraining, and pruned models (saved under ``out`` and
    evaluated as loaded back). Returns a JSON-ready dict."""
    import platform
    import tempfile
    from datetime import date

    from multihead.evals.text import read_text, token_splits
    from multihead.models.loaders import load_llama
    from multihead.tradeoff.uptrain import uptrain

    began = time.perf_counter()
    say = print if progress else (lambda *_: None)
    model, tokenizer = load_llama(model_path)
    splits = token_splits(tokenizer.encode(read_text(text_path)), least=settings.context)
    starts = window_starts(len(splits.test), settings)
    say(f"text: {splits.describe()}; {len(starts)} windows of {settings.context} tokens, "
        f"{len(starts) * settings.stride:,} tokens scored")
    folder = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="multihead-tradeoff-"))
    g = model.config.n_kv_heads
    models = {"original": model}
    methods = settings.methods()
    extras: dict[str, dict[str, Any]] = {}
    history: list[dict[str, Any]] = []
    if g > 1:
        models["mqa"] = pooled_model(model, 1)
        methods.append(Method(f"MQA, pooled {g} -> 1", "fewer KV heads", None, "mqa"))
        if uptrain_settings is not None:
            student = pooled_model(model, 1)
            quick = dataclasses.replace(settings, windows=min(2, settings.windows))

            def heldout(m: LlamaModel) -> float:
                return evaluate({"original": m}, [Method("probe", "probe")], splits.test, quick)[0].nll

            marks = sorted({max(1, uptrain_settings.steps * i // 4) for i in (1, 2, 4)})
            history = uptrain(student, model, splits.train, uptrain_settings, checkpoint=folder / "uptrain",
                              resume=resume, evaluate=heldout, eval_at=marks, progress=progress)
            models["uptrained"] = student
            methods.append(Method(f"MQA, uptrained {uptrain_settings.steps} steps", "fewer KV heads, uptrained",
                                  None, "uptrained"))
    if settings.prune:
        methods += _pruned(model, splits.train, settings, folder, models, extras, say)
    rows = evaluate(models, methods, splits.test, settings, progress=say, extras=extras)
    return {
        "model": model_path or "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)",
        "text": {"source": text_path or "Jargon File 4.4.7 (Debian jargon-text)", "train_tokens": len(splits.train),
                 "test_tokens": len(splits.test), "scored_tokens": len(starts) * settings.stride},
        "settings": dataclasses.asdict(settings),
        "uptrain": None if uptrain_settings is None else {**dataclasses.asdict(uptrain_settings), "history": history},
        "rows": [dataclasses.asdict(r) for r in rows],
        "kv_bytes_dtype": "bf16",
        "machine": f"{platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}".replace("  ", " "),
        "date": date.today().isoformat(),
        "seconds": round(time.perf_counter() - began, 1),
    }


IMPORTANCE_BATCH = (4, 256)  # sequences x tokens of the training split for the one-backward importance


def _pruned(model: LlamaModel, train: Sequence[int], settings: Settings, folder: Path,
            models: dict[str, LlamaModel], extras: dict[str, dict[str, Any]],
            say: Callable[[str], None]) -> list[Method]:
    """Prune by one-backward importance at each fraction; save each model, load it back, and time it."""
    from multihead.models.loaders import load_llama_weights, save_llama
    from multihead.tradeoff.prune import group_importance, groups_to_keep, parameters, prune

    b, s = IMPORTANCE_BATCH
    if len(train) < b * s:
        raise MultiheadError(f"the training split has {len(train):,} tokens, fewer than the {b * s:,} of the "
                             "importance batch")
    step = (len(train) - s) // b
    ids = torch.tensor([train[i * step:i * step + s] for i in range(b)], dtype=torch.long)  # (b, s)
    importance = group_importance(model, ids)
    window = torch.tensor(train[:settings.context], dtype=torch.long)[None]
    methods = []
    for fraction in settings.prune:
        keep = groups_to_keep(importance, fraction)
        name = f"pruned-{round(fraction * 100)}"
        path = save_llama(prune(model, keep), folder / name)
        loaded = load_llama_weights(path)
        models[name] = loaded
        kept = sum(len(k) for k in keep)
        extras[name] = {"fraction": fraction, "kv_groups_kept": kept,
                        "kv_groups": model.config.n_layers * model.config.n_kv_heads,
                        "parameters": parameters(loaded), "parameters_original": parameters(model),
                        "prefill_speedup": prefill_speedup(model, loaded, window), "saved_to": str(path),
                        "kept_per_layer": [len(k) for k in keep]}
        say(f"pruned {fraction:.0%} of KV groups: {kept} kept, {parameters(loaded):,} parameters, prefill of "
            f"{settings.context} tokens {extras[name]['prefill_speedup']:.2f}x the original's speed")
        methods.append(Method(f"pruned {fraction:.0%} of KV groups", "pruned", None, name))
    return methods


@torch.no_grad()
def prefill_speedup(original: LlamaModel, smaller: LlamaModel, tokens: Tensor, repeats: int = 3) -> float:
    """Original's prefill time over the smaller model's, medians of alternating runs in this process."""
    times: dict[int, list[float]] = {0: [], 1: []}
    original(tokens)
    smaller(tokens)
    for r in range(repeats):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            began = time.perf_counter()
            (original if i == 0 else smaller)(tokens)
            times[i].append(time.perf_counter() - began)
    med = [sorted(t)[len(t) // 2] for t in (times[0], times[1])]
    return med[0] / med[1]


def plot(result: dict[str, Any], path: str | Path) -> str:
    """KV bytes (one sequence, the evaluation context, bf16) against held-out perplexity, a series per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from multihead.files import save_figure

    rows = result["rows"]
    full = next(r for r in rows if r["series"] == "full")
    fig, ax = plt.subplots(figsize=(8, 5.2))
    markers = {"window": "v", "sinks + window": "o", "quantized": "s", "fewer KV heads": "^",
               "fewer KV heads, uptrained": "D", "pruned": "P"}
    for series, marker in markers.items():
        points = [r for r in rows if r["series"] == series]
        if not points:
            continue
        points.sort(key=lambda r: r["kv_bytes"])
        xs = [r["kv_bytes"] / 2**20 for r in points]
        ys = [r["perplexity"] for r in points]
        ax.plot(xs, ys, marker=marker, linestyle="-" if len(points) > 1 else "none", label=series, markersize=7)
        for k, (r, x, y) in enumerate(zip(points, xs, ys, strict=True)):  # alternate sides: close points stay legible
            ax.annotate(r["method"], (x, y), textcoords="offset points", xytext=(5, 4 if k % 2 == 0 else -11),
                        fontsize=7)
    ax.plot([full["kv_bytes"] / 2**20], [full["perplexity"]], marker="*", color="black", markersize=14,
            linestyle="none", label="full cache (reference)")
    ax.axhline(full["perplexity"], color="black", linewidth=0.6, linestyle=":")
    ax.set_yscale("log")
    ax.set_xlabel(f"KV cache of one sequence of {result['settings']['context']} tokens, MiB (bf16)")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.set_title(f"What each byte of KV cache saved costs: {result['model'].split(' ')[0]} on "
                 f"{result['text']['scored_tokens']:,} held-out tokens", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return str(path)
