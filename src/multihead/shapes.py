"""The shape walk: run a real layer on the meta device and record the shape of every step of the formula."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multihead.attention import MultiHeadAttention
from multihead.config import AttentionConfig

# step name in forward -> (what a person reads, the legend of its dimensions)
_STEPS = {
    "input": ("input x", "(b, s, d_model)"),
    "q_proj": ("q = x W_Q", "(b, s, h*d)"),
    "k_proj": ("k = x W_K", "(b, t, g*d)"),
    "v_proj": ("v = x W_V", "(b, t, g*d)"),
    "q_heads": ("q split into heads", "(b, h, s, d)"),
    "k_heads": ("k split into heads", "(b, g, t, d)"),
    "v_heads": ("v split into heads", "(b, g, t, d)"),
    "weights": ("attention weights per head", "(b, h, s, t)"),
    "attention": ("attention output per head", "(b, h, s, d)"),
    "merged": ("heads merged (concat)", "(b, s, h*d)"),
    "output": ("output = merged W_O", "(b, s, d_model)"),
}


@dataclass(frozen=True)
class Step:
    name: str
    label: str
    legend: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShapeWalk:
    config: AttentionConfig
    batch: int
    seq: int
    steps: list[Step]
    parameters: dict[str, int]

    @property
    def total_parameters(self) -> int:
        return sum(self.parameters.values())


def shape_walk(config: AttentionConfig, *, batch: int = 1, seq: int = 128) -> ShapeWalk:
    """Run ``config``'s layer on the meta device (no memory, no arithmetic) and record each step's shape."""
    layer = MultiHeadAttention.from_config(config, backend="math", device="meta")
    seen: list[Step] = []

    def hook(name: str, tensor: torch.Tensor) -> None:
        label, legend = _STEPS[name]
        seen.append(Step(name, label, legend, tuple(tensor.shape)))

    x = torch.empty(batch, seq, config.d_model, device="meta")
    with layer.observe(hook), torch.no_grad():
        layer(x, return_weights=True)
    params = {name: p.numel() for name, p in layer.named_parameters()}
    return ShapeWalk(config=config, batch=batch, seq=seq, steps=seen, parameters=params)
