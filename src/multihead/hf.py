"""multihead as a transformers attention implementation: any model transformers can load runs its attention core here.

::

    from multihead import hf
    model = hf.load("path/to/model")          # a local folder (config.json + safetensors) or a .gguf file
    model = hf.enable(any_hf_model)           # or switch a model you already have

transformers (5.x) calls the registered function with (module, query (b, h, s, d), key and value (b, g, t, d) after
its own RoPE and cache, attention_mask, dropout, scaling, **kwargs). Hugging Face's modules and weights run
unchanged; only the attention core is multihead's: keys and values stay g = n_kv_heads wide into the kernel (also
with a padding mask, where transformers' own SDPA path repeats them), the same hook points as our layer
(``model.layers.3.self_attn.hook_z``), exact per-head patterns on the fused path.

The mask is registered too (``AttentionMaskInterface``): without it transformers passes no mask. It is transformers'
boolean mask (True = may attend, multihead's convention), or None where transformers proves none is needed.

Keywords transformers passes, each honoured or refused by name:

- ``scaling``, ``dropout``: the factor on q·k and the dropout on the weights;
- ``is_causal``: with no mask, causal when the module says so and more than one query comes (a prefill into an
  empty static cache attends to its first s slots, as transformers' SDPA path does);
- ``sliding_window``: already in transformers' mask (or provably without effect when it passes none);
- ``softcap`` (Gemma 2): ``tanh(scores / softcap) * softcap`` before the mask;
- ``s_aux`` (gpt-oss): one learned sink logit per head, in the softmax's denominator only;
- ``position_bias`` (T5): added to the scores, with the mask;
- ``output_attentions``: the per-head weights (the math path);
- ``position_ids``, ``cache_position``, ``use_cache``, ``output_hidden_states`` and the like: not attention's concern.

Anything else (flash-attention's packed ``cu_seq_lens_*``, say) raises a MultiheadError naming it.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from multihead.cache.view import DenseKV
from multihead.errors import MultiheadError, require
from multihead.hooks import HookPoint, add_hook_points, add_resid_points, call_hooks
from multihead.kernels import AttentionCall, attend, cpu
from multihead.masks import MaskSpec

NAME = "multihead"

# keywords transformers may pass that do not change what attention computes
IGNORED = frozenset({
    "position_ids", "cache_position", "use_cache", "output_hidden_states", "return_dict", "num_items_in_batch",
    "output_router_logits", "layer_idx", "token_type_ids", "seq_idx", "past_key_values", "cache", "query_length",
    "encoder_hidden_states",
})  # a head_mask does change the result: it is refused like any other unknown keyword

_registered = False


def register() -> None:
    """Register ``"multihead"`` with transformers' AttentionInterface and AttentionMaskInterface (once)."""
    global _registered
    if _registered:
        return
    require("transformers", "hf")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # boolean, True = may attend
    _registered = True


