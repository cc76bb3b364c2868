"""The shape walk: run a real layer on the meta device and record the shape of every step of the formula."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from multihead.config import AttentionConfig, MLAConfig
from multihead.errors import MultiheadError
from multihead.layers.attention import MultiHeadAttention
from multihead.layers.hooks import HookPoint

# step name in forward -> (what a person reads, the legend of its dimensions)
_STEPS = {
    "input": ("input x", "(b, s, d_model)"),
    "q_proj": ("q = x W_Q", "(b, s, h*d)"),
    "k_proj": ("k = x W_K", "(b, t, g*d)"),
    "v_proj": ("v = x W_V", "(b, t, g*d)"),
    "q_heads": ("q split into heads", "(b, h, s, d)"),
    "k_heads": ("k split into heads", "(b, g, t, d)"),
    "v_heads": ("v split into heads", "(b, g, t, d)"),
    "weights": ("attention weights per head (pattern)", "(b, h, s, t)"),
    "attention": ("attention output per head (z)", "(b, h, s, d)"),
    "merged": ("heads merged (concat)", "(b, s, h*d)"),
    "output": ("output = merged W_O", "(b, s, d_model)"),
}


@dataclass(frozen=True)
class ShapeStep:
    """One step of the formula as the shape walk saw it: its name in forward, what a person reads, the legend of its
    dimensions and the shape it had (not :class:`multihead.layers.step.Step`, the state one model step shares)."""

    name: str
    label: str
    legend: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShapeWalk:
    config: AttentionConfig
    batch: int
    seq: int
    steps: list[ShapeStep]
    parameters: dict[str, int]

    @property
    def total_parameters(self) -> int:
        return sum(self.parameters.values())


_MAX_ELEMENTS = 2**62  # torch sizes tensors in int64, even on the meta device


def _check_size(batch: int, seq: int, widths: list[int]) -> None:
    """The walk's largest tensors (activations, weights, the b*h*s*s scores) must be sizeable in int64."""
    largest = max(batch * seq * max(widths), batch * max(widths) * seq * seq, max(widths) ** 2)
    if largest > _MAX_ELEMENTS:
        raise MultiheadError(f"width {max(widths):,}, batch {batch:,} and seq {seq:,} give tensors of up to "
                             f"{largest:.3g} elements, more than torch can size ({_MAX_ELEMENTS:.3g}): use "
                             "`multihead count` for the arithmetic of sizes this large")


def shape_walk(config: AttentionConfig, *, batch: int = 1, seq: int = 128, causal: bool | None = None) -> ShapeWalk:
    """Run ``config``'s layer on the meta device (no memory, no arithmetic) and record each step's shape.

    ``causal``: walk the causal layer (the shapes are the same; a sliding window is causal by definition, so a
    config with a window walks causally unless told otherwise; None: causal exactly when the config has a window).

    The attention core's steps are read at its hook points (q, k, v, pattern, z, out); the projections' outputs and
    the merged heads by forward hooks on the four linear layers.
    """
    _check_size(batch, seq, [config.d_model, config.n_heads * config.head_dim])
    layer = MultiHeadAttention(config, backend="math", device="meta")
    seen: list[tuple[int, ShapeStep]] = []  # (order, step): a forward hook on o_proj sees the merged heads first

    def record(name: str, tensor: torch.Tensor) -> None:
        label, legend = _STEPS[name]
        seen.append((list(_STEPS).index(name), ShapeStep(name, label, legend, tuple(tensor.shape))))

    def on_module(name: str) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], None]:
        return lambda _m, _args, out: record(name, out)

    def on_point(name: str) -> Callable[[torch.Tensor, HookPoint], None]:
        return lambda tensor, _point: record(name, tensor)

    handles: list[Any] = [
        layer.q_proj.register_forward_hook(on_module("q_proj")),
        layer.k_proj.register_forward_hook(on_module("k_proj")),
        layer.v_proj.register_forward_hook(on_module("v_proj")),
        layer.o_proj.register_forward_pre_hook(lambda _m, args: record("merged", args[0])),
    ]
    for point, name in (("hook_q", "q_heads"), ("hook_k", "k_heads"), ("hook_v", "v_heads"),
                        ("hook_pattern", "weights"), ("hook_z", "attention"), ("hook_out", "output")):
        handles.append(getattr(layer, point).add(on_point(name)))
    x = torch.empty(batch, seq, config.d_model, device="meta")
    record("input", x)
    try:
        with torch.no_grad():
            layer(x, causal=config.window is not None if causal is None else causal)
    finally:
        for handle in handles:
            handle.remove()
    steps = [step for _, step in sorted(seen, key=lambda pair: pair[0])]
    params = {name: p.numel() for name, p in layer.named_parameters()}
    return ShapeWalk(config=config, batch=batch, seq=seq, steps=steps, parameters=params)


