"""Direct logit attribution and the logit lens: what each head, each MLP and the embeddings write toward an answer,
read exactly from one run on raw weights (nothing folded, the logits are the model's own).

The residual stream before the final norm is a sum of writes, x = e + sum_(l, i) z_(l,i) W_O^(l,i) + sum_l b_O^l
+ sum_l m_l (embeddings e, head i of layer l writing its output z before W_O through its block of W_O's columns,
W_O's bias, MLP outputs m_l). The final norm is affine once its scale is frozen at the real run's,
``norm(x) = (x P) * gamma / sigma(x) + beta`` (P the centring for LayerNorm, I for RMSNorm; sigma the RMS, or the
standard deviation, of x, + eps), so with u = W_U[answer] - W_U[wrong] (or W_U[answer] alone) each write w
contributes ``(w P) (gamma * u) / sigma(x)`` to the logit difference, and::

    logit[answer] - logit[wrong] = embed + sum heads + sum mlps + constant + remainder

- ``heads`` (b, n_layers, n_heads, s): z_(l,i) W_O^(l,i) projected, plus an equal share b_O^l / n_heads of its
  layer's output bias (none in Llama-family models);
- ``mlps`` (b, n_layers, s), ``embed`` (b, s): the token embeddings (block 0's ``hook_resid_pre``);
- ``constant`` (b, s): beta . u and the unembedding's bias difference (what no component writes);
- ``remainder`` (b, s): the model's real logit difference minus the parts. With the scale frozen the decomposition
  is exact, so the remainder is the forward's rounding (float32: ~1e-6); it is checked on every call to be within
  ``1e-4 * max(1, sum |parts|)`` (float32, float64; 16 * the dtype's eps in lower precision) and a larger one raises
  a MultiheadError: something wrote to the stream that is not a part (a hook adding to it, an architecture this
  module does not read).

What the frozen scale does not carry: a part's figure is its effect with the norm's 1 / sigma held at the real run's;
removing the part would also change sigma (the norm's nonlinearity), which only patching measures.

Every position is attributed (the answer direction is the same at all positions of a row); answers are per row.
Heads are also summed per KV head (``by_kv_head``: the r = h / g query heads sharing one KV head, GQA and MQA).

The **logit lens** (nostalgebraist 2020): each block's ``hook_resid_post`` through the final norm (its own scale)
and the unembedding; the last block's is the model's logits. The **head lens**: the tokens a head's write
z_(l,i) W_O^(l,i) pushes toward, through the final norm with the real run's frozen scale and the unembedding.

Models: multihead's :class:`~multihead.models.llama.LlamaModel` (or its head-analysis adapter), and transformers
causal models of every family of :data:`multihead.hf.LAYOUTS` after :func:`multihead.hf.enable`: Llama, Mistral,
Qwen2/3, SmolLM3, Phi-3, gpt-oss (W_O's bias shared among the heads; the sinks are in z), OLMo (a final LayerNorm
without parameters), Gemma 1/2/3 (norms scaling by 1 + weight; the embeddings' sqrt(d_model) scale is in block 0's
input; Gemma 2/3 add an RMSNorm after each attention, whose scale 1 / rms(sum of the heads' outputs) is frozen at
the real run's like the final norm's, so a head's part is z_h W_O,h (1 + w) / rms(.) projected, exactly; the MLP's
part is its post-feed-forward norm's output), and GPT-2 (LayerNorms with a bias, learned absolute positions in block
0's input, Conv1D weights read transposed). A final logit softcap (Gemma 2) makes the logits non-linear in the
stream: attribution and the head lens take the logits before it (c atanh(logit / c) of the model's own logits, which
the parts sum to exactly) and say so in the notes; the logit lens applies it, as the model does. Which tool takes
which family: :data:`multihead.heads.support.SUPPORT`. The BERT encoder has no unembedding: not here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from multihead.errors import MultiheadError
from multihead.layers.hooks import HookPoint
from multihead.names import head_name

Tokens = int | Sequence[int] | Tensor


# ---------------------------------------------------------------------------------------------- reading the model
@dataclass(frozen=True)
class _Layer:
    attn: Any  # the attention module (its six hook points)
    z: HookPoint  # the attention's hook_z (b, h, s, d)
    mlp_out: HookPoint  # the block's hook_mlp_out (b, s, D)
    resid_post: HookPoint
    w_o: Tensor  # (D, h d)
    b_o: Tensor | None  # (D,)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    post: _PostNorm | None = None  # Gemma 2/3: the norm the attention's output passes before it joins the stream


@dataclass(frozen=True)
class _PostNorm:
    """An RMSNorm between the attention's output a = sum_h z_h W_O,h and the stream (Gemma 2/3's
    post_attention_layernorm): the layer writes a * gamma / rms(a). ``out`` is the attention's hook_out (a)."""

    out: HookPoint
    gamma: Tensor  # (D,): 1 + weight
    eps: float

    def inverse_scale(self, a: Tensor) -> Tensor:
        """1 / rms(a) (..., D) -> (...), the factor frozen at the real run's."""
        return 1.0 / (a.pow(2).mean(-1) + self.eps).sqrt()


