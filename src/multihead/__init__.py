"""multihead: multi-head attention for PyTorch (MHA, GQA and MQA in one layer; MLA beside it)."""

from multihead.attention import MultiHeadAttention
from multihead.cache import HeadPlan, HeadwiseCache, KVCache, LatentCache, QuantizedKVCache, SinkCache
from multihead.config import AttentionConfig, MLAConfig, RopeConfig
from multihead.errors import MultiheadError
from multihead.kernels import KernelChoice
from multihead.latent import MultiHeadLatentAttention

__all__ = ["AttentionConfig", "HeadPlan", "HeadwiseCache", "KVCache", "KernelChoice", "LatentCache", "MLAConfig",
           "MultiHeadAttention", "MultiHeadLatentAttention", "MultiheadError", "QuantizedKVCache", "RopeConfig",
           "SinkCache"]
__version__ = "0.1.0"
