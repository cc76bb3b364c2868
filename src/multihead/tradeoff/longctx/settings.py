"""What a long-context run measures: its :class:`Settings` (one field per flag of ``multihead tradeoff --long``) and
the methods they make."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multihead.errors import MultiheadError
from multihead.evals.needles import DEFAULT_PASSKEY_PROMPT, DEFAULT_TASKS, HAYSTACKS, CaseSettings
from multihead.tradeoff.longctx.methods import Method, control_key, control_name, load_plan, plan_label


def _positive(name: str, value: object, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MultiheadError(f"{name} ({value!r}) must be an integer of at least {least}")


@dataclass(frozen=True)
class Settings:
    """What a run measures; each field is one flag of ``multihead tradeoff --long``."""

    lengths: tuple[int, ...] = (2048, 4096)
    tasks: tuple[str, ...] = DEFAULT_TASKS
    haystacks: tuple[str, ...] = HAYSTACKS
    prompts: int = 1  # prompts per (length, task); a multikey prompt gives `keys` cases
    keys: int = 4
    values: int = 3
    seed: int = 0
    passkey_prompt: str = DEFAULT_PASSKEY_PROMPT  # the passkey task's wording (needles.PASSKEY_PROMPTS)
    chunk: int = 512
    sinks: int = 4
    keep: tuple[float, ...] = (0.5, 0.25)  # sinks + window holding these shares of the prompt
    window_keep: tuple[float, ...] = (0.25,)  # a plain window (no sinks) holding these shares
    windows: tuple[int, ...] = ()  # absolute sinks + window windows (e.g. 256, as `multihead tradeoff` uses)
    bits: tuple[int, ...] = (8, 4, 2)
    group: int = 32
    residual: int = 128
    mqa: bool = True
    uptrain_steps: int = 40  # 0: no uptrained MQA; the steps, lr and train are `multihead tradeoff`'s defaults
    uptrain_lr: float = 3e-3
    uptrain_train: str = "kv"
    uptrain_from: str | None = None  # an uptraining checkpoint folder to reuse (e.g. a `multihead tradeoff` run's)
    prune: tuple[float, ...] = (0.25,)
    plans: tuple[str, ...] = ()  # HeadPlan JSON files: a head-wise cache each, and a sinks + window one of its bytes
    ppl_context: int = 4096
    ppl_scored: int = 1024
    ppl_windows: int = 1
    threshold: float = 0.8
    bootstrap: int = 2000
    layers: str = "all"  # "global": windowed and quantized methods on a hybrid model's global layers only

    def __post_init__(self) -> None:
        from multihead.cache import check_bits
        from multihead.tradeoff.prune import check_fraction

        self.cases()  # the cases' own checks: lengths, tasks, ..., seed, passkey_prompt
        for name in ("chunk", "group", "ppl_context", "ppl_scored", "ppl_windows", "bootstrap"):
            _positive(name, getattr(self, name))
        for name in ("sinks", "residual", "uptrain_steps"):
            _positive(name, getattr(self, name), 0)
        if self.ppl_scored > self.ppl_context:
            raise MultiheadError(f"ppl_scored ({self.ppl_scored}) must not exceed ppl_context ({self.ppl_context})")
        shortest = min(self.lengths)
        for share in self.keep + self.window_keep:
            if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1:
                raise MultiheadError(f"keep share ({share!r}) must lie in (0, 1): the share of the prompt a "
                                     "windowed cache holds")
        for share in self.keep:
            held = round(share * shortest)
            if held < self.sinks + 1:
                raise MultiheadError(f"keep {share} of {shortest} tokens holds {held} tokens, fewer than the "
                                     f"{self.sinks} sinks and one window token: use a larger share or fewer sinks")
        for share in self.window_keep:
            if round(share * shortest) < 1:
                raise MultiheadError(f"window keep {share} of {shortest} tokens holds no token")
        for w in self.windows:
            _positive("window", w)
            if w < self.sinks:
                raise MultiheadError(f"window {w} keeps fewer tokens than the {self.sinks} sinks: use a window of "
                                     f"at least {self.sinks} or fewer sinks")
        for b in self.bits:
            check_bits(b)
        for f in self.prune:
            check_fraction(f)
        if self.uptrain_steps:
            self.uptrain()  # its own checks
        labels = [plan_label(p) for p in self.plans]
        for path, label in zip(self.plans, labels, strict=True):
            if labels.count(label) > 1:
                raise MultiheadError(f"two plans are named {label!r} ({', '.join(self.plans)}): give the files "
                                     "distinct names")
            load_plan(path)  # a missing or bad file is refused now, not after the full cache has run
        if not 0 <= self.threshold <= 1:
            raise MultiheadError(f"threshold ({self.threshold!r}) must lie in [0, 1]")
        if self.layers not in ("all", "global"):
            raise MultiheadError(f"layers ({self.layers!r}) must be 'all' (each method on every layer) or 'global' "
                                 "(the windowed and quantized methods on a hybrid model's global layers only)")

    def cases(self) -> CaseSettings:
        """The cases this run measures (:func:`multihead.evals.needles.make_cases` reads the same fields)."""
        return CaseSettings(lengths=self.lengths, tasks=self.tasks, haystacks=self.haystacks, prompts=self.prompts,
                            keys=self.keys, values=self.values, seed=self.seed, passkey_prompt=self.passkey_prompt)

    def uptrain(self) -> Any:
        """The uptraining settings of the uptrained MQA model (:class:`multihead.tradeoff.uptrain.UptrainSettings`)."""
        from multihead.tradeoff.uptrain import UptrainSettings

        return UptrainSettings(steps=self.uptrain_steps, lr=self.uptrain_lr, train=self.uptrain_train,
                               every=max(1, min(10, self.uptrain_steps)))

    def methods(self, n_kv_heads: int) -> list[Method]:
        s, at = self.sinks, self.layers
        on = "" if at == "all" else ", global layers"
        out = [Method("full cache", "full")]
        out += [Method(f"window {share:.0%}{on}", "window", keep=share, layers=at) for share in self.window_keep]
        out += [Method(f"{s} sinks + window {share:.0%}{on}", "sinks + window", keep=share, sinks=s, layers=at)
                for share in self.keep]
        out += [Method(f"{s} sinks + window {w}{on}", "sinks + window (fixed)", window=w, sinks=s, layers=at)
                for w in self.windows]
        out += [Method(f"int{b} (g{self.group}, r{self.residual}){on}", "quantized", bits=b, group=self.group,
                       residual=self.residual, layers=at) for b in self.bits]
        if self.mqa and n_kv_heads > 1:
            out.append(Method(f"MQA, pooled {n_kv_heads} -> 1", "fewer KV heads", model="mqa"))
            if self.uptrain_steps:
                out.append(Method(f"MQA, uptrained {self.uptrain_steps} steps", "fewer KV heads, uptrained",
                                  model="uptrained"))
        out += [Method(f"pruned {f:.0%} of KV groups", "pruned", model=f"pruned-{round(f * 100)}")
                for f in self.prune]
        controls: dict[tuple[Any, ...], Method] = {}  # plans of the same bytes: one control
        for path in self.plans:
            plan, label = load_plan(path), plan_label(path)
            out.append(Method(f"head-wise {label}", f"head-wise ({plan.method or 'plan'})", plan=path))
            controls.setdefault(control_key(plan), Method(
                control_name(plan, s), "sinks + window (bytes of a plan)", sinks=s, equal_to=path,
                layers="global" if plan.hybrid else "all"))
        return out + list(controls.values())


__all__ = ["Settings"]