@dataclass(frozen=True)
class _Model:
    name: str
    forward: Callable[[Tensor], Tensor]  # ids (b, s) -> logits (b, s, vocab)
    embed: HookPoint  # block 0's hook_resid_pre: the embeddings
    layers: tuple[_Layer, ...]
    norm_weight: Tensor | None  # the final norm's gamma (D,)
    norm_bias: Tensor | None  # its beta
    eps: float
    center: bool  # LayerNorm (True) or RMSNorm (False)
    unembed: Tensor  # (vocab, D)
    unembed_bias: Tensor | None  # (vocab,)
    softcap: float | None = None  # the final logit softcap (Gemma 2): logits = tanh(x / c) * c
    notes: tuple[str, ...] = ()  # what the family adds, said in every result

    def capped(self, logits: Tensor) -> Tensor:
        """The model's logits from the unembedded stream: its final softcap applied, where it has one."""
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    def uncapped(self, picked: Tensor) -> Tensor:
        """Logits picked from the model's output (float64) as they were before its final softcap:
        c atanh(logit / c) (Gemma 2); themselves without one."""
        if self.softcap is None:
            return picked
        x = picked / self.softcap
        if bool((x.abs() >= 1 - 1e-6).any()):
            raise MultiheadError(f"{self.name}: a logit of {float(picked.abs().max()):.6g} sits at its softcap "
                                 f"({self.softcap:g}): the logit before the cap cannot be recovered from it")
        return torch.atanh(x) * self.softcap

    def sigma(self, x: Tensor) -> Tensor:
        """The final norm's divisor for a stream x (..., D), in x's dtype."""
        if self.center:
            return (x.var(-1, unbiased=False) + self.eps).sqrt()
        return (x.pow(2).mean(-1) + self.eps).sqrt()

    def normed(self, x: Tensor) -> Tensor:
        """The final norm of x (..., D), in x's dtype."""
        y = (x - x.mean(-1, keepdim=True) if self.center else x) / self.sigma(x)[..., None]
        if self.norm_weight is not None:
            y = y * self.norm_weight.to(y)
        return y if self.norm_bias is None else y + self.norm_bias.to(y)


def hook_point(module: Any, name: str, where: str) -> HookPoint:
    """``module``'s hook point ``name``, or a MultiheadError saying where it is missing."""
    point = getattr(module, name, None)
    if not isinstance(point, HookPoint):
        raise MultiheadError(f"{where} has no hook point {name}: for a transformers model call multihead.hf.enable("
                             "model) first")
    return point


def read_model(model: Any) -> _Model:
    """The parts of a supported model that attribution and path patching read (port, adapter or enabled transformers
    model), or a MultiheadError naming what is supported."""
    from multihead.models.llama import LlamaModel

    inner = model
    from multihead.heads.adapters import DecoderHeads, TransformersHeads
    from multihead.models.decoder import Decoder

    if isinstance(model, DecoderHeads | TransformersHeads | Decoder):
        inner = model.model
    if isinstance(inner, LlamaModel):
        return _read_port(inner)
    if isinstance(inner, nn.Module) and hasattr(inner, "_can_set_attn_implementation"):
        return _read_transformers(inner)
    raise MultiheadError(f"direct logit attribution reads multihead's LlamaModel and transformers causal models "
                         f"({', '.join(READ_FAMILIES)}) after hf.enable: got a {type(model).__name__}")