def _mask(attention_mask: Tensor | None, position_bias: Tensor | None, b: int, h: int, s: int, t: int,
          causal: bool) -> MaskSpec:
    keep = bias = None
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or attention_mask.ndim != 4:
            raise MultiheadError(f"transformers passed an attention_mask of {type(attention_mask).__name__} "
                                 f"{tuple(getattr(attention_mask, 'shape', ()))}: expected (b, 1|h, s, t)")
        mask = attention_mask[..., :t]  # a static cache's mask can be longer than the keys it hands over
        if mask.dtype == torch.bool:
            keep = mask
        elif mask.is_floating_point():
            bias = mask
        else:
            raise MultiheadError(f"transformers passed an attention_mask of dtype {mask.dtype}: expected bool or a "
                                 "float mask added to the scores")
    if position_bias is not None:
        pb = position_bias[..., :t]
        bias = pb if bias is None else bias + pb
    return MaskSpec(batch=b, n_heads=h, s=s, t=t, causal=causal, keep=keep, bias=bias)


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      softcap: float | None = None, sliding_window: int | None = None, s_aux: Tensor | None = None,
                      position_bias: Tensor | None = None, output_attentions: bool = False, **kwargs: Any
                      ) -> tuple[Tensor, Tensor | None]:
    """The function transformers calls: query (b, h, s, d), key and value (b, g, t, d) -> ((b, s, h, dv), weights)."""
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED and v is not None)
    if unknown:
        raise MultiheadError(f"{type(module).__name__} passed {', '.join(map(repr, unknown))} to the attention "
                             f"function, which multihead does not support: use attn_implementation='sdpa' or 'eager' "
                             "for this call")
    found = getattr(key, CARRIED, None)
    if found is not None:  # a multihead cache's view (multihead.hfcache): its own masks, its own keys
        return _over_cache_view(module, query, found, attention_mask, dropout, scaling, softcap, s_aux,
                                position_bias, output_attentions)
    b, h, s, d = query.shape
    g, t = key.shape[1], key.shape[2]
    if h % g != 0:
        raise MultiheadError(f"{type(module).__name__}: {h} query heads do not divide into {g} KV heads")
    causal = False
    if attention_mask is None:
        wants = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(wants) and s > 1
        if causal and t > s:  # a prefill into an empty static cache: its first s slots, as transformers' SDPA path
            key, value, t = key[:, :, :s], value[:, :, :s], s
            position_bias = None if position_bias is None else position_bias[..., :s]
    spec = _mask(attention_mask, position_bias, b, h, s, t, causal)
    hooked = call_hooks(module) if isinstance(getattr(module, "hook_z", None), HookPoint) else None  # type: ignore[arg-type]
    call = AttentionCall(query, DenseKV(key, value), spec, scale=d**-0.5 if scaling is None else float(scaling),
                         dropout_p=float(dropout), backend=getattr(module, "multihead_backend", "auto"),
                         need_weights=bool(output_attentions), softcap=softcap, sinks=s_aux, hooks=hooked)
    z, weights = attend(call)  # (b, h, s, dv)
    return z.transpose(1, 2).contiguous(), weights


CARRIED = "multihead_view"  # the attribute a multihead cache's update sets on the keys it hands over (hfcache.VIEW)


def check_no_padding(attention_mask: Tensor | None, positions: Tensor, window: int | None) -> None:
    """transformers' mask for a multihead cache's step, where it made one (a bool (b, 1, s, t) over positions 0 ..
    t - 1), must let every query see every earlier key of its window: a padded batch does not (these caches hold
    one length, and their own masks would attend to the padding)."""
    if not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.bool or attention_mask.ndim != 4:
        return
    t = attention_mask.shape[-1]
    j = torch.arange(t, device=attention_mask.device)
    q = positions.to(attention_mask.device)[:, None, :, None]  # (b, 1, s, 1)
    want = j <= q if window is None else (j <= q) & (j > q - window)  # (b, 1, s, t)
    if not bool((attention_mask | ~want).all()):
        raise MultiheadError("transformers passed a mask that hides earlier tokens (padding) for a multihead cache: "
                             "its sequences hold one length; decode prompts of other lengths one at a time")


def _over_cache_view(module: nn.Module, query: Tensor, found: Any, attention_mask: Tensor | None, dropout: float,
                     scaling: float | None, softcap: float | None, s_aux: Tensor | None, position_bias: Tensor | None,
                     output_attentions: bool) -> tuple[Tensor, Tensor | None]:
    """attention_forward over a multihead cache's view (:mod:`multihead.hfcache`): the step's mask (a head-wise
    cache's view carries one per group of KV heads), transformers' mask only checked to have no padding."""
    if position_bias is not None:
        raise MultiheadError(f"{type(module).__name__} passed a position_bias: a multihead cache takes causal decoders")
    if found.positions is not None:  # the step's first layer of its kind: transformers' mask, checked once
        check_no_padding(attention_mask, found.positions, found.window)
    step = found.step
    d = query.shape[-1]
    hooked = call_hooks(module) if isinstance(getattr(module, "hook_z", None), HookPoint) else None  # type: ignore[arg-type]
    call = AttentionCall(query, found.view, step.mask, scale=d**-0.5 if scaling is None else float(scaling),
                         dropout_p=float(dropout), backend=getattr(module, "multihead_backend", "auto"),
                         need_weights=bool(output_attentions), softcap=softcap, sinks=s_aux, hooks=hooked)
    z, weights = attend(call)  # (b, h, s, dv)
    return z.transpose(1, 2).contiguous(), weights


