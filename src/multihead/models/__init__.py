"""Real models built on MultiHeadAttention: a BERT encoder and a Llama-style GQA decoder, and their loaders."""

from multihead.models.bert import BertConfig, BertEncoder, SentenceEncoder, load_sentence_encoder
from multihead.models.llama import LlamaConfig, LlamaModel
from multihead.models.loaders import default_gguf_path, default_minilm_dir, load_llama

__all__ = [
    "BertConfig",
    "BertEncoder",
    "LlamaConfig",
    "LlamaModel",
    "SentenceEncoder",
    "default_gguf_path",
    "default_minilm_dir",
    "load_llama",
    "load_sentence_encoder",
]
