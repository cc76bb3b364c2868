"""QK and OV circuits of every head, and the composition scores between heads of different layers (Elhage et al.
2021, "A Mathematical Framework for Transformer Circuits"), read from the weights: no forward pass, no data.

Legend (the package's): ``h`` query heads, ``g`` KV heads, ``d`` head_dim, ``D`` = d_model. Query head i reads KV head
g(i) = i // r, r = h / g, and KV head j is shared by the r query heads G(j) = {j r, .., j r + r - 1}. Row vectors,
as the layers compute (x W)::

    W_QK^i = (N W_Q^i) (N W_K^g(i))^T    (D, D)   the score of a query x_q on a key x_k is x_q W_QK^i x_k^T
    W_OV^i = (N W_V^g(i)) W_O^i          (D, D)   what head i adds to the stream for a key it attends to

    C(A, B) = ||A B||_F / (||A||_F ||B||_F)      in [0, 1]  (0 where a norm is 0: a zeroed head composes with none)

For a writer head w in layer l and a reader head i in layer m > l, T the linear part of what the residual stream
passes through between them (the identity in pre-norm models)::

    Q-composition   C(W_OV^w T, W_QK^i)          the writer's output read by the reader's queries
    K-composition   C(W_OV^w T, (W_QK^i)^T)      ... by its keys
    V-composition   C(W_OV^w T, W_OV^i)          ... by its values

Per KV head j (GQA, MQA): its keys and values are computed once and shared by its group, so its reading circuit is
its own projection followed by the group's r query-side matrices side by side, a (D, r D) matrix::

    K-composition of KV head j   C(W_OV^w T, (N W_K^j) [(N W_Q^i)^T  for i in G(j)])
    V-composition of KV head j   C(W_OV^w T, (N W_V^j) [W_O^i        for i in G(j)])

Since ||X [B_1 .. B_r]||^2 = sum_i ||X B_i||^2, that is the group's per-query-head figures pooled,
s_j^2 = sum_i ||B_i||^2 s_i^2 / sum_i ||B_i||^2 (B_i = (W_QK^i)^T or W_OV^i); for MHA (r = 1) it is the per-query-head
figure. The per-query-head K- and V-scores are TransformerLens's (which repeats each KV head's W_K, W_V to its r query
heads).

**Random baseline.** A score is only high against what random matrices of the same shapes give (the correction of
the ARENA / TransformerLens tutorials: the mean score of random factored matrices, subtracted or used as the colour
midpoint): the mean of C(A, B) over ``samples`` draws of A = L R, L (D, d), R (d, D) and B = L' R', L' (D, d),
R' (d, r D), all with Gaussian entries from a fixed seed (the score ignores scale; the tutorials' uniform draws
give the same mean within sampling error).
``Composition.corrected`` is the score minus the baseline of its shape (r = 1 for the per-query-head kinds).

**Norms, biases, RoPE: what sits outside the static circuit.**

- N, the norm the layer reads the stream through (pre-norm models), is folded into W_Q, W_K and W_V: N = diag(gamma)
  for RMSNorm, N = P diag(gamma) for LayerNorm (P = I - 1 1^T / D, the centring). This is exact for the linear part:
  norm(x) = (x N) / rms(x) (+ beta), and the per-token factor 1 / rms(x) scales A or B, which C ignores. Per-head
  q/k norms (Qwen3) fold the same way into W_Q's and W_K's columns.
- T is the product of the norms the stream itself passes between the write and the read, each P diag(gamma) in
  order (post-norm models such as BERT: the two LayerNorms of every layer from l to m - 1); the MLPs' paths are not
  part of the score.
- Biases (of q, k, v, o and the norms' beta) add constants that do not depend on the writer: left out.
- RoPE rotates q and k by their positions, q_s k_t^T = x_q W_Q R_(t-s) W_K^T x_k^T: W_QK is the circuit at offset
  0 (R = I), and so are the Q- and K-scores; values are not rotated, V-composition has no such caveat.
- The softmax and the MLPs are outside the circuit (as in Elhage et al.).

**Cost.** No (D, D) matrix is formed and nothing is factorised: with A = L R, B = L' R' (L, L' (D, d)),
||A B||_F^2 = sum((G M) * (M G')) where M = R L' (d, d), G = L^T L and G' = R' R'^T (d, d). A pair of layers is one
(h d, D) x (D, (3 h + 2 g) d) product (every M at once) and (d, d) products; K and V per KV head read each KV head's
W_K, W_V once, with its group's Gram matrices summed (nothing is repeated to h heads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from multihead.errors import MultiheadError

KINDS = ("q", "k", "v", "k_kv", "v_kv")  # per query head of the reader: q, k, v; per KV head: k_kv, v_kv
# pre-norm decoders with q/k/v/o_proj (Phi-3: a fused qkv_proj), read through their input norm (RMSNorm; OLMo's
# LayerNorm without parameters), with per-head q/k norms (Qwen3, Gemma 3) and Gemma 2/3's post-attention norm
_HF_DECODERS = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "phi3", "gpt_oss", "gemma", "gemma2",
                "gemma3_text")
_HF_ENCODERS = ("bert",)  # post-LayerNorm encoders
_HF_GPT2 = ("gpt2",)  # pre-LayerNorm decoders with a fused c_attn and c_proj (Conv1D: (in, out) weights)
HF_FAMILIES = _HF_DECODERS + _HF_GPT2 + _HF_ENCODERS  # the transformers model types read here


# ---------------------------------------------------------------------------------------------- what the heads read
@dataclass(frozen=True)
class Norm:
    """The linear part of a norm, x -> (x P) * weight: P the centring for LayerNorm (``center``), I for RMSNorm."""

    name: str  # where it sits in the model, e.g. "layers.3.attn_norm"
    weight: Tensor | None  # (D,), None for a norm without a weight
    center: bool

    def read(self, w: Tensor) -> Tensor:
        """N W for input projections W (..., D, d): rows scaled by the weight, then centred over D."""
        if self.weight is not None:
            w = w * self.weight.to(w)[:, None]
        return w - w.mean(-2, keepdim=True) if self.center else w

    def write(self, x: Tensor) -> Tensor:
        """X N for rows X (..., D) written to the stream."""
        if self.center:
            x = x - x.mean(-1, keepdim=True)
        return x if self.weight is None else x * self.weight.to(x)


@dataclass(frozen=True)
class LayerCircuit:
    """One attention layer's weights as the circuits use them, the layer's read norm folded in:
    ``w_q`` (h, D, d) = N W_Q, ``w_k`` and ``w_v`` (g, D, d) = N W_K, N W_V, ``w_o`` (h, d, D) = W_O."""

    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    w_o: Tensor

    @property
    def n_heads(self) -> int:
        return int(self.w_q.shape[0])

    @property
    def n_kv_heads(self) -> int:
        return int(self.w_k.shape[0])

    @property
    def group(self) -> int:
        """r = h / g query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return int(self.w_q.shape[2])

    @property
    def d_model(self) -> int:
        return int(self.w_q.shape[1])

    def kv_head(self, head: int) -> int:
        """g(i) = i // r: the KV head query head i reads."""
        return head // self.group

    def qk(self, head: int) -> Tensor:
        """W_QK^i = (N W_Q^i) (N W_K^g(i))^T (D, D), formed for this one head."""
        self._check_head(head)
        return self.w_q[head] @ self.w_k[self.kv_head(head)].transpose(0, 1)

    def ov(self, head: int) -> Tensor:
        """W_OV^i = (N W_V^g(i)) W_O^i (D, D), formed for this one head."""
        self._check_head(head)
        return self.w_v[self.kv_head(head)] @ self.w_o[head]

    def _check_head(self, head: int) -> None:
        if not isinstance(head, int) or isinstance(head, bool) or not 0 <= head < self.n_heads:
            raise MultiheadError(f"head {head!r} does not exist: this layer has query heads 0 .. {self.n_heads - 1}")