def new_cache(model: nn.Module, max_len: int | None = None, **kinds: Any) -> Any:
    """A multihead cache for a transformers model that runs multihead's attention (:func:`enable`), to pass as
    ``model.generate(..., past_key_values=cache)`` or ``model(..., past_key_values=cache)``: every key
    (``max_len``), ``window=`` with ``sink_tokens=``, ``bits=`` (``group=``, ``residual=``), or ``plan=`` (a
    :class:`~multihead.cache.HeadPlan`: each KV head full or sinks + window, the streaming heads' other keys never
    stored); ``batch=`` sequences of one length. Its ``bytes`` are the real tensors'. See
    :mod:`multihead.hfcache`."""
    require("transformers", "hf")
    from multihead.hfcache import new_cache as make

    return make(model, max_len, **kinds)


def _calls_attention_interface(cls: Any) -> bool:
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of ``model`` whose forward calls transformers' attention interface, by name."""
    seen: dict[Any, bool] = {}
    found = {}
    for name, module in model.named_modules():
        cls = type(module)
        if cls not in seen:
            seen[cls] = _calls_attention_interface(cls)
        if seen[cls]:
            found[name] = module
    return found


def _out_hook(module: nn.Module, _args: Any, output: Any) -> Any:
    point: HookPoint = module.hook_out  # type: ignore[assignment]
    if not point.active:
        return output
    if isinstance(output, tuple):
        return (point(output[0]), *output[1:])
    return point(output)


@dataclass(frozen=True)
class BlockLayout:
    """How a family's decoder layer names its parts: the attention and the MLP, the norm each reads the stream
    through, and the modules whose outputs are what each sublayer adds to the stream (``attn_write``,
    ``mlp_write``): the attention's and the MLP's own outputs in Llama's layout, Gemma 2/3's post-attention and
    post-feed-forward norms (``h = h + post_attention_layernorm(self_attn(input_layernorm(h)))``, then
    ``h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``). ``norm_offset``: 1 where the
    family's RMSNorms scale by (1 + weight) (Gemma), 0 where by weight."""

    attention: str = "self_attn"
    mlp: str = "mlp"
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    attn_write: str = "self_attn"
    mlp_write: str = "mlp"
    norm_offset: float = 0.0


_LLAMA = BlockLayout()
_GEMMA = BlockLayout(norm_offset=1.0)
_GEMMA2 = BlockLayout(mlp_norm="pre_feedforward_layernorm", attn_write="post_attention_layernorm",
                      mlp_write="post_feedforward_layernorm", norm_offset=1.0)

# the families whose decoder layers get the residual-stream points: each a pre-norm layer adding two sublayers'
# writes to the stream (residual = h; h = residual + write(attention); residual = h; h = residual + write(MLP)),
# with the layout that names them. GPT-2's blocks are the same under other names (attn, mlp, ln_1, ln_2: LayerNorms
# with a bias); Phi-3 fuses q/k/v and gate/up but lays its layer out as Llama; gpt-oss's MLP (experts) returns
# (output, router scores)
LAYOUTS: dict[str, BlockLayout] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA, "smollm3": _LLAMA, "olmo": _LLAMA,
    "phi3": _LLAMA, "gpt_oss": _LLAMA, "gemma": _GEMMA, "gemma2": _GEMMA2, "gemma3_text": _GEMMA2,
    "gpt2": BlockLayout("attn", "mlp", "ln_1", "ln_2", "attn", "mlp"),
}
RESID_FAMILIES = tuple(LAYOUTS)