@dataclass(frozen=True)
class MLAShapeWalk:
    config: MLAConfig
    path: str
    batch: int
    seq: int
    steps: list[ShapeStep]
    parameters: dict[str, int]

    @property
    def total_parameters(self) -> int:
        return sum(self.parameters.values())


def mla_shape_walk(config: MLAConfig, *, batch: int = 1, seq: int = 128, path: str = "expanded") -> MLAShapeWalk:
    """The shape walk of a multi-head latent attention layer on one path, in the order the steps run."""
    from multihead.layers.latent import MultiHeadLatentAttention

    if path not in ("expanded", "absorbed"):
        raise MultiheadError(f"path {path!r} must be 'expanded' or 'absorbed'")
    _check_size(batch, seq, [config.d_model, config.n_heads * max(config.qk_head_dim, config.v_head_dim)])
    layer = MultiHeadLatentAttention(config, backend="math", device="meta")
    steps: list[ShapeStep] = []
    absorbed = path == "absorbed"
    labels = {
        "q_a_proj": ("c_Q = x W_DQ (query latent)", "(b, s, q_lora_rank)"),
        "q_b_proj": ("q = RMSNorm(c_Q) W_UQ", "(b, s, h*(nope+rope))"),
        "q_proj": ("q = x W_Q", "(b, s, h*(nope+rope))"),
        "kv_a_proj": ("[c_KV, k_pe] = x [W_DKV; W_KR]", "(b, s, kv_lora_rank+rope)"),
        "kv_b_proj": ("[k_nope, v] = c_KV [W_UK; W_UV] per head", "(b, t, h*(nope+v))"),
        "hook_q": (("q absorbed: [q_nope W_UK^T, RoPE(q_pe)]", "(b, h, s, kv_lora_rank+rope)") if absorbed
                   else ("q heads: [q_nope, RoPE(q_pe)]", "(b, h, s, nope+rope)")),
        "hook_k": (("k: the latent [c_KV, RoPE(k_pe)], one KV head", "(b, 1, t, kv_lora_rank+rope)") if absorbed
                   else ("k heads: [k_nope, RoPE(k_pe)] (k_pe shared)", "(b, h, t, nope+rope)")),
        "hook_v": (("v: c_KV, the same KV head", "(b, 1, t, kv_lora_rank)") if absorbed
                   else ("v heads", "(b, h, t, v)")),
        "hook_pattern": ("attention weights per head (pattern)", "(b, h, s, t)"),
        "hook_z": (("z per head = (weights c_KV) W_UV^T", "(b, h, s, v)") if absorbed
                   else ("attention output per head (z)", "(b, h, s, v)")),
        "merged": ("heads merged (concat)", "(b, s, h*v)"),
        "hook_out": ("output = merged W_O", "(b, s, d_model)"),
    }

    def record(name: str, tensor: torch.Tensor) -> None:
        label, legend = labels[name]
        steps.append(ShapeStep(name, label, legend, tuple(tensor.shape)))

    handles: list[Any] = []
    for name in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj", "kv_b_proj"):
        module = getattr(layer, name)
        if module is not None and not (absorbed and name == "kv_b_proj"):
            handles.append(module.register_forward_hook(lambda _m, _a, out, n=name: record(n, out)))
    handles.append(layer.o_proj.register_forward_pre_hook(lambda _m, args: record("merged", args[0])))
    for point in ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z", "hook_out"):
        handles.append(getattr(layer, point).add(lambda tensor, _p, n=point: record(n, tensor)))
    x = torch.empty(batch, seq, config.d_model, device="meta")
    steps.append(ShapeStep("input", "input x", "(b, s, d_model)", tuple(x.shape)))
    try:
        with torch.no_grad():
            layer(x, causal=True, path=path)
    finally:
        for handle in handles:
            handle.remove()
    params = {name: p.numel() for name, p in layer.named_parameters()}
    return MLAShapeWalk(config=config, path=path, batch=batch, seq=seq, steps=steps, parameters=params)
