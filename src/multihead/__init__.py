"""multihead: multi-head attention for PyTorch (MHA, GQA and MQA in one layer)."""

from multihead.attention import MultiHeadAttention
from multihead.cache import KVCache
from multihead.config import AttentionConfig, RopeConfig
from multihead.errors import MultiheadError
from multihead.kernels import KernelChoice

__all__ = ["AttentionConfig", "KVCache", "KernelChoice", "MultiHeadAttention", "MultiheadError", "RopeConfig"]
__version__ = "0.1.0"