def model_type(model: nn.Module) -> str | None:
    """The model_type of a transformers model's text config (a multimodal config's text model: Gemma 3's
    ``gemma3_text``), None for a module without a config."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = getattr(text, "model_type", None)
    return None if found is None else str(found)


def block_layout(model: nn.Module) -> BlockLayout:
    """The :class:`BlockLayout` of ``model``'s family (Llama's for a family not in :data:`LAYOUTS`)."""
    return LAYOUTS.get(model_type(model) or "", _LLAMA)


def block_parts(model: nn.Module) -> tuple[str, str, str, str]:
    """The names of (attention, MLP, attention's norm, MLP's norm) in a decoder layer of ``model``'s family:
    ``("attn", "mlp", "ln_1", "ln_2")`` for GPT-2, Gemma 2/3's ``pre_feedforward_layernorm`` for the MLP's norm,
    Llama's ``self_attn`` .. ``post_attention_layernorm`` otherwise."""
    layout = block_layout(model)
    return layout.attention, layout.mlp, layout.attn_norm, layout.mlp_norm


def decoder_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder layers of a transformers model of the :data:`RESID_FAMILIES` (modules holding every part its
    :class:`BlockLayout` names), by name; empty for other families."""
    if model_type(model) not in LAYOUTS:
        return {}
    layout = block_layout(model)
    parts = {layout.attention, layout.mlp, layout.attn_norm, layout.mlp_norm, layout.attn_write, layout.mlp_write}
    return {name: m for name, m in model.named_modules()
            if all(isinstance(getattr(m, p, None), nn.Module) for p in parts)}


def _add_resid_points(layer: nn.Module, attention: str = "self_attn", mlp: str = "mlp") -> None:
    """The five residual-stream points on one pre-norm decoder layer (``attention`` and ``mlp`` name the modules
    whose outputs the layer adds to the stream: the sublayers themselves, or Gemma 2/3's post-norms), by module
    hooks (transformers' forward is not edited): resid_pre on the layer's input, attn_out on the attention's write,
    resid_mid as resid_pre + attn_out
    (a replacement R is handed on as attn_out = R - resid_pre, so what the layer adds is R up to one rounding),
    mlp_out on the MLP's output, resid_post on the layer's output. Points with no hook cost one list test each."""
    pre, attn_out, mid, mlp_out, post = add_resid_points(layer)
    stash: dict[str, Tensor] = {}

    def on_input(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not (pre.active or mid.active):
            return None
        h = args[0] if args else kwargs["hidden_states"]
        if pre.active:
            h = pre(h)
        if mid.active:
            stash["pre"] = h
        if not pre.active:
            return None
        return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

    def on_attention(_m: nn.Module, _args: Any, output: Any) -> Any:
        if not (attn_out.active or mid.active):
            return None
        a = output[0] if isinstance(output, tuple) else output
        if attn_out.active:
            a = attn_out(a)
        if mid.active:
            before = stash.pop("pre", None)
            if before is None:
                raise MultiheadError(f"{mid.name or 'hook_resid_mid'}: the layer's input was not seen (a hook was "
                                     "attached during the layer's forward)")
            r = before + a
            replaced = mid(r)
            if replaced is not r:
                a = replaced - before
        return (a, *output[1:]) if isinstance(output, tuple) else a

    def on_mlp(_m: nn.Module, _args: Any, output: Any) -> Any:
        if not mlp_out.active:
            return None
        return (mlp_out(output[0]), *output[1:]) if isinstance(output, tuple) else mlp_out(output)  # gpt-oss: a pair

    def on_output(_m: nn.Module, _args: Any, output: Any) -> Any:
        if not post.active:
            return None
        return (post(output[0]), *output[1:]) if isinstance(output, tuple) else post(output)

    layer.register_forward_pre_hook(on_input, with_kwargs=True)
    layer.get_submodule(attention).register_forward_hook(on_attention)
    layer.get_submodule(mlp).register_forward_hook(on_mlp)
    layer.register_forward_hook(on_output)


def enable(model: nn.Module, *, backend: str = "auto") -> nn.Module:
    """Switch a transformers model to multihead's attention (in place) and give each attention module the hook points
    ``hook_q`` .. ``hook_out`` (``hook_out`` is the module's own output), and each decoder layer of the
    :data:`RESID_FAMILIES` (Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo, Phi-3, gpt-oss, Gemma 1/2/3, GPT-2) the
    residual-stream points
    ``hook_resid_pre`` .. ``hook_resid_post`` (``model.layers.3.hook_resid_post``; :mod:`multihead.hooks`).
    Returns the model."""
    register()
    if not (hasattr(model, "set_attn_implementation") and hasattr(model, "_can_set_attn_implementation")):
        raise MultiheadError(f"{type(model).__name__} is not a transformers model (no set_attn_implementation)")
    hf_model: Any = model  # a PreTrainedModel (transformers is not a dependency of the type checks)
    if not hf_model._can_set_attn_implementation():
        raise MultiheadError(
            f"{type(model).__name__} does not call transformers' attention interface (its attention is written inline, "
            "as in Falcon, BLOOM and MPT), so no attention implementation can be plugged in: unsupported"
        )
    hf_model.set_attn_implementation(NAME)
    modules = attention_modules(model)
    if not modules:
        raise MultiheadError(f"{type(model).__name__} has no module that calls the attention interface")
    for module in modules.values():
        if not isinstance(getattr(module, "hook_z", None), HookPoint):
            add_hook_points(module)
            module.register_forward_hook(_out_hook)
        module.multihead_backend = backend  # type: ignore[assignment]
    layout = block_layout(model)
    for layer in decoder_layers(model).values():
        if "_resid_points" not in layer.__dict__:
            _add_resid_points(layer, layout.attn_write, layout.mlp_write)
    if "_multihead_step_threads" not in model.__dict__:  # each forward is a step: its threads follow the load
        model.register_forward_pre_hook(_enter_step)
        model.register_forward_hook(_leave_step, always_call=True)
        model.__dict__["_multihead_step_threads"] = True
    return model


_steps = threading.local()  # the step_threads contexts of the forwards running in this thread


def _enter_step(_module: nn.Module, _args: Any) -> None:
    """Before a switched model's forward: its step runs with the threads :func:`multihead.kernels.cpu.step_threads`
    gives (fewer than configured only when following the load, :func:`multihead.kernels.cpu.follow_load`, on a busy
    machine), as a step of multihead's own models does."""
    entered: list[AbstractContextManager[int]] = _steps.__dict__.setdefault("entered", [])
    context = cpu.step_threads()
    context.__enter__()
    entered.append(context)


def _leave_step(_module: nn.Module, _args: Any, _output: Any) -> None:
    """After the forward, or after it raised: the thread count given back."""
    entered: list[AbstractContextManager[int]] = _steps.__dict__.get("entered", [])
    if entered:
        entered.pop().__exit__(None, None, None)


def load(path: str | Path, *, dtype: torch.dtype = torch.float32, task: str | None = None,
         backend: str = "auto") -> nn.Module:
    """A transformers model from a local folder (config.json and safetensors) or a .gguf file, already switched to
    multihead's attention. ``task`` picks the head: "causal-lm" (default for decoders), "masked-lm", "base"
    (AutoModel, default for encoders) or "seq2seq-lm"."""
    require("transformers", "hf")
    import transformers

    p = Path(path)
    if not p.exists():
        raise MultiheadError(f"model path {str(p)!r} does not exist: give a model folder or a .gguf file")
    kwargs: dict[str, Any] = {"dtype": dtype}
    if p.is_file():
        if p.suffix != ".gguf":
            raise MultiheadError(f"{str(p)!r} is a file but not a .gguf: give a model folder or a .gguf file")
        folder, kwargs["gguf_file"] = p.parent, p.name
        config_model_type = None
    else:
        folder = p
        config_file = p / "config.json"
        if not config_file.is_file():
            raise MultiheadError(f"model folder {str(p)!r} has no config.json")
        if not (list(p.glob("*.safetensors")) or list(p.glob("*.bin"))):
            raise MultiheadError(f"model folder {str(p)!r} has no weights (*.safetensors)")
        from multihead.models.loaders import read_json

        config_model_type = read_json(config_file).get("model_type")
    auto = _auto_class(transformers, task, config_model_type)
    try:
        model = auto.from_pretrained(str(folder), **kwargs)
    except Exception as err:  # any failure of transformers' readers on a user's file is one clear error naming it
        raise MultiheadError(f"transformers could not load {str(p)!r}: {type(err).__name__}: {err}") from None
    return enable(model.eval(), backend=backend)


_ENCODERS = {"bert", "roberta", "modernbert", "distilbert", "electra", "xlm-roberta", "mpnet"}
_SEQ2SEQ = {"t5", "bart", "mt5", "mbart", "pegasus", "marian"}


def _auto_class(transformers: Any, task: str | None, model_type: str | None) -> Any:
    tasks: dict[str, Callable[..., Any]] = {
        "causal-lm": transformers.AutoModelForCausalLM, "masked-lm": transformers.AutoModelForMaskedLM,
        "base": transformers.AutoModel, "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
    }
    if task is None:
        task = "base" if model_type in _ENCODERS else "seq2seq-lm" if model_type in _SEQ2SEQ else "causal-lm"
    if task not in tasks:
        raise MultiheadError(f"task {task!r} is unknown: choose one of {', '.join(tasks)}")
    return tasks[task]


# ---------------------------------------------------------------------------------------------- MLA layers
def _rope_rows(n_rows_before: int, rope: int, interleaved: bool) -> Tensor:
    """Row order that turns DeepSeek's interleaved RoPE pairs (x0, x1), (x2, x3) .. into the half layout
    (x0, x2, .., x1, x3, ..) our rotation uses; q and k get the same order, so q . k is unchanged."""
    order = torch.arange(rope)
    if interleaved:
        order = torch.cat([order[0::2], order[1::2]])
    return n_rows_before + order


def mla_from_transformers(module: Any) -> Any:
    """Our :class:`~multihead.latent.MultiHeadLatentAttention` with the weights of a transformers DeepSeek-V2/V3
    attention module (their interleaved RoPE dims reordered to our half layout; same function)."""
    from multihead.config import MLAConfig
    from multihead.latent import MultiHeadLatentAttention

    cfg = module.config
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise MultiheadError(f"rope_type {params.get('rope_type')!r} (YaRN scaling) is not supported by our MLA layer")
    config = MLAConfig(d_model=cfg.hidden_size, n_heads=cfg.num_attention_heads, kv_lora_rank=cfg.kv_lora_rank,
                       qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                       v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
                       rope=float(params.get("rope_theta", 10000.0)), norm_eps=float(cfg.rms_norm_eps),
                       bias=bool(getattr(cfg, "attention_bias", False)), scale=float(module.scaling))
    ref = module.o_proj.weight
    layer = MultiHeadLatentAttention(config, device=ref.device, dtype=ref.dtype)
    interleaved = getattr(cfg, "rope_interleave", None) is not False  # V3: True by default; V2: complex pairs
    h, qk, nope, r, rope = config.n_heads, config.qk_head_dim, config.qk_nope_head_dim, config.kv_lora_rank, \
        config.qk_rope_head_dim
    q_rows = torch.cat([torch.cat([torch.arange(i * qk, i * qk + nope), _rope_rows(i * qk + nope, rope, interleaved)])
                        for i in range(h)])
    kv_a_rows = torch.cat([torch.arange(r), _rope_rows(r, rope, interleaved)])
    with torch.no_grad():
        if config.q_lora_rank is None:
            assert layer.q_proj is not None
            layer.q_proj.weight.copy_(module.q_proj.weight[q_rows])
        else:
            assert layer.q_a_proj is not None and layer.q_a_norm is not None and layer.q_b_proj is not None
            layer.q_a_proj.load_state_dict(module.q_a_proj.state_dict())
            layer.q_a_norm.weight.copy_(module.q_a_layernorm.weight)
            layer.q_b_proj.weight.copy_(module.q_b_proj.weight[q_rows])
        layer.kv_a_proj.weight.copy_(module.kv_a_proj_with_mqa.weight[kv_a_rows])
        if module.kv_a_proj_with_mqa.bias is not None:
            layer.kv_a_proj.bias.copy_(module.kv_a_proj_with_mqa.bias[kv_a_rows])
        layer.kv_a_norm.weight.copy_(module.kv_a_layernorm.weight)
        layer.kv_b_proj.weight.copy_(module.kv_b_proj.weight)
        layer.o_proj.load_state_dict(module.o_proj.state_dict())
    eps = float(getattr(module.kv_a_layernorm, "variance_epsilon", cfg.rms_norm_eps))
    layer.kv_a_norm.eps = eps
    if layer.q_a_norm is not None:
        layer.q_a_norm.eps = eps
    return layer.train(module.training)


class MLAInTransformers(nn.Module):
    """Our MLA layer standing in a transformers DeepSeek decoder layer's ``self_attn``: it reads transformers'
    hidden states and position ids and keeps its own :class:`~multihead.cache.LatentCache` (one sequence length
    for the batch, from position 0), so ``generate`` decodes over latents on the absorbed path."""

    def __init__(self, layer: Any, max_len: int, path: str = "auto") -> None:
        super().__init__()
        self.layer = layer
        self.max_len = max_len
        self.path = path
        self.cache: Any = None

    def forward(self, hidden_states: Tensor, position_embeddings: Any = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, cache: Any = None, use_cache: bool | None = None,
                **kwargs: Any) -> tuple[Tensor, None]:
        b, s = hidden_states.shape[:2]
        positions = position_ids if position_ids is not None else torch.arange(s, device=hidden_states.device)[None]
        if attention_mask is not None and attention_mask.ndim == 2 and not bool(attention_mask.all()):
            raise MultiheadError("our MLA layer in a transformers model takes unpadded sequences of one length")
        if cache is None and not use_cache:
            return self.layer(hidden_states, causal=True, positions=positions.expand(b, s), path=self.path), None
        if int(positions[0, 0]) == 0 or self.cache is None or self.cache.batch != b:
            self.cache = self._latents(b, s, hidden_states)
        elif self.cache.used + s > self.cache.max_len:  # grow by doubling, up to the model's context
            old = self.cache
            self.cache = self._latents(b, old.used + s, hidden_states)
            self.cache.latent[:, :, :old.used].copy_(old.latent[:, :, :old.used])
            self.cache.advance(old.used)
        out = self.layer(hidden_states, causal=True, positions=positions.expand(b, s), cache=self.cache.layer(0),
                         path=self.path)
        self.cache.advance(s)
        return out, None

    def _latents(self, b: int, need: int, like: Tensor) -> Any:
        """A latent cache for ``need`` tokens or more (room doubles as a generation grows)."""
        from multihead.cache import LatentCache

        c = self.layer.config
        size = min(self.max_len, max(256, 1 << max(0, need - 1).bit_length()))
        if need > size:
            raise MultiheadError(f"{need} tokens exceed the model's context of {self.max_len}")
        return LatentCache(batch=b, kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim, max_len=size,
                           dtype=like.dtype, device=like.device)


def use_mla_layers(model: nn.Module, *, path: str = "auto") -> nn.Module:
    """Put our MLA layer in place of every DeepSeek attention module of a transformers model (in place)."""
    replaced = 0
    for module in list(model.modules()):
        attn: Any = getattr(module, "self_attn", None)
        if attn is not None and hasattr(attn, "kv_a_proj_with_mqa"):
            max_len = int(getattr(attn.config, "max_position_embeddings", 4096))
            module.self_attn = MLAInTransformers(mla_from_transformers(attn), max_len, path)
            replaced += 1
    if not replaced:
        raise MultiheadError(f"{type(model).__name__} has no DeepSeek MLA attention modules (kv_a_proj_with_mqa)")
    return model
