"""A BERT encoder on MultiHeadAttention, and sentence embeddings the way sentence-transformers makes them.

::

    h = LayerNorm(word_emb(ids) + position_emb(0..s-1) + token_type_emb(0))
    for each layer:   h = LayerNorm(h + W_O attn(h, key_padding_mask))          (post-LayerNorm)
                      h = LayerNorm(h + W_2 gelu(W_1 h))
                      (hook points: resid_pre = h in, attn_out, resid_mid = the first sum, mlp_out,
                       resid_post = the second sum, before its LayerNorm: multihead.layers.hooks)
    embedding = normalize(mean of h over the real tokens)                        (the model's pooling config)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.config import AttentionConfig
from multihead.errors import MultiheadError
from multihead.layers.attention import MultiHeadAttention
from multihead.layers.hooks import HookPoint, add_resid_points, resid_block
from multihead.layers.step import Step
from multihead.models.tokenizer import TextTokenizer
from multihead.values import MAX_FFN


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], where: str = "config.json") -> BertConfig:
        """Every value checked for its type and range (by multihead.hf.config, as ``count --config`` reads it);
        errors name the file and the key."""
        from multihead.hf.config import HFConfig
        from multihead.values import Values

        r = cfg if isinstance(cfg, HFConfig) else HFConfig(cfg, where=where)
        if r.model_type != "bert":
            raise MultiheadError(f"{where!r} describes a {str(r.get('model_type'))[:60]!r} model: supported is bert")
        v = Values(where, json=True)
        d_model, n_heads = r.d_model, r.n_heads
        if d_model % n_heads:
            raise v.fail("num_attention_heads", n_heads, f"a divisor of hidden_size ({d_model})")
        activation = r.text("hidden_act", default="gelu")
        if activation not in _ACTIVATIONS:
            raise v.fail("hidden_act", activation, f"one of {', '.join(_ACTIVATIONS)}")
        # the tables this model allocates: positions (at most 2^24 here) and token types (at least one)
        positions = v.integer("max_position_embeddings", 512 if r.max_context is None else r.max_context, low=1,
                              high=1 << 24)
        return cls(vocab_size=r.integer("vocab_size"), d_model=d_model, n_layers=r.n_layers, n_heads=n_heads,
                   ffn_dim=v.integer("intermediate_size", r.integer("intermediate_size"), low=1, high=MAX_FFN),
                   max_positions=positions,
                   type_vocab_size=v.integer("type_vocab_size", r.integer("type_vocab_size", default=2), low=1,
                                             high=1 << 16),
                   layer_norm_eps=r.number("layer_norm_eps", default=1e-12), activation=activation)

    def attention(self) -> AttentionConfig:
        return AttentionConfig(d_model=self.d_model, n_heads=self.n_heads, bias=True)


_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class BertLayer(nn.Module):
    _resid_points: tuple[HookPoint, ...]

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if config.activation not in _ACTIVATIONS:
            raise MultiheadError(f"activation {config.activation!r} is not supported: {', '.join(_ACTIVATIONS)}")
        self.attn = MultiHeadAttention(config.attention())
        self.attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(config.d_model, config.ffn_dim)
        self.ffn_out = nn.Linear(config.ffn_dim, config.d_model)
        self.ffn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.activation]

        add_resid_points(self)  # post-norm: resid_mid and resid_post are the sums before each LayerNorm

    def forward(self, h: Tensor, step: Step) -> Tensor:
        out: Tensor = self.ffn_norm(resid_block(self._resid_points, h, self.attn, self._ffn, mid_norm=self.attn_norm,
                                                step=step))
        return out

    def _ffn(self, h: Tensor) -> Tensor:
        out: Tensor = self.ffn_out(self.act(self.ffn_in(h)))
        return out


class BertEncoder(nn.Module):
    """Token ids (b, s) and their padding mask -> hidden states (b, s, d_model)."""

    position_ids: Tensor

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embeddings = nn.Embedding(config.max_positions, config.d_model)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.d_model)
        self.embed_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.n_layers))

    def forward(self, ids: Tensor, valid: Tensor | None = None) -> Tensor:
        """ids (b, s); valid (b, s) bool, True = a real token (False = padding)."""
        s = ids.shape[1]
        if s > self.config.max_positions:
            raise MultiheadError(f"{s} tokens exceed the model's {self.config.max_positions} positions")
        positions = torch.arange(s, device=ids.device)
        h: Tensor = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(
            torch.zeros_like(ids))
        h = self.embed_norm(h)  # (b, s, d_model)
        step = self.step(h, valid)
        for layer in self.layers:
            h = layer(h, step)
        return h

    def step(self, h: Tensor, valid: Tensor | None) -> Step:
        """The padding mask every layer shares, made once."""
        first: BertLayer = self.layers[0]  # type: ignore[assignment]
        return first.attn.step(h, key_padding_mask=valid)

    @staticmethod
    def hf_names(config: BertConfig) -> dict[str, str]:
        """Our parameter names -> the names in a Hugging Face BertModel checkpoint."""
        names = {
            "word_embeddings.weight": "embeddings.word_embeddings.weight",
            "position_embeddings.weight": "embeddings.position_embeddings.weight",
            "token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
            "embed_norm.weight": "embeddings.LayerNorm.weight",
            "embed_norm.bias": "embeddings.LayerNorm.bias",
        }
        per_layer = {
            "attn.q_proj": "attention.self.query", "attn.k_proj": "attention.self.key",
            "attn.v_proj": "attention.self.value", "attn.o_proj": "attention.output.dense",
            "attn_norm": "attention.output.LayerNorm", "ffn_in": "intermediate.dense",
            "ffn_out": "output.dense", "ffn_norm": "output.LayerNorm",
        }
        for i in range(config.n_layers):
            for ours, theirs in per_layer.items():
                for part in ("weight", "bias"):
                    names[f"layers.{i}.{ours}.{part}"] = f"encoder.layer.{i}.{theirs}.{part}"
        return names


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"  # mean, cls or max
    normalize: bool = True


class SentenceEncoder(nn.Module):
    """Texts -> sentence embeddings: tokenize, encode, pool (mean over real tokens by default), normalise."""

    def __init__(self, encoder: BertEncoder, tokenizer: TextTokenizer, *, pooling: Pooling, max_length: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.max_length = max_length

    def tokenize(self, texts: list[str]) -> tuple[Tensor, Tensor, list[bool]]:
        """ids (b, s) right-padded with 0, valid (b, s), and which texts were cut to max_length tokens."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise MultiheadError("texts must be a list of strings")
        if not texts:
            raise MultiheadError("texts is empty: give at least one text")
        encoded = [self.tokenizer.tokenizer.encode(t).ids for t in texts]
        truncated = [len(e) > self.max_length for e in encoded]
        encoded = [e if len(e) <= self.max_length else e[:self.max_length - 1] + e[-1:] for e in encoded]
        longest = max(len(e) for e in encoded)
        ids = torch.zeros(len(texts), longest, dtype=torch.long)
        valid = torch.zeros(len(texts), longest, dtype=torch.bool)
        for i, e in enumerate(encoded):
            ids[i, :len(e)] = torch.tensor(e)
            valid[i, :len(e)] = True
        return ids, valid, truncated

    @torch.no_grad()
    def embed(self, texts: list[str]) -> Tensor:
        """(len(texts), d_model) sentence embeddings."""
        ids, valid, _ = self.tokenize(texts)
        return self.pool(self.encoder(ids, valid), valid)

    def pool(self, h: Tensor, valid: Tensor) -> Tensor:
        if self.pooling.mode == "mean":
            w = valid.unsqueeze(-1).to(h.dtype)  # (b, s, 1)
            out = (h * w).sum(1) / w.sum(1).clamp(min=1e-9)
        elif self.pooling.mode == "cls":
            out = h[:, 0]
        else:
            out = h.masked_fill(~valid.unsqueeze(-1), float("-inf")).amax(1)
        return F.normalize(out, dim=-1) if self.pooling.normalize else out


