"""Per-head attention weights of every layer, recomputed exactly from each layer's own q, k and mask."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TypeVar

import torch
from torch import Tensor

from multihead.layers.hooks import HookedAttention, HookPoint

T = TypeVar("T")


def capture_weights(layers: Sequence[HookedAttention], run: Callable[[], object]) -> list[Tensor]:
    """Run ``run()`` (a forward pass of the model that owns ``layers``) and return each layer's weights
    (b, n_heads, s, t) as float32 on the CPU.

    A read-only hook on each layer's ``hook_pattern``: the model keeps its fused kernel for the output and the
    pattern is recomputed from the same q, k (after RoPE) and mask, so the capture is exact without switching the
    whole model to a slow path.
    """
    found: list[list[Tensor]] = [[] for _ in layers]

    def keep(i: int) -> Callable[[Tensor, HookPoint], None]:
        def hook(pattern: Tensor, _point: HookPoint) -> None:
            found[i].append(pattern.detach().float().cpu())
        return hook

    with ExitStack() as stack, torch.no_grad():
        for i, layer in enumerate(layers):
            stack.enter_context(layer.hook_pattern.add(keep(i)))
        run()
    return [torch.cat(w, dim=0) if len(w) > 1 else w[0] for w in found]


def capture_reduced(layers: Sequence[HookedAttention], run: Callable[[], object],
                    reduce: Callable[[int, Tensor], T]) -> list[T]:
    """Like :func:`capture_weights`, but each layer's weights (b, n_heads, s, t; float32, CPU) go to
    ``reduce(layer, weights)`` as soon as they are made and only its result is kept: a long text's weights
    (n_layers x n_heads x s x t) never exist all at once."""
    found: list[list[T]] = [[] for _ in layers]

    def keep(i: int) -> Callable[[Tensor, HookPoint], None]:
        def hook(pattern: Tensor, _point: HookPoint) -> None:
            found[i].append(reduce(i, pattern.detach().float().cpu()))
        return hook

    with ExitStack() as stack, torch.no_grad():
        for i, layer in enumerate(layers):
            stack.enter_context(layer.hook_pattern.add(keep(i)))
        run()
    if any(len(f) != 1 for f in found):
        raise AssertionError("each layer's pattern hook must run once per forward")
    return [f[0] for f in found]
