"""Edge attribution patching (multihead.heads.eap) against exact patching: to first order on a toy model in float64
(corrupted = clean + eps * delta in embedding space: the relative error shrinks linearly with eps), the sum of a
sender's edges against attribution patching, EAP-IG against EAP, faithfulness at its two ends, the exact check of an
edge into the logits against path patching, and the top edges' sign on SmolLM2; bad input."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from multihead.heads.eap import Edge, check_edges, edge_attribution
from multihead.heads.patching import logit_difference
from multihead.models.llama import LlamaConfig, LlamaModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
V, D, H, S = 40, 32, 4, 5
VARIANTS = pytest.mark.parametrize("n_kv_heads", [4, 2], ids=["mha", "gqa"])
METRIC = logit_difference([3, 7], [5, 9])


def _metric64(logits: Tensor) -> Tensor:
    """logit_difference's metric in the logits' own dtype (it rounds to float32, too coarse for eps = 1e-4)."""
    rows = torch.arange(logits.shape[0]) % 2
    return logits[:, -1].gather(1, torch.tensor([3, 7])[rows, None])[:, 0] - \
        logits[:, -1].gather(1, torch.tensor([5, 9])[rows, None])[:, 0]


def _port(n_kv_heads: int, *, dtype: torch.dtype = torch.float32, seed: int = 0, n_layers: int = 2) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(LlamaConfig(vocab_size=V, d_model=D, n_layers=n_layers, n_heads=H, n_kv_heads=n_kv_heads,
                                   ffn_dim=48, tie_embeddings=False), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


class _Norm64(nn.Module):
    """The port's RMSNorm normalised in the input's dtype (the port's normalises in float32, whose rounding would
    swamp an eps = 1e-4 difference): an exactly float64 model."""

    def __init__(self, norm: Any) -> None:
        super().__init__()
        self.eps, self.weight = norm.eps, norm.weight

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        return out


def _port64(n_kv_heads: int) -> LlamaModel:
    model = _port(n_kv_heads, dtype=torch.float64)
    for block in model.layers:
        block.attn_norm, block.ffn_norm = _Norm64(block.attn_norm), _Norm64(block.ffn_norm)
    model.norm = _Norm64(model.norm)  # type: ignore[assignment]
    return model


def _ids(seed: int = 1, high: int = V) -> Tensor:
    return torch.randint(0, high, (2, S), generator=torch.Generator().manual_seed(seed))


def _perturbed(model: LlamaModel, eps: float, direction: Tensor) -> tuple[Tensor, Tensor]:
    """Clean ids in 0 .. V/2 - 1 and corrupted ids id + V/2 whose embeddings are the clean ones + eps * direction."""
    clean = _ids(high=V // 2)
    with torch.no_grad():
        model.embed.weight[V // 2:] = model.embed.weight[:V // 2] + eps * direction
    return clean, clean + V // 2


def _kind(node: str) -> str:
    if node in ("embed", "logits"):
        return node
    return {"k": "k", "v": "v", "MLP": "mlp"}.get(node.split(".")[-1], "q")


@VARIANTS
def test_eap_scores_are_exact_patching_to_first_order(n_kv_heads: int) -> None:
    model = _port64(n_kv_heads)
    direction = torch.randn(V // 2, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    clean, corrupted = _perturbed(model, 1.0, direction)
    edges = edge_attribution(model, clean, corrupted, _metric64).edges
    chosen: dict[tuple[str, str], list[Edge]] = {}  # the top two of each kind of sender and receiver
    for e in edges:
        group = chosen.setdefault((_kind(e.sender), _kind(e.receiver)), [])
        if len(group) < 2:
            group.append(e)
    assert {r for _, r in chosen} == {"q", "k", "v", "mlp", "logits"}
    assert {u for u, _ in chosen} == {"embed", "q", "mlp"}
    picked = [e for group in chosen.values() for e in group]
    errors = []
    for eps in (1e-2, 1e-3, 1e-4):
        clean, corrupted = _perturbed(model, eps, direction)
        estimate = {(e.sender, e.receiver): e.score for e in edge_attribution(model, clean, corrupted, _metric64).edges}
        exact = check_edges(model, clean, corrupted, _metric64, picked)
        first = np.array([estimate[(e.sender, e.receiver)] / eps for e, _ in exact])
        measured = np.array([v / eps for _, v in exact])
        errors.append(np.abs(first - measured).max() / np.abs(measured).max())
    assert errors[2] < 2e-3, errors
    assert errors[1] < errors[0] / 5 and errors[2] < errors[1] / 5, errors  # linear in eps
