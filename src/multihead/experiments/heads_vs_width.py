"""Many small heads or one wide head, at the same compute.

Small causal transformers built on MultiHeadAttention, identical but for how d_model is split into heads
(d_k = d_model / n_heads, so parameters and FLOPs are equal across the MHA rows), plus GQA and MQA rows, are trained on
multi-query associative recall (MQAR; Arora et al., 2023): a sequence of key-value pairs, then the keys again in
another order, and the model must answer each key with its value. Answering needs two routing patterns at once: a
head that moves each key into the position of its value (previous-token) and a head that finds, from a repeated key,
the position after its earlier occurrence (induction).

With ``--task lm`` the same models are byte-level language models trained on the project's evaluation text (the
Jargon File, :mod:`multihead.evals.text`): random windows of the first 80% for training, held-out perplexity per
byte on fixed windows of the last 20%. That is where Vaswani et al. (2017, Table 3 rows A) measured the claim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import AttentionConfig, MultiHeadAttention
from multihead.errors import MultiheadError
from multihead.files import save_figure
from multihead.heads.capture import capture_weights
from multihead.heads.scores import label_heads, pattern_scores, repeat_scores
from multihead.sizing import cost


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

    def evaluation(self, batches: int, size: int) -> list[tuple[Tensor, Tensor]]:
        """The held-out batches: the same for every model (a fixed generator)."""
        gen = torch.Generator().manual_seed(99)
        return [self.batch(size, gen) for _ in range(batches)]

    def natural(self, size: int, generator: torch.Generator) -> Tensor:
        """Sequences to score head patterns on: task sequences."""
        return self.batch(size, generator)[0]


@functools.lru_cache(maxsize=2)
def _text_bytes(path: str | None) -> tuple[Tensor, Tensor]:
    """The reflowed text as UTF-8 bytes, split by position: (training bytes, held-out bytes), uint8."""
    from multihead.evals.text import HELD_OUT, read_text

    data = torch.frombuffer(bytearray(read_text(path).encode("utf-8")), dtype=torch.uint8)
    cut = int(len(data) * (1 - HELD_OUT))
    return data[:cut], data[cut:]


@dataclass(frozen=True)
class TextTask:
    """Byte-level language modelling on a real text: every next byte is scored.

    Training batches are windows of ``context`` + 1 bytes at random offsets in the first 80% of the text; the
    held-out set is consecutive non-overlapping windows from the start of the last 20%, the same for every model.
    """

    context: int = 64
    path: str | None = None  # None: the Jargon File that `make text` installs

    def __post_init__(self) -> None:
        if not isinstance(self.context, int) or self.context < 2:
            raise MultiheadError(f"context ({self.context!r}) must be an int of at least 2 bytes")

    @property
    def vocab(self) -> int:
        return 256

    @property
    def seq_len(self) -> int:
        return self.context + 1

    def splits(self) -> tuple[Tensor, Tensor]:
        train, test = _text_bytes(self.path)
        if len(train) <= self.seq_len or len(test) < self.seq_len:
            raise MultiheadError(f"the text has {len(train):,} training and {len(test):,} held-out bytes, too few "
                                 f"for windows of {self.seq_len} bytes")
        return train, test

    def _windows(self, data: Tensor, starts: Tensor) -> Tensor:
        return data[starts[:, None] + torch.arange(self.seq_len)].long()

    def batch(self, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        train, _ = self.splits()
        starts = torch.randint(0, len(train) - self.seq_len + 1, (size,), generator=generator)
        tokens = self._windows(train, starts)
        return tokens, torch.ones(size, self.context, dtype=torch.bool)

    def evaluation(self, batches: int, size: int) -> list[tuple[Tensor, Tensor]]:
        _, test = self.splits()
        available = (len(test) - 1) // self.context
        n = min(batches * size, available)
        starts = torch.arange(n) * self.context  # consecutive windows: every held-out byte is scored once
        out = []
        for first in range(0, n, size):
            chunk = starts[first:first + size]
            out.append((self._windows(test, chunk), torch.ones(len(chunk), self.context, dtype=torch.bool)))
        return out

    def natural(self, size: int, generator: torch.Generator) -> Tensor:
        """Held-out windows (natural text) to score head patterns on."""
        return self.evaluation(1, size)[0][0]


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


def default_variants(d_model: int, heads: tuple[int, ...] = (1, 2, 4, 8, 16)) -> list[Variant]:
    """MHA rows for each head count that divides d_model, then GQA (8 query heads, 2 KV) and MQA (8 query, 1 KV)."""
    rows = [Variant(f"MHA h={h}", h, h) for h in heads if d_model % h == 0]
    return [*rows, Variant("GQA h=8 g=2", 8, 2), Variant("MQA h=8 g=1", 8, 1)]


LM_HEADS = (1, 2, 4, 8, 16, 32)  # Vaswani et al.'s rows A, at the same compute


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
    task: TaskConfig | TextTask = field(default_factory=TaskConfig)

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "steps", "batch", "eval_batches", "workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MultiheadError(f"{name} ({value!r}) must be a positive int")
        if not self.seeds:
            raise MultiheadError("give at least one seed")
        if not (isinstance(self.lr, float | int) and 0 < self.lr <= 1):
            raise MultiheadError(f"lr ({self.lr}) must be a number in (0, 1]")


LM_SETTINGS = Settings(d_model=128, n_layers=2, steps=400, batch=32, lr=1e-2, seeds=(0, 1, 2), eval_batches=64,
                       task=TextTask())


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
    total, count, correct = 0.0, 0, 0.0  # pooled over every scored position of the held-out batches
    with torch.no_grad():
        model.eval()
        for tokens, scored in settings.task.evaluation(settings.eval_batches, settings.batch):
            loss, acc = _loss_and_accuracy(model, tokens, scored)
            n = int(scored.sum())
            total, count, correct = total + float(loss) * n, count + n, correct + float(acc) * n
    return {"seed": seed, "curve": curve, "loss": total / count, "accuracy": correct / count,
            "scored": count, "heads": head_summary(model, settings.task)}


def head_summary(model: TinyLM, task: TaskConfig | TextTask) -> dict[str, Any]:
    """Every pattern score of every head (:mod:`multihead.heads.scores`) and its label: the natural-text scores on
    the task's own sequences (held-out windows for text), duplicate-token and induction on random tokens repeated."""
    gen = torch.Generator().manual_seed(7)
    tokens = task.natural(16, gen)
    layers = model.attention_layers()
    with torch.no_grad():
        weights = capture_weights(layers, lambda: model(tokens))
        period = task.seq_len // 2
        random = torch.randint(0, task.vocab, (16, period), generator=gen)
        rep = capture_weights(layers, lambda: model(torch.cat([random, random], dim=1)))
    scores = pattern_scores(weights, [tokens.shape[1]] * tokens.shape[0], causal=True)
    scores |= repeat_scores(rep, period)
    labels = label_heads(scores)
    prev, ind = scores["previous_token"], scores["induction"]
    flat = [label for row in labels for label in row]
    return {"previous_token": prev.round(4).tolist(), "induction": ind.round(4).tolist(),
            "local": scores["local"].round(4).tolist(), "entropy": scores["entropy"].round(4).tolist(),
            "labels": labels, "label_counts": {label: flat.count(label) for label in sorted(set(flat))},
            "max_previous_token": float(prev.max()), "max_induction": float(ind.max()),
            "previous_token_heads": int((prev >= 0.4).sum()), "induction_heads": int((ind >= 0.3).sum())}


