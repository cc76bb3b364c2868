"""Uptraining a model whose KV heads were pooled: distillation from the original (Ainslie et al. 2023).

The student (the pooled model) learns to match the teacher's next-token distribution on the training split:
loss = KL(teacher || student) per token, averaged. AdamW with a linear warm-up, one sequence of ``seq`` tokens per
step drawn at a position fixed by (seed, step), so a resumed run sees the batches an uninterrupted one would.

A checkpoint (the trained tensors, AdamW's moments and the history, as safetensors and JSON, each written whole or
not at all) is saved every ``every`` steps and at the end; ``resume=True`` continues from it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.errors import MultiheadError
from multihead.files import atomic_path, write_text
from multihead.models.llama import LlamaModel

TRAINABLE = ("kv", "attention", "all")


@dataclass(frozen=True)
class UptrainSettings:
    steps: int = 40
    seq: int = 256
    lr: float = 1e-3
    warmup: int = 5
    train: str = "kv"
    every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "seq", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MultiheadError(f"uptraining {name} ({value!r}) must be a positive integer")
        if not (isinstance(self.lr, float | int) and math.isfinite(self.lr) and 0 < self.lr < 1):
            raise MultiheadError(f"uptraining lr ({self.lr!r}) must be a finite number in (0, 1)")
        if self.train not in TRAINABLE:
            raise MultiheadError(f"uptraining train ({self.train!r}) must be one of {', '.join(TRAINABLE)}")


def trainable(model: LlamaModel, which: str) -> dict[str, nn.Parameter]:
    """The parameters uptraining changes: the pooled K/V projections, every attention projection, or all."""
    names = {"kv": (".attn.k_proj.", ".attn.v_proj."), "attention": (".attn.",), "all": ("",)}[which]
    return {n: p for n, p in model.named_parameters() if any(k in n for k in names)}


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """Mean over tokens of KL(teacher || student) on the next-token distributions."""
    s = F.log_softmax(student_logits.float(), dim=-1).flatten(0, -2)
    t = F.log_softmax(teacher_logits.float(), dim=-1).flatten(0, -2)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def _batch(train: Sequence[int], settings: UptrainSettings, step: int) -> Tensor:
    g = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    start = int(torch.randint(0, len(train) - settings.seq, (1,), generator=g))
    return torch.tensor(train[start:start + settings.seq], dtype=torch.long)[None]  # (1, seq)


def uptrain(student: LlamaModel, teacher: LlamaModel, train: Sequence[int], settings: UptrainSettings, *,
            checkpoint: str | Path | None = None, resume: bool = False,
            evaluate: Callable[[LlamaModel], float] | None = None, eval_at: Sequence[int] = (),
            progress: bool = True) -> list[dict[str, Any]]:
    """Distil ``teacher`` into ``student`` in place; returns the history: per step the KL, and at the steps in
    ``eval_at`` (and 0) the held-out loss from ``evaluate(student)``."""
    from tqdm import tqdm

    if len(train) <= settings.seq:
        raise MultiheadError(f"the training split has {len(train):,} tokens, not more than one sequence of "
                             f"{settings.seq}")
    params = trainable(student, settings.train)
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(list(params.values()), lr=settings.lr, weight_decay=0.0)
    history: list[dict[str, Any]] = []
    first = 0
    folder = Path(checkpoint) if checkpoint is not None else None
    if folder is not None and resume and (folder / "state.json").exists():
        first, history = _load(folder, student, params, optimizer, settings)
    if first == 0 and evaluate is not None:
        history.append({"step": 0, "heldout_loss": evaluate(student)})
    began = time.perf_counter()
    student.train()
    bar = tqdm(range(first, settings.steps), desc="uptraining", unit="step", disable=not progress,
               initial=first, total=settings.steps)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * min(1.0, (step + 1) / max(1, settings.warmup))
        tokens = _batch(train, settings, step)
        with torch.no_grad():
            target = teacher(tokens)
        loss = distillation_loss(student(tokens), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        optimizer.step()
        entry: dict[str, Any] = {"step": step + 1, "kl": float(loss.detach())}
        if evaluate is not None and step + 1 in eval_at:
            student.eval()
            entry["heldout_loss"] = evaluate(student)
            student.train()
        history.append(entry)
        bar.set_postfix(kl=f"{entry['kl']:.3f}")
        if folder is not None and ((step + 1) % settings.every == 0 or step + 1 == settings.steps):
            _save(folder, student, params, optimizer, settings, step + 1, history)
    student.eval()
    for p in student.parameters():
        p.requires_grad_(False)
    if history:
        history[-1].setdefault("seconds_this_run", round(time.perf_counter() - began, 1))
    return history


def _save(folder: Path, model: LlamaModel, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
          settings: UptrainSettings, step: int, history: list[dict[str, Any]]) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"param.{n}": p.detach().contiguous() for n, p in params.items()}
    for n, p in params.items():
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensors[f"{key}.{n}"] = state[key].contiguous()
    with atomic_path(folder / "uptrain.safetensors") as partial:
        save_file(tensors, str(partial))
    adam_step = {n: float(optimizer.state[p]["step"]) for n, p in params.items()
                 if "step" in optimizer.state.get(p, {})}
    write_text(folder / "state.json", json.dumps({"step": step, "settings": asdict(settings), "history": history,
                                                  "adam_step": adam_step}))


def _load(folder: Path, model: LlamaModel, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
          settings: UptrainSettings) -> tuple[int, list[dict[str, Any]]]:
    from multihead.models.loaders import read_json, read_safetensors

    state = read_json(folder / "state.json")
    saved = state.get("settings")
    if saved != asdict(settings):
        raise MultiheadError(f"the checkpoint in {folder} was made with other settings ({saved}); resume with the "
                             f"same ones ({asdict(settings)}) or use another folder")
    step = state.get("step")
    if not isinstance(step, int) or not 0 < step <= settings.steps:
        raise MultiheadError(f"{folder / 'state.json'}: step {step!r} is not in 1..{settings.steps}")
    tensors = read_safetensors([folder / "uptrain.safetensors"])
    adam_step = state.get("adam_step", {})
    with torch.no_grad():
        for n, p in params.items():
            saved_p = tensors.get(f"param.{n}")
            if saved_p is None or saved_p.shape != p.shape:
                raise MultiheadError(f"{folder / 'uptrain.safetensors'}: no tensor param.{n} of shape "
                                     f"{tuple(p.shape)}")
            p.copy_(saved_p)
            if f"exp_avg.{n}" in tensors:
                optimizer.state[p] = {"step": torch.tensor(float(adam_step.get(n, step))),
                                      "exp_avg": tensors[f"exp_avg.{n}"].clone(),
                                      "exp_avg_sq": tensors[f"exp_avg_sq.{n}"].clone()}
    history = state.get("history")
    return step, history if isinstance(history, list) else []