def _read_port(model: Any) -> _Model:
    layers = []
    for i, block in enumerate(model.layers):
        attn, where = block.attn, f"layers.{i}"
        layers.append(_Layer(attn, hook_point(attn, "hook_z", f"{where}.attn"),
                             hook_point(block, "hook_mlp_out", where), hook_point(block, "hook_resid_post", where),
                             attn.o_proj.weight.detach(),
                             None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
                             int(attn.n_heads), int(attn.n_kv_heads), int(attn.config.head_dim)))
    unembed = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return _Model(type(model).__name__, model, hook_point(model.layers[0], "hook_resid_pre", "layers.0"),
                  tuple(layers), model.norm.weight.detach(), None, float(model.norm.eps), False, unembed.detach(), None)


# the transformers families read here: every family of hf.LAYOUTS
READ_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "phi3", "gpt_oss", "gemma", "gemma2",
                 "gemma3_text", "gpt2")
REFUSED: dict[str, str] = {}  # a family read but refused, with the reason (none at present)


def _rms_gamma(norm: Any, offset: float, where: str) -> tuple[Tensor, float]:
    """An RMSNorm's scale (weight, or 1 + weight where the family's norms are Gemma's) and its eps."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(weight, Tensor) or eps is None:
        raise MultiheadError(f"{where} is a {type(norm).__name__}, not an RMSNorm with a weight and an eps")
    return weight.detach() + offset, float(eps)


def _read_transformers(model: nn.Module) -> _Model:
    from multihead import hf

    config: Any = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = type(model).__name__
    family = hf.model_type(model)
    blocks = list(hf.decoder_layers(model).values())
    head: Any = getattr(model, "lm_head", None)
    gpt2 = family == "gpt2"
    base: Any = getattr(model, "transformer" if gpt2 else "model", None)
    base = getattr(base, "language_model", base)  # a multimodal model's text model (Gemma 3)
    norm: Any = getattr(base, "ln_f" if gpt2 else "norm", None)
    if family in REFUSED:
        raise MultiheadError(f"direct logit attribution on {name} (model_type {family!r}): {REFUSED[family]}")
    if family not in READ_FAMILIES or not blocks or not isinstance(head, nn.Linear) or norm is None:
        raise MultiheadError(f"direct logit attribution reads transformers causal models of type "
                             f"{', '.join(READ_FAMILIES)} (decoder layers at .model.layers or GPT-2's .transformer.h, "
                             f"an lm_head): {name} (model_type {family!r}) is not one")
    layout = hf.block_layout(model)
    if gpt2 and (not isinstance(norm, nn.LayerNorm) or norm.normalized_shape != (head.weight.shape[1],)):
        raise MultiheadError(f"{name}: the final norm ln_f is a {type(norm).__name__}, not a LayerNorm over "
                             "d_model")
    cap = getattr(text, "final_logit_softcapping", None)
    h = int(text.num_attention_heads)
    g = int(getattr(text, "num_key_value_heads", None) or h)
    layers = []
    for i, block in enumerate(blocks):
        attn: Any = getattr(block, layout.attention)
        where = f"layers.{i}"
        o = attn.c_proj if gpt2 else attn.o_proj
        w_o = o.weight.detach().T if gpt2 else o.weight.detach()  # GPT-2's Conv1D holds (in, out): as nn.Linear's
        post = None
        if layout.attn_write != layout.attention:  # Gemma 2/3: a norm between the attention and the stream
            gamma, eps = _rms_gamma(getattr(block, layout.attn_write), layout.norm_offset,
                                    f"{where}.{layout.attn_write}")
            post = _PostNorm(hook_point(attn, "hook_out", f"{where}.{layout.attention}"), gamma, eps)
        layers.append(_Layer(attn, hook_point(attn, "hook_z", f"{where}.{layout.attention}"),
                             hook_point(block, "hook_mlp_out", where), hook_point(block, "hook_resid_post", where),
                             w_o, None if o.bias is None else o.bias.detach(), h, g,
                             int(getattr(attn, "head_dim", None) or w_o.shape[1] // h), post))

    def forward(ids: Tensor) -> Tensor:
        out: Tensor = model(ids, use_cache=False).logits
        return out

    embed = hook_point(blocks[0], "hook_resid_pre", "layers.0")
    unembed_bias = None if head.bias is None else head.bias.detach()
    if gpt2:  # the final LayerNorm: centred, with a bias; block 0's input is the token plus position embeddings
        return _Model(name, forward, embed, tuple(layers), None if norm.weight is None else norm.weight.detach(),
                      None if norm.bias is None else norm.bias.detach(), float(norm.eps), True,
                      head.weight.detach(), unembed_bias)
    if type(norm).__name__ == "OlmoLayerNorm":  # a LayerNorm without parameters, eps 1e-5 (as OLMo's forward)
        return _Model(name, forward, embed, tuple(layers), None, None, 1e-5, True, head.weight.detach(),
                      unembed_bias, None, ("OLMo's final LayerNorm has no parameters: its centring alone",))
    gamma, eps = _rms_gamma(norm, layout.norm_offset, "the final norm")
    notes = []
    if layout.norm_offset:
        notes.append("Gemma's RMSNorms scale by (1 + weight); the embeddings (block 0's input) carry their "
                     "sqrt(d_model) scale")
    if layers[0].post is not None:
        notes.append("each layer's post-attention RMSNorm scale frozen at the real run's too (its heads' writes "
                     "z_h W_O,h (1 + w) / rms(sum of the heads' outputs)); an MLP's part is its post-feed-forward "
                     "norm's output")
    if cap is not None:
        notes.append(f"the logits before the final softcap ({float(cap):g} tanh(x / {float(cap):g})), recovered from "
                     "the model's own as c atanh(logit / c): the parts sum to those exactly, the cap then bends them")
    return _Model(name, forward, embed, tuple(layers), gamma, None, eps, False, head.weight.detach(), unembed_bias,
                  None if cap is None else float(cap), tuple(notes))


@contextmanager
def recording(points: dict[str, HookPoint], seen: dict[str, Tensor],
              edits: Sequence[tuple[HookPoint, Callable[..., Any]]] = (), *, detach: bool = True) -> Iterator[None]:
    """While the block runs: ``edits`` (point, hook) attached first, then each of ``points`` keeping what passes it
    in ``seen`` under its key (detached unless ``detach=False``); all removed after, and a MultiheadError if a kept
    point did not fire. The one recorder of attribution, path patching and edge attribution."""

    def keeper(key: str) -> Callable[[Tensor, HookPoint], None]:
        def keep(x: Tensor, _p: HookPoint) -> None:
            seen[key] = x.detach() if detach else x
        return keep

    handles = [point.add(fn) for point, fn in edits]
    handles += [point.add(keeper(key)) for key, point in points.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    missing = [key for key in points if key not in seen]
    if missing:
        raise MultiheadError(f"hook points {', '.join(missing[:4])} were attached but did not fire: the model's "
                             "attention or blocks do not run through multihead (for a transformers model, "
                             "attn_implementation was switched away from 'multihead': call hf.enable(model) again)")


def _run(m: _Model, ids: Tensor, extra: Sequence[str] = ()) -> tuple[Tensor, dict[str, Tensor]]:
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.dtype not in (torch.long, torch.int32):
        shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise MultiheadError(f"ids must be an integer tensor (b, s), got {shape}")
    points = {"embed": m.embed}
    for i, layer in enumerate(m.layers):
        points[f"z{i}"], points[f"mlp{i}"] = layer.z, layer.mlp_out
        if layer.post is not None:
            points[f"attn{i}"] = layer.post.out
        if "resid" in extra or i == len(m.layers) - 1:
            points[f"post{i}"] = layer.resid_post
    seen: dict[str, Tensor] = {}
    with torch.no_grad(), recording(points, seen):
        logits = m.forward(ids)
    return logits, seen


def _tokens(tokens: Tokens, b: int, what: str, vocab: int) -> Tensor:
    t = tokens if isinstance(tokens, Tensor) else torch.tensor([tokens] if isinstance(tokens, int) else list(tokens))
    if t.dtype not in (torch.long, torch.int32, torch.int64) or t.ndim > 1:
        raise MultiheadError(f"{what} must be a token id or one per row (b,), got {tuple(t.shape)} {t.dtype}")
    t = t.long().reshape(-1)
    if t.numel() == 1:
        t = t.expand(b)
    if t.numel() != b:
        raise MultiheadError(f"{what} has {t.numel()} token ids for a batch of {b} rows: give one, or one per row")
    bad = [int(x) for x in t if not 0 <= int(x) < vocab]
    if bad:
        raise MultiheadError(f"{what}: token id(s) {bad[:4]} are outside the vocabulary (0 .. {vocab - 1})")
    return t


# ---------------------------------------------------------------------------------------------- attribution
@dataclass
class Attribution:
    """Direct logit attribution of one run (see the module): every figure in float64, per row and position."""

    model: str
    heads: Tensor  # (b, n_layers, n_heads, s)
    mlps: Tensor  # (b, n_layers, s)
    embed: Tensor  # (b, s)
    constant: Tensor  # (b, s) the final norm's beta and the unembedding bias, projected
    remainder: Tensor  # (b, s) the real logit difference minus the parts
    logit_diff: Tensor  # (b, s) the model's real logit difference (or logit, with no wrong answer); before its
    # final softcap where it has one (Gemma 2: c atanh(logit / c) of its own logits)
    n_kv_heads: int
    notes: tuple[str, ...]

    def total(self) -> Tensor:
        """The sum of the parts (b, s): logit_diff - remainder."""
        return self.embed + self.heads.sum((1, 2)) + self.mlps.sum(1) + self.constant

    def by_kv_head(self) -> Tensor:
        """(b, n_layers, n_kv_heads, s): the heads summed over each KV head's group of r = h / g query heads."""
        b, n_layers, h, s = self.heads.shape
        return self.heads.view(b, n_layers, self.n_kv_heads, h // self.n_kv_heads, s).sum(3)

    def top(self, n: int = 10, position: int = -1) -> list[tuple[str, float]]:
        """The n parts (heads 'L3H5', MLPs 'MLP3', 'embed') of largest |mean over rows| at ``position``."""
        rows: list[tuple[str, float]] = [("embed", float(self.embed[:, position].mean()))]
        heads = self.heads[:, :, :, position].mean(0)
        mlps = self.mlps[:, :, position].mean(0)
        for layer in range(heads.shape[0]):
            rows += [(head_name(layer, i), float(heads[layer, i])) for i in range(heads.shape[1])]
            rows.append((f"MLP{layer}", float(mlps[layer])))
        return sorted(rows, key=lambda r: -abs(r[1]))[:n]

    def __repr__(self) -> str:
        """A short summary instead of every tensor: the shape, the last position's split, the top five parts."""
        b, n_layers, h, s = self.heads.shape
        if b == 0 or s == 0:
            return f"Attribution(model={self.model!r}, {n_layers} layers x {h} heads, no positions)"
        heads = float(self.heads[..., -1].sum((1, 2)).mean())
        last = (f"embed {float(self.embed[:, -1].mean()):+.3f} + heads {heads:+.3f}"
                f" + MLPs {float(self.mlps[..., -1].sum(1).mean()):+.3f} + constant "
                f"{float(self.constant[:, -1].mean()):+.3f} + remainder {float(self.remainder[:, -1].mean()):+.1e}")
        top = ", ".join(f"{name} {value:+.3f}" for name, value in self.top(5))
        return (f"Attribution(model={self.model!r}, {n_layers} layers x {h} heads ({self.n_kv_heads} KV), {b} row"
                f"{'' if b == 1 else 's'} x {s} positions; last position, mean over rows: logit_diff "
                f"{float(self.logit_diff[:, -1].mean()):+.3f} = {last}; top: {top})")


def direct_logit_attribution(model: Any, ids: Tensor, answers: Tokens, wrongs: Tokens | None = None) -> Attribution:
    """Each head's, MLP's and the embeddings' direct effect on ``logit[answer] - logit[wrong]`` (per row: one token
    id or one per row each; without ``wrongs``, on ``logit[answer]``) at every position (see the module). Raises a
    MultiheadError when the parts and the remainder's bound do not reproduce the model's real logits."""
    m = read_model(model)
    b, s = ids.shape if isinstance(ids, Tensor) and ids.ndim == 2 else (0, 0)
    logits, seen = _run(m, ids)
    vocab = m.unembed.shape[0]
    a = _tokens(answers, b, "answers", vocab).to(logits.device)
    w = None if wrongs is None else _tokens(wrongs, b, "wrongs", vocab).to(logits.device)
    f64 = torch.float64
    real = m.uncapped(logits.to(f64).gather(-1, a.view(b, 1, 1).expand(b, s, 1))[..., 0])
    u = m.unembed[a].to(f64)  # (b, D): the answer rows only (not the whole unembedding in float64)
    const = torch.zeros(b, dtype=f64, device=logits.device)
    if m.unembed_bias is not None:
        const = const + m.unembed_bias.to(f64)[a]
    if w is not None:
        real = real - m.uncapped(logits.to(f64).gather(-1, w.view(b, 1, 1).expand(b, s, 1))[..., 0])
        u = u - m.unembed[w].to(f64)
        if m.unembed_bias is not None:
            const = const - m.unembed_bias.to(f64)[w]
    if m.norm_bias is not None:
        const = const + u @ m.norm_bias.to(f64)
    v = u if m.norm_weight is None else u * m.norm_weight.to(f64)  # (b, D): gamma * u
    if m.center:
        v = v - v.mean(-1, keepdim=True)  # (w P) . v = w . (P v)
    final = seen[f"post{len(m.layers) - 1}"].to(f64)
    inv = 1.0 / m.sigma(final)  # (b, s): the frozen scale

    def project(x: Tensor) -> Tensor:  # (b, s, D) -> (b, s)
        return torch.einsum("bsD,bD->bs", x.to(f64), v) * inv

    embed = project(seen["embed"])
    heads, mlps = [], []
    for i, layer in enumerate(m.layers):
        h, d = layer.n_heads, layer.head_dim
        w_o = layer.w_o.to(f64).view(-1, h, d)  # (D, h, d)
        scale = inv  # (b, s): the final norm's frozen 1 / sigma, and a post-attention norm's (Gemma 2/3)
        vo = v if layer.post is None else v * layer.post.gamma.to(f64)
        if layer.post is not None:
            scale = inv * layer.post.inverse_scale(seen[f"attn{i}"].to(f64))
        t = torch.einsum("bD,Dhd->bhd", vo, w_o)
        part = torch.einsum("bhsd,bhd->bhs", seen[f"z{i}"].to(f64), t) * scale[:, None]
        if layer.b_o is not None:
            bias = torch.einsum("D,bD->b", layer.b_o.to(f64), vo)[:, None] * scale  # (b, s)
            part = part + (bias / h)[:, None]
        heads.append(part)
        mlps.append(project(seen[f"mlp{i}"]))
    if len({p.shape[1] for p in heads}) != 1 or len({layer.n_kv_heads for layer in m.layers}) != 1:
        raise MultiheadError(f"{m.name}'s layers have different head counts (a pruned model): attribute one with "
                             "equal layers")
    result = Attribution(m.name, torch.stack(heads, 1), torch.stack(mlps, 1), embed,
                         const[:, None].expand(b, s).clone(), torch.zeros(b, s, dtype=f64), real,
                         m.layers[0].n_kv_heads, _notes(m))
    result.remainder = real - result.total()
    magnitude = (result.embed.abs() + result.heads.abs().sum((1, 2)) + result.mlps.abs().sum(1)
                 + result.constant.abs())
    dtype = logits.dtype
    rel = 1e-4 if dtype in (torch.float32, torch.float64) else max(1e-4, 16 * torch.finfo(dtype).eps)
    excess = result.remainder.abs() - rel * magnitude.clamp(min=1.0)
    if bool((excess > 0).any()):
        r, p = divmod(int(excess.argmax()), s)
        raise MultiheadError(
            f"{m.name}: the parts sum to {float(result.total()[r, p]):.6g} but the model's logit difference is "
            f"{float(real[r, p]):.6g} (row {r}, position {p}; remainder {float(result.remainder[r, p]):.3g}, bound "
            f"{rel:g} x the parts' magnitude {float(magnitude[r, p]):.3g}): something writes to the residual stream "
            "that is not a part (a hook adding to it, or an architecture this attribution does not read)")
    return result


def _notes(m: _Model) -> tuple[str, ...]:
    notes = [f"the final {'LayerNorm' if m.center else 'RMSNorm'}'s scale frozen at the real run's (exact: the "
             "norm is affine once it is); raw weights, nothing folded"]
    if any(layer.b_o is not None for layer in m.layers):
        notes.append("each layer's W_O bias split equally over its heads (b_O / n_heads each)")
    if m.norm_bias is not None or m.unembed_bias is not None:
        notes.append("the final norm's beta and the unembedding bias in 'constant'")
    return (*notes, *m.notes)


# ---------------------------------------------------------------------------------------------- logit lens
@dataclass
class Lens:
    """The logit lens: the top ``k`` tokens (ids, logits) of each block's stream, (n_layers, b, s, k), and, with
    answers, the logit difference each block's stream gives (n_layers, b, s)."""

    top_ids: Tensor
    top_logits: Tensor
    logit_diff: Tensor | None


def logit_lens(model: Any, ids: Tensor, *, k: int = 5, answers: Tokens | None = None,
               wrongs: Tokens | None = None) -> Lens:
    """Each block's ``hook_resid_post`` through the final norm (its own scale) and the unembedding; the last
    block's lens is the model's logits."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise MultiheadError(f"k ({k!r}) must be a positive int")
    m = read_model(model)
    _, seen = _run(m, ids, extra=("resid",))
    b = ids.shape[0]
    vocab = m.unembed.shape[0]
    a = None if answers is None else _tokens(answers, b, "answers", vocab)
    w = None if wrongs is None else _tokens(wrongs, b, "wrongs", vocab)
    tops, values, diffs = [], [], []
    for i in range(len(m.layers)):
        x = seen[f"post{i}"]
        normed = m.normed(x.float()).to(x.dtype)
        logits = normed @ m.unembed.to(normed).T
        if m.unembed_bias is not None:
            logits = logits + m.unembed_bias.to(logits)
        logits = m.capped(logits)
        top = logits.topk(min(k, vocab), dim=-1)
        tops.append(top.indices)
        values.append(top.values)
        if a is not None:
            rows = torch.arange(b, device=logits.device)
            diff = logits[rows, :, a.to(logits.device)].double()
            if w is not None:
                diff = diff - logits[rows, :, w.to(logits.device)].double()
            diffs.append(diff)
    return Lens(torch.stack(tops), torch.stack(values), torch.stack(diffs) if diffs else None)


@dataclass
class HeadLens:
    """The tokens each head's write pushes toward at one position: (b, n_layers, n_heads, k) ids and the logits the
    write alone adds (through the final norm with the real run's frozen scale)."""

    position: int
    top_ids: Tensor
    top_logits: Tensor


def head_logit_lens(model: Any, ids: Tensor, *, position: int = -1, k: int = 5) -> HeadLens:
    """The top ``k`` tokens of z_(l,i) W_O^(l,i) gamma / sigma W_U^T for every head at ``position`` (W_O's bias
    left out: it is no head's; logits before a final softcap, as in :func:`direct_logit_attribution`)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise MultiheadError(f"k ({k!r}) must be a positive int")
    m = read_model(model)
    _, seen = _run(m, ids)
    s = ids.shape[1]
    if not -s <= position < s:
        raise MultiheadError(f"position {position} is outside the {s} tokens")
    final = seen[f"post{len(m.layers) - 1}"][:, position].float()  # (b, D)
    scale = 1.0 / m.sigma(final)  # (b,)
    gamma = torch.ones_like(final[0]) if m.norm_weight is None else m.norm_weight.float()
    unembed = m.unembed.float()
    tops, values = [], []
    for i, layer in enumerate(m.layers):
        h, d = layer.n_heads, layer.head_dim
        z = seen[f"z{i}"][:, :, position].float()  # (b, h, d)
        write = torch.einsum("bhd,Dhd->bhD", z, layer.w_o.float().view(-1, h, d))
        if layer.post is not None:  # through the post-attention norm with its real scale (Gemma 2/3)
            a = seen[f"attn{i}"][:, position].float()  # (b, D)
            write = write * layer.post.gamma.float() * layer.post.inverse_scale(a)[:, None, None]
        if m.center:
            write = write - write.mean(-1, keepdim=True)
        pushed = (write * gamma * scale[:, None, None]) @ unembed.T  # (b, h, vocab)
        top = pushed.topk(min(k, unembed.shape[0]), dim=-1)
        tops.append(top.indices)
        values.append(top.values)
    return HeadLens(position, torch.stack(tops, 1), torch.stack(values, 1))
