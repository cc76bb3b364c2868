"""Many small heads or one wide head, at the same compute.

Small causal transformers built on MultiHeadAttention, identical but for how d_model is split into heads
(d_k = d_model / n_heads, so parameters and FLOPs are equal across the MHA rows), plus GQA and MQA rows, are trained on
multi-query associative recall (MQAR; Arora et al., 2023): a sequence of key-value pairs, then the keys again in
another order, and the model must answer each key with its value. Answering needs two routing patterns at once: a
head that moves each key into the position of its value (previous-token) and a head that finds, from a repeated key,
the position after its earlier occurrence (induction).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import AttentionConfig, MultiHeadAttention, cost
from multihead.errors import MultiheadError
from multihead.files import save_figure
from multihead.heads.capture import capture_weights
from multihead.heads.scores import pattern_scores, repeat_scores


@dataclass(frozen=True)
class TaskConfig:
    """MQAR: n_pairs key-value pairs, then every key again (shuffled); the loss is on the values after the keys."""

    n_keys: int = 64  # key vocabulary: tokens 0 .. n_keys - 1
    n_values: int = 64  # value vocabulary: tokens n_keys .. n_keys + n_values - 1
    n_pairs: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.n_pairs <= self.n_keys:
            raise MultiheadError(f"n_pairs ({self.n_pairs}) must be between 1 and n_keys ({self.n_keys})")
        if self.n_values < 2:
            raise MultiheadError(f"n_values ({self.n_values}) must be at least 2")

    @property
    def vocab(self) -> int:
        return self.n_keys + self.n_values

    @property
    def seq_len(self) -> int:
        return 4 * self.n_pairs  # pairs (2 tokens each), then queries (key, value) again

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """tokens (b, 4P) and a mask (b, 4P - 1) of the positions whose next token is scored (the recalled values)."""
        p = self.n_pairs
        keys = torch.stack([torch.randperm(self.n_keys, generator=generator)[:p] for _ in range(size)])  # (b, P)
        values = self.n_keys + torch.randint(0, self.n_values, (size, p), generator=generator)  # (b, P)
        order = torch.stack([torch.randperm(p, generator=generator) for _ in range(size)])  # (b, P)
        context = torch.stack([keys, values], dim=-1).reshape(size, 2 * p)  # k1 v1 k2 v2 ...
        queries = torch.stack([keys.gather(1, order), values.gather(1, order)], dim=-1).reshape(size, 2 * p)
        tokens = torch.cat([context, queries], dim=1)  # (b, 4P)
        scored = torch.zeros(size, 4 * p - 1, dtype=torch.bool)
        scored[:, 2 * p::2] = True  # predicting the token after each query key: its value
        return tokens, scored


class Block(nn.Module):
    def __init__(self, attention: AttentionConfig, ffn: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(attention.d_model)
        self.attn = MultiHeadAttention(attention)
        self.norm2 = nn.LayerNorm(attention.d_model)
        self.ffn = nn.Sequential(nn.Linear(attention.d_model, ffn), nn.GELU(), nn.Linear(ffn, attention.d_model))

    def forward(self, h: Tensor) -> Tensor:
        h = h + self.attn(self.norm1(h), causal=True)
        out: Tensor = h + self.ffn(self.norm2(h))
        return out


class TinyLM(nn.Module):
    """Token and position embeddings, pre-LayerNorm blocks on MultiHeadAttention, a linear head."""

    def __init__(self, attention: AttentionConfig, *, n_layers: int, vocab: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, attention.d_model)
        self.pos = nn.Embedding(max_len, attention.d_model)
        self.blocks = nn.ModuleList(Block(attention, 4 * attention.d_model) for _ in range(n_layers))
        self.norm = nn.LayerNorm(attention.d_model)
        self.head = nn.Linear(attention.d_model, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            h = block(h)
        logits: Tensor = self.head(self.norm(h))
        return logits

    def attention_layers(self) -> list[MultiHeadAttention]:
        return [cast(Block, block).attn for block in self.blocks]


@dataclass(frozen=True)
class Variant:
    name: str
    n_heads: int
    n_kv_heads: int


def default_variants(d_model: int) -> list[Variant]:
    rows = [Variant(f"MHA h={h}", h, h) for h in (1, 2, 4, 8, 16) if d_model % h == 0]
    return [*rows, Variant("GQA h=8 g=2", 8, 2), Variant("MQA h=8 g=1", 8, 1)]


@dataclass(frozen=True)
class Settings:
    d_model: int = 64
    n_layers: int = 2
    steps: int = 500
    batch: int = 64
    lr: float = 3e-3
    seeds: tuple[int, ...] = (0, 1, 2)
    eval_batches: int = 8
    workers: int = 2  # training processes side by side, one thread each (tiny models are overhead-bound)
    task: TaskConfig = field(default_factory=TaskConfig)

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "steps", "batch", "eval_batches", "workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MultiheadError(f"{name} ({value!r}) must be a positive int")
        if not self.seeds:
            raise MultiheadError("give at least one seed")
        if not self.lr > 0:
            raise MultiheadError(f"lr ({self.lr}) must be positive")


def _loss_and_accuracy(model: TinyLM, tokens: Tensor, scored: Tensor) -> tuple[Tensor, Tensor]:
    logits = model(tokens[:, :-1])  # (b, s-1, vocab)
    target = tokens[:, 1:]
    loss = F.cross_entropy(logits[scored], target[scored])
    accuracy = (logits[scored].argmax(-1) == target[scored]).float().mean()
    return loss, accuracy


def train_one(variant: Variant, settings: Settings, seed: int) -> dict[str, Any]:
    """Train one model from one seed; returns its curve, final loss/accuracy and head scores."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    attention = AttentionConfig(d_model=settings.d_model, n_heads=variant.n_heads, n_kv_heads=variant.n_kv_heads)
    model = TinyLM(attention, n_layers=settings.n_layers, vocab=settings.task.vocab, max_len=settings.task.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / settings.steps)))
    curve = []
    for _ in range(settings.steps):
        tokens, scored = settings.task.batch(settings.batch, gen)
        loss, _ = _loss_and_accuracy(model, tokens, scored)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        curve.append(float(loss.detach()))
    eval_gen = torch.Generator().manual_seed(99)  # the same evaluation batches for every model
    losses, accs = [], []
    with torch.no_grad():
        model.eval()
        for _ in range(settings.eval_batches):
            loss, acc = _loss_and_accuracy(model, *settings.task.batch(settings.batch, eval_gen))
            losses.append(float(loss))
            accs.append(float(acc))
    return {"seed": seed, "curve": curve, "loss": statistics.fmean(losses), "accuracy": statistics.fmean(accs),
            "heads": head_summary(model, settings.task)}


