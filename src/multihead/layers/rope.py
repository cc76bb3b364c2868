"""Rotary position embeddings (RoPE), in the Llama / Hugging Face ``rotate_half`` convention.

For a head vector x of width d and a position p, the pair (x_j, x_{j + d/2}) is rotated by the angle
``theta_j = p * base ** (-2 j / d)``, j = 0 .. d/2 - 1::

    rope(x)_j       = x_j cos(theta_j) - x_{j+d/2} sin(theta_j)
    rope(x)_{j+d/2} = x_{j+d/2} cos(theta_j) + x_j sin(theta_j)

so that q_m · k_n depends on positions only through m - n.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RotaryEmbedding(nn.Module):
    """Rotates q and k of shape (b, n, s, d) by their positions.

    The frequencies are computed on the fly (d/2 numbers) in float32, or float64 for float64 inputs, so that casting
    the model to bfloat16 never degrades them (a buffer would be cast with the module).
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self._inv_freq: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def inv_freq(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """base ** (-2j / d) for j = 0 .. d/2 - 1 (kept per device and dtype: a few numbers, never cast)."""
        key = (device, dtype)
        found = self._inv_freq.get(key)
        if found is None:
            exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float64) / self.head_dim
            found = (1.0 / (self.base**exponents)).to(dtype)  # (d/2,)
            if device.type != "meta" and not torch.compiler.is_compiling():
                self._inv_freq[key] = found
        return found

    def cos_sin(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """cos and sin of the angles for positions (b|1, s): each (b|1, 1, s, d), in float32 (float64 on request)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        angles = positions.to(work)[..., None] * self.inv_freq(positions.device, work)  # (b, s, d/2)
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # (b, 1, s, d)
        return angles.cos(), angles.sin()

    def tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and the signed sin ([-sin, sin] by halves) in ``dtype``, (b|1, 1, s, d), for :meth:`rotate`.

        Computed in float32 (float64 for float64) and then cast. A model makes them once per step and passes them to
        every layer (:class:`multihead.layers.attention.Step`).
        """
        cos, sin = self.cos_sin(positions, dtype)
        half = self.head_dim // 2
        signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos.to(dtype), signed.to(dtype)

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        """x (b, n, s, d) rotated: x cos + rotate_half(x) sin, where rotate_half(x) = [-x2, x1] is written as
        roll(x, d/2) = [x2, x1] times the signed sin [-sin, sin] (the same products, bit for bit)."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}"