@dataclass(frozen=True)
class Circuits:
    """A model's attention layers as circuits: ``layers[l]`` (:class:`LayerCircuit`), ``stream[l]`` the norms the
    residual stream passes after layer l's attention writes and before layer l + 1 reads (empty in pre-norm models),
    and ``notes`` saying what was folded and what was left out."""

    model: str
    layers: tuple[LayerCircuit, ...]
    stream: tuple[tuple[Norm, ...], ...]
    notes: tuple[str, ...]

    def path(self, writer: int, reader: int) -> list[Norm]:
        """The norms of T, from a write in layer ``writer`` to the read in layer ``reader`` (> writer), in order."""
        if not 0 <= writer < reader < len(self.layers):
            raise MultiheadError(f"writer layer {writer} must come before reader layer {reader}, both in 0 .. "
                                 f"{len(self.layers) - 1}")
        return [norm for layer in range(writer, reader) for norm in self.stream[layer]]

    def write(self, writer: int, reader: int, x: Tensor) -> Tensor:
        """X T: rows (..., D) written by layer ``writer`` as layer ``reader`` receives them (the linear part)."""
        for norm in self.path(writer, reader):
            x = norm.write(x)
        return x


def circuits(model: Any, *, dtype: torch.dtype = torch.float64) -> Circuits:
    """The circuits of every attention layer of ``model``, in ``dtype`` (float64 by default), norms folded as the
    module says: our :class:`~multihead.models.llama.LlamaModel` and BERT encoder (``BertEncoder`` or a
    ``SentenceEncoder``), a head-analysis adapter of either (``load_head_model``), or a transformers model of type
    llama, mistral, qwen2, qwen3, gpt2 (decoders) or bert (an encoder). Anything else raises a MultiheadError
    naming it."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise MultiheadError(f"dtype ({dtype!r}) must be a floating-point torch dtype, e.g. torch.float64")
    from multihead.models.bert import BertEncoder, SentenceEncoder
    from multihead.models.llama import LlamaModel

    inner = _unwrap(model)
    if isinstance(inner, SentenceEncoder):
        inner = inner.encoder
    if isinstance(inner, LlamaModel):
        return _llama_port(inner, dtype)
    if isinstance(inner, BertEncoder):
        return _bert_port(inner, dtype)
    config = getattr(inner, "config", None)
    transformers_model = hasattr(config, "model_type") and hasattr(inner, "_can_set_attn_implementation")
    if isinstance(inner, nn.Module) and transformers_model:
        return _transformers(inner, dtype)
    raise MultiheadError(f"composition scores read multihead's LlamaModel and BERT encoder and transformers models "
                         f"({', '.join(_HF_DECODERS + _HF_GPT2 + _HF_ENCODERS)}): got a {type(model).__name__}")


def _unwrap(model: Any) -> Any:
    """The model inside a head-analysis adapter (multihead.heads.adapters), or the model itself."""
    from multihead.heads.adapters import DecoderHeads, EncoderHeads, TransformersHeads
    from multihead.models.decoder import Decoder

    if isinstance(model, DecoderHeads | TransformersHeads | Decoder):
        return model.model
    if isinstance(model, EncoderHeads):
        return model.encoder
    return model


def _plain(w: Any, where: str) -> Tensor:
    """A parameter as a plain tensor, refusing one split over processes (a DTensor shard holds part of the heads)."""
    if not isinstance(w, Tensor) or type(w) not in (Tensor, nn.Parameter):
        raise MultiheadError(f"{where} is a {type(w).__name__}, not a plain tensor: composition scores need every "
                             "head's weights in one process (gather a model split over processes first)")
    if w.is_meta:
        raise MultiheadError(f"{where} is on the meta device (no values): load the weights first")
    return w.detach()


def _heads(where: str, q: Tensor, k: Tensor, v: Tensor, o: Tensor, *, h: int, g: int, d: int, norm: Norm | None,
           dtype: torch.dtype, q_scale: Tensor | None = None, k_scale: Tensor | None = None) -> LayerCircuit:
    """Split nn.Linear weights into heads: q (h d, D), k and v (g d, D), o (D, h d) -> a LayerCircuit, the read norm
    (and per-head q/k norm weights (d,), if any) folded in."""
    d_model = o.shape[0]
    expected = {"q": (h * d, d_model), "k": (g * d, d_model), "v": (g * d, d_model), "o": (d_model, h * d)}
    for name, w in (("q", q), ("k", k), ("v", v), ("o", o)):
        if tuple(w.shape) != expected[name]:
            raise MultiheadError(f"{where}: the {name} projection is {tuple(w.shape)}, but {h} query heads and {g} KV "
                                 f"heads of head_dim {d} over d_model {d_model} make {expected[name]}")
    if h % g:
        raise MultiheadError(f"{where}: {h} query heads do not divide into {g} KV heads")
    w_q = q.to(dtype).view(h, d, d_model).transpose(1, 2)  # (h, D, d)
    w_k = k.to(dtype).view(g, d, d_model).transpose(1, 2)  # (g, D, d)
    w_v = v.to(dtype).view(g, d, d_model).transpose(1, 2)  # (g, D, d)
    w_o = o.to(dtype).view(d_model, h, d).permute(1, 2, 0)  # (h, d, D)
    if q_scale is not None:
        w_q = w_q * q_scale.to(w_q)  # per-head q norm's weight on the columns: W_Q^i diag(gamma_q)
    if k_scale is not None:
        w_k = w_k * k_scale.to(w_k)
    if norm is not None:
        w_q, w_k, w_v = norm.read(w_q), norm.read(w_k), norm.read(w_v)
    return LayerCircuit(w_q.contiguous(), w_k.contiguous(), w_v.contiguous(), w_o.contiguous())


def _weight(module: Any, where: str) -> Tensor | None:
    w = getattr(module, "weight", None)
    return None if w is None else _plain(w, f"{where}.weight")


_RMS_NOTE = "the {} RMSNorm weight folded into W_Q, W_K, W_V (exact for the linear part: 1/rms(x) is a per-token scale)"
_ROPE_NOTE = "RoPE outside the static circuit: Q- and K-scores are at relative offset 0"
_BIAS_NOTE = "biases left out (constants that do not depend on the writer)"


def _llama_port(model: Any, dtype: torch.dtype) -> Circuits:
    from multihead.layers.attention import MultiHeadAttention

    layers = []
    for i, block in enumerate(model.layers):
        attn = block.attn
        where = f"layers.{i}.attn"
        if not isinstance(attn, MultiHeadAttention):
            raise MultiheadError(f"{where} is a {type(attn).__name__}: composition scores read MultiHeadAttention "
                                 "layers (q/k/v/o projections)")
        c = attn.config
        if c.kv_dim != c.d_model or c.value_dim != c.d_model:
            raise MultiheadError(f"{where} is a cross-attention layer: composition scores are for self-attention")
        norm = Norm(f"layers.{i}.attn_norm", _weight(block.attn_norm, f"layers.{i}.attn_norm"), center=False)
        layers.append(_heads(where, *(_plain(getattr(attn, p).weight, f"{where}.{p}.weight")
                                      for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
                             h=c.n_heads, g=c.n_kv_heads, d=c.head_dim, norm=norm, dtype=dtype))
    notes = (_RMS_NOTE.format("attn_norm"), _ROPE_NOTE)
    return Circuits(type(model).__name__, tuple(layers), tuple(() for _ in layers), notes)


def _post_norm_notes(first: str, second: str) -> tuple[str, ...]:
    return (f"post-LayerNorm: between a write in layer l and a read in layer m, T = the {first} and {second} "
            "LayerNorms of layers l .. m-1 in order, each P diag(gamma) (exact for the linear part; the MLPs' paths "
            "left out)", _BIAS_NOTE + ", the LayerNorms' beta too")


def _bert_port(model: Any, dtype: torch.dtype) -> Circuits:
    layers, stream = [], []
    for i, layer in enumerate(model.layers):
        attn, where = layer.attn, f"layers.{i}.attn"
        c = attn.config
        layers.append(_heads(where, *(_plain(getattr(attn, p).weight, f"{where}.{p}.weight")
                                      for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
                             h=c.n_heads, g=c.n_kv_heads, d=c.head_dim, norm=None, dtype=dtype))
        stream.append(tuple(Norm(f"layers.{i}.{n}", _weight(getattr(layer, n), f"layers.{i}.{n}"), center=True)
                            for n in ("attn_norm", "ffn_norm")))
    return Circuits(type(model).__name__, tuple(layers), tuple(stream), _post_norm_notes("attn_norm", "ffn_norm"))


def _transformers(model: nn.Module, dtype: torch.dtype) -> Circuits:
    from multihead import hf

    config: Any = model.config
    model_type = hf.model_type(model)
    name = type(model).__name__
    known = _HF_DECODERS + _HF_GPT2 + _HF_ENCODERS
    if model_type not in known:
        raise MultiheadError(f"composition scores cannot read {name} (model_type {model_type!r}): its weights and "
                             f"norms are read for transformers models of type {', '.join(known)}")
    if model_type in _HF_ENCODERS:
        return _transformers_bert(model, name, dtype)
    if model_type in _HF_GPT2:
        return _transformers_gpt2(model, name, dtype)
    base: Any = getattr(model, "model", model)
    base = getattr(base, "language_model", base)  # a multimodal model's text model (Gemma 3)
    blocks = getattr(base, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise MultiheadError(f"{name} (model_type {model_type!r}) has no decoder layers at .model.layers or .layers")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = int(text.num_attention_heads)
    g = int(getattr(text, "num_key_value_heads", None) or h)
    layout = hf.block_layout(model)
    offset = layout.norm_offset
    layers, biased, qk_normed = [], False, False
    for i, block in enumerate(blocks):
        attn: Any = getattr(block, "self_attn", None)
        where = f"layers.{i}.self_attn"
        norm_module = getattr(block, "input_layernorm", None)
        fused = getattr(attn, "qkv_proj", None)
        names = ("qkv_proj", "o_proj") if isinstance(fused, nn.Linear) else ("q_proj", "k_proj", "v_proj", "o_proj")
        parts: list[Any] = [getattr(attn, p, None) for p in names]
        if attn is None or norm_module is None or not all(isinstance(p, nn.Linear) for p in parts):
            raise MultiheadError(f"{name}: layer {i} ({type(block).__name__}) has no self_attn with q_proj, k_proj, "
                                 "v_proj (or a fused qkv_proj), o_proj and no input_layernorm: its weights cannot be "
                                 "read")
        biased = biased or any(p.bias is not None for p in parts)
        weights = [_plain(p.weight, f"{where}.{n}.weight") for p, n in zip(parts, names, strict=True)]
        d = int(getattr(attn, "head_dim", None) or weights[-1].shape[1] // h)
        if len(weights) == 2:  # Phi-3: rows of q (h d), k (g d), v (g d) in one matrix
            weights = [*weights[0].split([h * d, g * d, g * d], dim=0), weights[1]]
        norm = _read_norm(norm_module, f"layers.{i}.input_layernorm", offset)
        scales: list[Tensor | None] = [None, None]
        if all(isinstance(getattr(attn, n, None), nn.Module) for n in ("q_norm", "k_norm")):
            qk_normed = True
            scales = [_offset(_weight(getattr(attn, n), f"{where}.{n}"), offset) for n in ("q_norm", "k_norm")]
        if layout.attn_write != layout.attention:  # Gemma 2/3: the write passes a norm: W_O diag(gamma)
            post = _read_norm(getattr(block, layout.attn_write), f"layers.{i}.{layout.attn_write}", offset)
            if post.weight is not None:
                weights[3] = weights[3] * post.weight.to(weights[3])[:, None]
        layers.append(_heads(where, *weights, h=h, g=g, d=d, norm=norm, dtype=dtype, q_scale=scales[0],
                             k_scale=scales[1]))
    notes = [_RMS_NOTE.format("input_layernorm") if not _is_plain_layer_norm(blocks[0].input_layernorm) else
             "OLMo's input LayerNorm (no parameters) folded as its centring P", _ROPE_NOTE]
    if offset:
        notes.append("Gemma's RMSNorms scale by (1 + weight): that is the scale folded")
    if qk_normed:
        notes.append("the per-head q_norm and k_norm weights folded into W_Q's and W_K's columns (exact for the "
                     "linear part, up to a per-token, per-head scale)")
    if layout.attn_write != layout.attention:
        notes.append(f"the {layout.attn_write} weight folded into W_O's output columns (a head's write passes it "
                     "before it joins the stream; exact for the linear part: 1/rms is a per-token scale)")
    if isinstance(getattr(blocks[0].self_attn, "qkv_proj", None), nn.Linear):
        notes.append("the fused qkv_proj split into W_Q, W_K, W_V by rows")
    if isinstance(getattr(blocks[0].self_attn, "sinks", None), Tensor):
        notes.append("gpt-oss's per-head sink logits outside the static circuit (they only rescale the pattern)")
    if biased:
        notes.append(_BIAS_NOTE)
    return Circuits(name, tuple(layers), tuple(() for _ in layers), tuple(notes))


def _is_plain_layer_norm(module: Any) -> bool:
    return type(module).__name__ == "OlmoLayerNorm"


def _offset(w: Tensor | None, offset: float) -> Tensor | None:
    return w if w is None or not offset else w + offset


def _read_norm(module: Any, where: str, offset: float) -> Norm:
    """A pre-norm decoder's norm as a :class:`Norm`: an RMSNorm's weight (1 + weight for Gemma's), or OLMo's
    LayerNorm without parameters (its centring alone)."""
    if _is_plain_layer_norm(module):
        return Norm(where, None, center=True)
    if not type(module).__name__.endswith("RMSNorm"):
        raise MultiheadError(f"{where} is a {type(module).__name__}, not an RMSNorm: its weight cannot be folded")
    w = _weight(module, where)
    return Norm(where, _offset(w, offset), center=False)


def _transformers_gpt2(model: nn.Module, name: str, dtype: torch.dtype) -> Circuits:
    """GPT-2: pre-LayerNorm blocks (ln_1 folded into W_Q, W_K, W_V as P diag(gamma)), c_attn's (D, 3D) Conv1D weight
    split into q, k, v and, like c_proj's, transposed to nn.Linear's (out, in)."""
    base: Any = getattr(model, "transformer", model)
    blocks = getattr(base, "h", None)
    if not isinstance(blocks, nn.ModuleList):
        raise MultiheadError(f"{name} (model_type 'gpt2') has no blocks at .transformer.h")
    config: Any = model.config
    h = int(config.num_attention_heads)
    layers = []
    block: Any
    for i, block in enumerate(blocks):
        where = f"transformer.h.{i}.attn"
        attn = getattr(block, "attn", None)
        if attn is None or getattr(attn, "is_cross_attention", False) or not isinstance(block.ln_1, nn.LayerNorm):
            raise MultiheadError(f"{name}: block {i} has no self-attention 'attn' read through a LayerNorm 'ln_1'")
        qkv = _plain(attn.c_attn.weight, f"{where}.c_attn.weight")  # (D, 3 D): x @ W
        d_model = qkv.shape[0]
        if tuple(qkv.shape) != (d_model, 3 * d_model) or d_model % h:
            raise MultiheadError(f"{where}.c_attn.weight is {tuple(qkv.shape)}: expected (d_model, 3 d_model) with "
                                 f"d_model divisible by {h} heads")
        q, k, v = (w.T for w in qkv.split(d_model, dim=1))  # (D, D) each, as nn.Linear's (out, in)
        o = _plain(attn.c_proj.weight, f"{where}.c_proj.weight").T
        norm = Norm(f"transformer.h.{i}.ln_1", _weight(block.ln_1, f"transformer.h.{i}.ln_1"), center=True)
        layers.append(_heads(where, q, k, v, o, h=h, g=h, d=d_model // h, norm=norm, dtype=dtype))
    notes = ("the ln_1 LayerNorm folded into W_Q, W_K, W_V as P diag(gamma) (centring and weight; exact for the "
             "linear part: 1/sigma(x) is a per-token scale)",
             "learned absolute positions: they are in the stream the heads read, so the Q- and K-scores carry no "
             "RoPE caveat", _BIAS_NOTE + ", ln_1's beta too")
    return Circuits(name, tuple(layers), tuple(() for _ in layers), notes)


def _transformers_bert(model: nn.Module, name: str, dtype: torch.dtype) -> Circuits:
    base: Any = getattr(model, "bert", model)
    blocks = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(blocks, nn.ModuleList):
        raise MultiheadError(f"{name} (model_type 'bert') has no encoder layers at .encoder.layer")
    config: Any = model.config
    h = int(config.num_attention_heads)
    layers, stream = [], []
    block: Any
    for i, block in enumerate(blocks):
        where = f"encoder.layer.{i}.attention"
        self_attn, out = block.attention.self, block.attention.output
        weights = [_plain(m.weight, f"{where}.{n}.weight") for m, n in
                   ((self_attn.query, "self.query"), (self_attn.key, "self.key"), (self_attn.value, "self.value"),
                    (out.dense, "output.dense"))]
        layers.append(_heads(where, *weights, h=h, g=h, d=out.dense.weight.shape[0] // h, norm=None, dtype=dtype))
        norms = ((f"{where}.output.LayerNorm", out.LayerNorm), (f"encoder.layer.{i}.output.LayerNorm",
                                                                block.output.LayerNorm))
        stream.append(tuple(Norm(n, _weight(m, n), center=True) for n, m in norms))
    return Circuits(name, tuple(layers), tuple(stream),
                    _post_norm_notes("attention.output.LayerNorm", "output.LayerNorm"))


# ---------------------------------------------------------------------------------------------- the scores
def composition_score(a: Tensor, b: Tensor) -> float:
    """C(A, B) = ||A B||_F / (||A||_F ||B||_F) of two matrices (A's columns meet B's rows), in float64; 0 where a
    norm is 0. For a writer's W_OV and a reader's W_QK (Q), W_QK^T (K) or W_OV (V)."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        shapes = [tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__ for x in (a, b)]
        raise MultiheadError(f"composition_score takes two matrices A (n, k) and B (k, m), got {shapes[0]} and "
                             f"{shapes[1]}")
    a64, b64 = a.detach().double(), b.detach().double()
    denominator = float(a64.norm() * b64.norm())
    return float((a64 @ b64).norm()) / denominator if denominator else 0.0


def _gram(w: Tensor) -> Tensor:
    """W^T W (..., d, d) of W (..., n, d)."""
    return w.transpose(-1, -2) @ w


def _writers(layer: LayerCircuit) -> tuple[Tensor, Tensor]:
    """Each writer head's W_OV^w = L_w R_w as (G_w, R_w): G_w = L_w^T L_w (h, d, d) of L_w = N W_V^g(w), and
    R_w = W_O^w (h, d, D)."""
    kv = torch.arange(layer.n_heads, device=layer.w_o.device) // layer.group
    return _gram(layer.w_v)[kv], layer.w_o


def _readers(layer: LayerCircuit) -> tuple[Tensor, Tensor]:
    """Every reading matrix B = L R of the layer as (L (D, d), G = R R^T (d, d)), side by side:
    [Q (h) | K (h) | V (h) | K per KV head (g) | V per KV head (g)] -> L (D, (3 h + 2 g) d), G (3 h + 2 g, d, d)."""
    h, g, d, dm = layer.n_heads, layer.n_kv_heads, layer.head_dim, layer.d_model
    kv = torch.arange(h, device=layer.w_q.device) // layer.group
    q_gram, k_gram = _gram(layer.w_q), _gram(layer.w_k)  # (h | g, d, d)
    o_gram = layer.w_o @ layer.w_o.transpose(1, 2)  # (h, d, d): W_O^i W_O^i^T
    lefts = torch.cat([layer.w_q, layer.w_k[kv], layer.w_v[kv], layer.w_k, layer.w_v])  # (3h + 2g, D, d)
    grams = torch.cat([
        k_gram[kv],  # Q: W_QK^i = N W_Q^i (N W_K^g(i))^T
        q_gram,  # K: (W_QK^i)^T = N W_K^g(i) (N W_Q^i)^T
        o_gram,  # V: W_OV^i = N W_V^g(i) W_O^i
        q_gram.view(g, -1, d, d).sum(1),  # K per KV head: N W_K^j [(N W_Q^i)^T for i in G(j)]
        o_gram.view(g, -1, d, d).sum(1),  # V per KV head: N W_V^j [W_O^i for i in G(j)]
    ])
    return lefts.permute(1, 0, 2).reshape(dm, -1), grams


def _frobenius2(g_left: Tensor, m: Tensor, g_right: Tensor) -> Tensor:
    """||L M R||_F^2 = sum((G_L M) * (M G_R)) with G_L = L^T L, G_R = R R^T (no factor of L or R is formed)."""
    return ((g_left @ m) * (m @ g_right)).sum((-2, -1)).clamp(min=0)


def _scores(writer: tuple[Tensor, Tensor], reader: tuple[Tensor, Tensor], d: int) -> Tensor:
    """C for every writer head (G_w (h_w, d, d), R_w T (h_w, d, D)) and reading matrix (L (D, n d), G (n, d, d)):
    (n, h_w). ||W_OV^w T B||^2 = ||L_w (R_w T L) R||^2, the middle a (d, d) block of one product."""
    g_w, r_w = writer
    left, g_r = reader
    h_w, n = r_w.shape[0], g_r.shape[0]
    middle = (r_w.reshape(h_w * d, -1) @ left).view(h_w, d, n, d).transpose(1, 2)  # (h_w, n, d, d)
    numerator = torch.cat([_frobenius2(g_w[i:i + 1, None], middle[i:i + 1], g_r) for i in range(h_w)]).sqrt()
    eye = torch.eye(d, dtype=r_w.dtype, device=r_w.device)
    writer_norm = _frobenius2(g_w, eye, r_w @ r_w.transpose(1, 2)).sqrt()  # ||L_w R_w T|| (h_w,)
    left_gram = _gram(left.view(left.shape[0], n, d).transpose(0, 1))  # (n, d, d): L^T L
    reader_norm = _frobenius2(left_gram, eye, g_r).sqrt()  # ||B|| (n,)
    denominator = writer_norm[:, None] * reader_norm
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    return torch.where(denominator > 0, numerator / safe, torch.zeros_like(numerator)).transpose(0, 1)


def random_baseline(d_model: int, head_dim: int, *, group: int = 1, samples: int = 200, seed: int = 0
                    ) -> tuple[float, float]:
    """Mean and standard deviation of C(A, B) for random A = L R (L (D, d), R (d, D)) and B = L' R' (L' (D, d),
    R' (d, group D)) with Gaussian entries: the score random weights of these shapes get (float64, ``samples`` draws
    from ``seed``). ``group`` 1 for the per-query-head kinds, r = h / g for the per-KV-head ones."""
    for name, value, low in (("d_model", d_model, 1), ("head_dim", head_dim, 1), ("group", group, 1),
                             ("samples", samples, 1), ("seed", seed, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise MultiheadError(f"{name} ({value!r}) must be an int >= {low}")
    generator = torch.Generator().manual_seed(seed)
    chunk = max(1, min(samples, (1 << 23) // (d_model * head_dim * (3 + group))))  # ~64 MB of draws at a time
    found = []
    for start in range(0, samples, chunk):
        n = min(chunk, samples - start)
        left, left_b = (torch.randn(n, d_model, head_dim, generator=generator, dtype=torch.float64) for _ in "ab")
        right = torch.randn(n, head_dim, d_model, generator=generator, dtype=torch.float64)
        right_b = torch.randn(n, head_dim, group * d_model, generator=generator, dtype=torch.float64)
        eye = torch.eye(head_dim, dtype=torch.float64)
        g_a, g_b = _gram(left), right_b @ right_b.transpose(1, 2)
        numerator = _frobenius2(g_a, right @ left_b, g_b).sqrt()
        norm_a = _frobenius2(g_a, eye, right @ right.transpose(1, 2)).sqrt()
        norm_b = _frobenius2(_gram(left_b), eye, g_b).sqrt()
        found.append(numerator / (norm_a * norm_b))
    values = torch.cat(found)
    return float(values.mean()), float(values.std()) if samples > 1 else 0.0


@dataclass(frozen=True)
class PairScores:
    """The scores of the heads of one writer layer into one later reader layer: ``q``, ``k``, ``v`` (h_reader,
    h_writer), per query head of the reader; ``k_kv``, ``v_kv`` (g_reader, h_writer), per KV head of the reader."""

    writer: int
    reader: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    k_kv: np.ndarray
    v_kv: np.ndarray

    def kind(self, kind: str) -> np.ndarray:
        if kind not in KINDS:
            raise MultiheadError(f"kind {kind!r} is unknown: choose one of {', '.join(KINDS)}")
        value: np.ndarray = getattr(self, kind)
        return value


@dataclass(frozen=True)
class Composition:
    """Q-, K- and V-composition of every head into every head of a later layer (see the module for the formulas).

    ``pairs[(writer, reader)]`` holds one :class:`PairScores` per pair of layers writer < reader; ``baseline`` (mean,
    std) is the random score per query head, ``baseline_kv[r]`` per KV head shared by r query heads; ``notes`` say
    what was folded and what was left out."""

    model: str
    d_model: int
    head_dim: int
    n_heads: tuple[int, ...]
    n_kv_heads: tuple[int, ...]
    pairs: dict[tuple[int, int], PairScores]
    baseline: tuple[float, float]
    baseline_kv: dict[int, tuple[float, float]]
    samples: int
    seed: int
    notes: tuple[str, ...] = field(default=())

    def scores(self, kind: str, writer: int, reader: int) -> np.ndarray:
        """(h_reader, h_writer) for q, k, v; (g_reader, h_writer) for k_kv, v_kv."""
        if (writer, reader) not in self.pairs:
            known = sorted({w for w, _ in self.pairs} | {r for _, r in self.pairs})
            raise MultiheadError(f"no scores for writer layer {writer} into reader layer {reader}: the pairs are "
                                 f"writer < reader among layers {known}")
        return self.pairs[(writer, reader)].kind(kind)

    def baseline_of(self, kind: str, reader: int) -> float:
        """The random baseline's mean for this kind of score into layer ``reader``."""
        if kind in ("k_kv", "v_kv"):
            return self.baseline_kv[self.n_heads[reader] // self.n_kv_heads[reader]][0]
        return self.baseline[0]

    def corrected(self, kind: str, writer: int, reader: int) -> np.ndarray:
        """The scores minus the random baseline of their shape."""
        return self.scores(kind, writer, reader) - self.baseline_of(kind, reader)

    def top(self, kind: str = "k", n: int = 10, *, corrected: bool = True) -> list[tuple[int, int, int, int, float]]:
        """The n largest (writer layer, writer head, reader layer, reader head or KV head, score), baseline-corrected
        unless ``corrected=False``."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise MultiheadError(f"n ({n!r}) must be a positive int")
        found: list[tuple[int, int, int, int, float]] = []
        for (w, r), pair in self.pairs.items():
            values = pair.kind(kind) - (self.baseline_of(kind, r) if corrected else 0.0)
            found.extend((w, int(wh), r, int(rh), float(values[rh, wh])) for rh, wh in np.ndindex(*values.shape))
        return sorted(found, key=lambda item: -item[4])[:n]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON: the model's shape, the baselines, the notes and per pair of layers the raw scores (reader rows,
        writer columns; corrected = raw - baseline)."""
        return {
            "model": self.model, "d_model": self.d_model, "head_dim": self.head_dim,
            "n_heads": list(self.n_heads), "n_kv_heads": list(self.n_kv_heads),
            "formula": "||A B||_F / (||A||_F ||B||_F); A = W_OV(writer) T; B = W_QK(reader) (q), W_QK^T (k), W_OV (v); "
                       "per KV head: the group's query-side matrices side by side",
            "baseline": {"per_query_head": {"mean": self.baseline[0], "std": self.baseline[1]},
                         "per_kv_head": {str(r): {"mean": m, "std": s}
                                         for r, (m, s) in sorted(self.baseline_kv.items())},
                         "samples": self.samples, "seed": self.seed, "draws": "gaussian factors of the same shapes"},
            "notes": list(self.notes),
            "pairs": [{"writer_layer": w, "reader_layer": r,
                       **{kind: p.kind(kind).tolist() for kind in KINDS}} for (w, r), p in sorted(self.pairs.items())],
        }


def composition_scores(model: Any, *, layers: Sequence[int] | None = None, samples: int = 200, seed: int = 0,
                       dtype: torch.dtype = torch.float64) -> Composition:
    """Q-, K- and V-composition (and K, V per KV head) of every head into every head of every later layer, with the
    random baseline (module docstring: the formulas, the norm fold, what sits outside the circuit).

    Args:
        model: a model :func:`circuits` reads, or its :class:`Circuits`.
        layers: the attention layers to pair (default all); at least two.
        samples, seed: the random baseline's draws.
        dtype: the arithmetic's dtype (float64 by default; the weights are read in it).
    """
    circ = model if isinstance(model, Circuits) else circuits(model, dtype=dtype)
    n = len(circ.layers)
    chosen = list(range(n)) if layers is None else list(layers)
    bad = [x for x in chosen if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < n]
    if bad or len(set(chosen)) != len(chosen):
        raise MultiheadError(f"layers {chosen!r} must be distinct layer numbers in 0 .. {n - 1}")
    if len(chosen) < 2:
        raise MultiheadError(f"composition pairs heads of different layers: {circ.model} gives {len(chosen)} "
                             "attention layer(s), at least two are needed")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise MultiheadError(f"samples ({samples!r}) must be a positive int (the random baseline's draws)")
    chosen.sort()
    first = circ.layers[chosen[0]]
    d_model, d = first.d_model, first.head_dim
    for i in chosen:
        if (circ.layers[i].d_model, circ.layers[i].head_dim) != (d_model, d):
            raise MultiheadError(f"layer {i} has d_model {circ.layers[i].d_model} and head_dim "
                                 f"{circ.layers[i].head_dim}, layer {chosen[0]} {d_model} and {d}: one shape is needed")
    pairs: dict[tuple[int, int], PairScores] = {}
    with torch.no_grad():
        writers = {i: _writers(circ.layers[i]) for i in chosen[:-1]}  # W_O (h, d, D) and (h, d, d) each
        for reader in chosen[1:]:
            layer = circ.layers[reader]
            h, g = layer.n_heads, layer.n_kv_heads
            f = _readers(layer)  # (D, (3h + 2g) d) and (3h + 2g, d, d)
            for writer in [w for w in chosen if w < reader]:
                g_w, r_w = writers[writer]
                written = (g_w, circ.write(writer, reader, r_w))  # R_w T
                s = _scores(written, f, d).double().cpu().numpy()  # (3h + 2g, h_w)
                pairs[(writer, reader)] = PairScores(writer, reader, s[:h], s[h:2 * h], s[2 * h:3 * h],
                                                     s[3 * h:3 * h + g], s[3 * h + g:])
    groups = {circ.layers[i].group for i in chosen[1:]}
    baseline = random_baseline(d_model, d, samples=samples, seed=seed)
    baseline_kv = {r: baseline if r == 1 else random_baseline(d_model, d, group=r, samples=samples, seed=seed)
                   for r in groups}
    return Composition(circ.model, d_model, d, tuple(c.n_heads for c in circ.layers),
                       tuple(c.n_kv_heads for c in circ.layers), pairs, baseline, baseline_kv, samples, seed,
                       circ.notes)