def head_summary(model: TinyLM, task: TaskConfig) -> dict[str, Any]:
    """Previous-token scores on task sequences and induction scores on repeated random tokens, per layer and head."""
    gen = torch.Generator().manual_seed(7)
    tokens, _ = task.batch(16, gen)
    layers = model.attention_layers()
    with torch.no_grad():
        weights = capture_weights(layers, lambda: model(tokens))
        period = task.seq_len // 2
        random = torch.randint(0, task.vocab, (16, period), generator=gen)
        rep = capture_weights(layers, lambda: model(torch.cat([random, random], dim=1)))
    prev = pattern_scores(weights, [tokens.shape[1]] * tokens.shape[0], causal=True)["previous_token"]
    ind = repeat_scores(rep, period)["induction"]
    return {"previous_token": prev.round(4).tolist(), "induction": ind.round(4).tolist(),
            "max_previous_token": float(prev.max()), "max_induction": float(ind.max()),
            "previous_token_heads": int((prev >= 0.4).sum()), "induction_heads": int((ind >= 0.3).sum())}


def _init_worker() -> None:
    torch.set_num_threads(1)


def run(settings: Settings, variants: list[Variant] | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Train every variant from every seed; returns a JSON-ready dict with one row per variant.

    Runs are independent and seeded, so they go to ``settings.workers`` processes (one thread each) and give the same
    numbers whatever the number of workers.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    variants = default_variants(settings.d_model) if variants is None else variants
    for v in variants:
        AttentionConfig(d_model=settings.d_model, n_heads=v.n_heads, n_kv_heads=v.n_kv_heads)  # fail before training
    jobs = [(v, seed) for v in variants for seed in settings.seeds]
    start = time.perf_counter()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    with tqdm(total=len(jobs), desc="training", unit="model", disable=not progress) as bar:
        if settings.workers == 1:
            for v, seed in jobs:
                results[(v.name, seed)] = train_one(v, settings, seed)
                bar.update(1)
        else:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(settings.workers, mp_context=ctx, initializer=_init_worker) as pool:
                futures = {pool.submit(train_one, v, settings, seed): (v.name, seed) for v, seed in jobs}
                for future in futures:
                    results[futures[future]] = future.result()
                    bar.update(1)
    rows = []
    for variant in variants:
        attention = AttentionConfig(d_model=settings.d_model, n_heads=variant.n_heads, n_kv_heads=variant.n_kv_heads)
        runs = [results[(variant.name, seed)] for seed in settings.seeds]
        losses = [r["loss"] for r in runs]
        accs = [r["accuracy"] for r in runs]
        rows.append({
            "variant": variant.name, "n_heads": variant.n_heads, "n_kv_heads": variant.n_kv_heads,
            "head_dim": attention.head_dim,
            "attention_params_per_layer": cost.parameters(attention).total,
            "attention_flops_per_layer": cost.flops(attention, s=settings.task.seq_len, causal=True).forward,
            "kv_cache_bytes_per_token": cost.kv_cache_bytes_per_token_per_layer(attention, "fp32") * settings.n_layers,
            "loss_mean": statistics.fmean(losses), "loss_std": statistics.pstdev(losses),
            "accuracy_mean": statistics.fmean(accs), "accuracy_std": statistics.pstdev(accs),
            "runs": runs,
        })
    return {"settings": _settings_json(settings), "seconds": round(time.perf_counter() - start, 1), "rows": rows}


def _settings_json(settings: Settings) -> dict[str, Any]:
    d = dataclasses.asdict(settings)
    d["seeds"] = list(settings.seeds)
    return d


def plot(result: dict[str, Any], path: str) -> str:
    """Training curves (mean over seeds, smoothed) and final accuracy per variant, in one PNG."""
    from multihead.errors import require

    matplotlib = require("matplotlib", "plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for row in result["rows"]:
        curves = np.array([r["curve"] for r in row["runs"]])
        mean = curves.mean(0)
        k = max(1, len(mean) // 50)
        smooth = np.convolve(mean, np.ones(k) / k, mode="valid")
        left.plot(smooth, label=row["variant"])
    left.set_xlabel("step")
    left.set_ylabel("training loss (recalled values)")
    left.set_yscale("log")
    left.legend(fontsize=8)
    left.set_title("training curves, mean over seeds")
    names = [r["variant"] for r in result["rows"]]
    right.bar(range(len(names)), [r["accuracy_mean"] for r in result["rows"]],
              yerr=[r["accuracy_std"] for r in result["rows"]], capsize=3, color="#58a")
    right.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    right.set_ylabel("recall accuracy (held-out batches)")
    right.set_ylim(0, 1.05)
    right.set_title("final accuracy, mean and spread over seeds")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