def training_bytes(settings: Settings, variant: Variant) -> int:
    """About the memory one training process needs: weights, gradients and AdamW's two moments (16 bytes per
    parameter), and the activations autograd keeps for one step (float32)."""
    d, n_layers, s, b = settings.d_model, settings.n_layers, settings.task.seq_len, settings.batch
    attention = AttentionConfig(d_model=d, n_heads=variant.n_heads, n_kv_heads=variant.n_kv_heads)
    per_layer = cost.parameters(attention).total + 8 * d * d + 9 * d
    params = 2 * settings.task.vocab * d + s * d + n_layers * per_layer
    activations = n_layers * b * s * (20 * d + 2 * variant.n_heads * s) + 3 * b * s * settings.task.vocab
    return 16 * params + 4 * activations


def _check_memory(settings: Settings, variants: list[Variant]) -> None:
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = max(training_bytes(settings, v) for v in variants) * min(settings.workers, len(variants) * len(
        settings.seeds))
    if need > physical // 2:
        from multihead.sizing.units import format_bytes

        raise MultiheadError(f"these settings need about {format_bytes(need)} to train ({settings.workers} "
                             f"process(es) side by side), more than half this machine's {format_bytes(physical)}: "
                             "use a smaller --d-model, --batch or --context, or fewer --workers")


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
    _check_memory(settings, variants)
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
            "attention_flops_per_layer": cost.flops(attention, s=settings.task.seq_len - 1, causal=True).forward,
            "kv_cache_bytes_per_token": cost.kv_cache_bytes_per_token_per_layer(attention, "fp32") * settings.n_layers,
            "loss_mean": statistics.fmean(losses), "loss_std": statistics.pstdev(losses),
            "accuracy_mean": statistics.fmean(accs), "accuracy_std": statistics.pstdev(accs),
            "perplexity_mean": statistics.fmean(math.exp(x) for x in losses),
            "perplexity_std": statistics.pstdev(math.exp(x) for x in losses),
            "label_counts": _mean_counts([r["heads"]["label_counts"] for r in runs]),
            "runs": runs,
        })
    return {"task": task_name(settings.task), "settings": _settings_json(settings),
            "seconds": round(time.perf_counter() - start, 1), "rows": rows}


