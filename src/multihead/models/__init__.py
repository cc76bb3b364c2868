"""Real models built on MultiHeadAttention: a BERT encoder and a Llama-style GQA decoder, and their loaders.

Needs the ``models`` extra (``pip install 'multihead[models]'``): safetensors, tokenizers, gguf, jinja2.
"""

from multihead.errors import require_extra

require_extra("models")

from multihead.models.bert import BertConfig, BertEncoder, SentenceEncoder, load_sentence_encoder  # noqa: E402  (after the extra's check)
from multihead.models.llama import LlamaConfig, LlamaModel  # noqa: E402  (after the extra's check)
from multihead.models.loaders import default_gemma3_path, default_gguf_path, default_minilm_dir, load_llama  # noqa: E402  (after the extra's check)

__all__ = [
    "BertConfig",
    "BertEncoder",
    "LlamaConfig",
    "LlamaModel",
    "SentenceEncoder",
    "default_gemma3_path",
    "default_gguf_path",
    "default_minilm_dir",
    "load_llama",
    "load_sentence_encoder",
]
