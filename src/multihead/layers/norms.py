"""RMSNorm as Llama and DeepSeek define it: x / sqrt(mean(x^2) + eps), normalised in float32, then scaled by weight
in the input's dtype (transformers' LlamaRMSNorm and DeepseekV3RMSNorm: ``weight * normed.to(dtype)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.kernels import cpu


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalised in float32."""

    def __init__(self, dim: int, eps: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype and (x.dtype == torch.float32 or cpu.fused_low_precision_norm(x)):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one call, normalised in float32
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out: Tensor = self.weight * normed.to(x.dtype)
        return out