def task_name(task: TaskConfig | TextTask) -> str:
    return "lm" if isinstance(task, TextTask) else "recall"


def _mean_counts(counts: list[dict[str, int]]) -> dict[str, float]:
    """Mean number of heads per label over runs (a label absent from a run counts 0 there)."""
    labels = sorted({label for c in counts for label in c})
    return {label: statistics.fmean(c.get(label, 0) for c in counts) for label in labels}


def _settings_json(settings: Settings) -> dict[str, Any]:
    d = dataclasses.asdict(settings)
    d["seeds"] = list(settings.seeds)
    return d


LABEL_COLOURS = {"induction": "#c33", "duplicate-token": "#e80", "previous-token": "#36c", "self": "#9c3",
                 "attention-sink": "#777", "local": "#6bd", "broad": "#dc8", "mixed": "#ccc"}


def plot(result: dict[str, Any], path: str) -> str:
    """Training curves (mean over seeds, smoothed), the final metric per variant and, for the text task, the labels
    of the trained models' heads, in one PNG."""
    from multihead.errors import require

    matplotlib = require("matplotlib", "plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lm = result.get("task") == "lm"
    fig, axes = plt.subplots(1, 3 if lm else 2, figsize=(17 if lm else 12, 4.5), dpi=100)
    left, right = axes[0], axes[1]
    for row in result["rows"]:
        curves = np.array([r["curve"] for r in row["runs"]])
        mean = curves.mean(0)
        k = max(1, len(mean) // 50)
        smooth = np.convolve(mean, np.ones(k) / k, mode="valid")
        left.plot(smooth, label=row["variant"])
    left.set_xlabel("step")
    left.set_ylabel("training loss (nats per byte)" if lm else "training loss (recalled values)")
    left.set_yscale("log")
    left.legend(fontsize=8)
    left.set_title("training curves, mean over seeds")
    names = [r["variant"] for r in result["rows"]]
    metric = "perplexity" if lm else "accuracy"
    right.bar(range(len(names)), [r[f"{metric}_mean"] for r in result["rows"]],
              yerr=[r[f"{metric}_std"] for r in result["rows"]], capsize=3, color="#58a")
    right.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    if lm:
        values = [r["perplexity_mean"] for r in result["rows"]]
        spread = max(r["perplexity_std"] for r in result["rows"])
        right.set_ylim(min(values) - 3 * spread - 0.05, max(values) + 3 * spread + 0.05)
        right.set_ylabel("held-out perplexity per byte")
        right.set_title("held-out perplexity, mean and spread over seeds")
    else:
        right.set_ylabel("recall accuracy (held-out batches)")
        right.set_ylim(0, 1.05)
        right.set_title("final accuracy, mean and spread over seeds")
    if lm:
        labels_ax = axes[2]
        bottom = np.zeros(len(names))
        for label, colour in LABEL_COLOURS.items():
            share = np.array([r["label_counts"].get(label, 0.0) / (r["n_heads"] * result["settings"]["n_layers"])
                              for r in result["rows"]])
            if share.any():
                labels_ax.bar(range(len(names)), share, bottom=bottom, color=colour, label=label)
                bottom += share
        labels_ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        labels_ax.set_ylabel("share of the model's heads")
        labels_ax.set_ylim(0, 1.0)
        labels_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        labels_ax.set_title("head labels of the trained models")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
