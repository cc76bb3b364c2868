"""Hand-built attention weights shared by tests (test_heads, test_retrieval_scores)."""

from __future__ import annotations

import torch
from torch import nn

from multihead import MultiHeadAttention


def zeroed_layers(n: int, *, d_model: int, head_dim: int) -> nn.ModuleList:
    """n attention layers of two heads, no bias, scale 1, every weight zero (a zero head attends uniformly)."""
    layers = nn.ModuleList(MultiHeadAttention(d_model=d_model, n_heads=2, head_dim=head_dim, bias=False, scale=1.0)
                           for _ in range(n))
    for layer in layers:
        for p in layer.parameters():
            nn.init.zeros_(p)
    return layers


def wire_previous_token_and_induction(prev: MultiHeadAttention, ind: MultiHeadAttention, *, vocab: int,
                                      positions: int, c: float) -> None:
    """Head 0 of ``prev`` attends to the previous position and writes that key's token into the previous-token
    subspace; head 0 of ``ind`` matches the current token against each key's previous token (an induction head).
    The residual stream: token one-hot at [0, vocab), position one-hot at [vocab, vocab + positions), previous token
    at [vocab + positions, 2 vocab + positions); ``c`` sharpens the matches."""
    pos, prev_space = vocab, vocab + positions
    with torch.no_grad():
        for p in range(positions - 1):
            prev.q_proj.weight[p, pos + p] = c  # query at position p looks for ...
            prev.k_proj.weight[p + 1, pos + p] = 1.0  # ... the key at position p - 1
        for t in range(vocab):
            prev.v_proj.weight[t, t] = 1.0  # value: the key's token
            prev.o_proj.weight[prev_space + t, t] = 1.0  # written into the previous-token subspace
            ind.q_proj.weight[t, t] = c  # query: the current token ...
            ind.k_proj.weight[t, prev_space + t] = 1.0  # ... against each key's previous token
