"""Per-head attention weights of every layer, recomputed exactly from each layer's own q, k and mask."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack

import torch
from torch import Tensor

from multihead.attention import MultiHeadAttention


def capture_weights(layers: Sequence[MultiHeadAttention], run: Callable[[], object]) -> list[Tensor]:
    """Run ``run()`` (a forward pass of the model that owns ``layers``) and return each layer's weights
    (b, n_heads, s, t) as float32 on the CPU.

    The model keeps its fused kernel for the output; the observed layers recompute their weights from the same
    q, k (after RoPE) and mask, so the capture is exact without switching the whole model to a slow path.
    """
    found: list[list[Tensor]] = [[] for _ in layers]

    def hook_for(i: int) -> Callable[[str, Tensor], None]:
        def hook(step: str, tensor: Tensor) -> None:
            if step == "weights":
                found[i].append(tensor.detach().float().cpu())
        return hook

    with ExitStack() as stack, torch.no_grad():
        for i, layer in enumerate(layers):
            stack.enter_context(layer.observe(hook_for(i), weights=True))
        run()
    return [torch.cat(w, dim=0) if len(w) > 1 else w[0] for w in found]