def load_sentence_encoder(folder: str | Path | None = None) -> SentenceEncoder:
    """A sentence encoder from a sentence-transformers folder (config.json, model.safetensors, tokenizer.json,
    1_Pooling/config.json, modules.json); default: all-MiniLM-L6-v2 from the installed package."""
    from multihead.models.loaders import default_minilm_dir, read_json, read_safetensors, safetensors_files
    from multihead.models.tokenizer import check_against_model, from_tokenizer_json
    from multihead.values import Values

    root = default_minilm_dir() if folder is None else Path(folder)
    if not root.is_dir():
        raise MultiheadError(f"model folder {str(root)!r} does not exist")
    config = BertConfig.from_hf(read_json(root / "config.json"), where=str(root / "config.json"))
    raw = read_safetensors(safetensors_files(root))
    prefix = "bert." if any(k.startswith("bert.") for k in raw) else ""
    with torch.device("meta"):  # shapes from the config, compared with the tensors before anything is allocated
        expected = BertEncoder(config).state_dict()
    state = {}
    for ours, theirs in BertEncoder.hf_names(config).items():
        if prefix + theirs not in raw:
            raise MultiheadError(f"{str(root)!r}: the checkpoint has no tensor {prefix + theirs!r}")
        tensor = raw[prefix + theirs]
        if tensor.shape != expected[ours].shape:
            raise MultiheadError(f"{str(root)!r}: tensor {prefix + theirs!r} has shape {tuple(tensor.shape)} but "
                                 f"config.json makes {tuple(expected[ours].shape)}")
        state[ours] = tensor.float()
    encoder = BertEncoder(config)
    encoder.load_state_dict(state)
    pooling = Pooling()
    pool_cfg = root / "1_Pooling" / "config.json"
    if pool_cfg.exists():
        p = read_json(pool_cfg)
        v = Values(pool_cfg)
        modes = [name for name in ("cls", "max", "mean")
                 if v.flag(f"pooling_mode_{name}_token" + ("s" if name != "cls" else ""),
                           p.get(f"pooling_mode_{name}_token" + ("s" if name != "cls" else ""), False))]
        mode = modes[0] if modes else "mean"
        pooling = Pooling(mode=mode, normalize=False)
    modules = root / "modules.json"
    if modules.exists():
        from multihead.hf.config import read_json as read_any_json

        listed = read_any_json(modules, "JSON file")
        if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
            raise Values(modules).fail("modules", listed, "a list of objects")
        kinds = [Values(modules).text(f"[{i}].type", m.get("type", "")) for i, m in enumerate(listed)]
        pooling = Pooling(mode=pooling.mode, normalize=any(k.endswith("Normalize") for k in kinds))
    max_length = config.max_positions
    st_cfg = root / "sentence_bert_config.json"
    if st_cfg.exists():
        max_length = Values(st_cfg).integer("max_seq_length", read_json(st_cfg).get("max_seq_length", max_length),
                                            low=1, high=config.max_positions)
    tokenizer = from_tokenizer_json(root / "tokenizer.json")
    tokenizer.tokenizer.no_truncation()
    tokenizer.tokenizer.no_padding()
    check_against_model(tokenizer, config.vocab_size, repr(str(root / "tokenizer.json")))
    if tokenizer.vocab_size > config.vocab_size:  # (ids shared by two tokens)
        raise MultiheadError(f"{str(root / 'tokenizer.json')!r} has {tokenizer.vocab_size:,} tokens but the model's "
                             f"vocabulary is {config.vocab_size:,} (token ids past it have no embedding)")
    return SentenceEncoder(encoder.eval(), tokenizer, pooling=pooling, max_length=max_length)
