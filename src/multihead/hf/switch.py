"""Switching a transformers model to multihead's attention (:func:`enable`): the registered implementation, the
six hook points on every attention module, the residual-stream points on the decoder layers of the families whose
block layout is known (:data:`LAYOUTS`), and each forward made one step of the CPU's thread decisions."""

from __future__ import annotations

import inspect
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from multihead.errors import MultiheadError
from multihead.hf.attention import NAME, register
from multihead.kernels import cpu
from multihead.layers.hooks import HookPoint, add_hook_points, add_resid_points


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


def enable(model: nn.Module, *, backend: str = "auto", products: bool = True) -> nn.Module:
    """Switch a transformers model to multihead's attention (in place) and give each attention module the hook points
    ``hook_q`` .. ``hook_out`` (``hook_out`` is the module's own output), and each decoder layer of the
    :data:`RESID_FAMILIES` (Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo, Phi-3, gpt-oss, Gemma 1/2/3, GPT-2) the
    residual-stream points
    ``hook_resid_pre`` .. ``hook_resid_post`` (``model.layers.3.hook_resid_post``; :mod:`multihead.layers.hooks`).

    ``products`` (default True): the model's ``torch.nn.Linear`` modules compute as
    :class:`multihead.layers.linear.Linear`, the class our own models use (:func:`switch_products`); False gives them
    back. Calling ``enable`` again changes either setting. Returns the model."""
    if not isinstance(products, bool):
        raise MultiheadError(f"products={products!r}: give True (multihead's Linear for the model's nn.Linear) or "
                             "False (transformers' own)")
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
    switch_products(model, products)
    if "_multihead_step_threads" not in model.__dict__:  # each forward is a step: its threads follow the load
        model.register_forward_pre_hook(_enter_step, with_kwargs=True)
        model.register_forward_hook(_leave_step, always_call=True)
        model.__dict__["_multihead_step_threads"] = True
    return model


def switch_products(model: nn.Module, on: bool) -> int:
    """Make each ``torch.nn.Linear`` of ``model`` (the class itself, not a subclass: a quantized or adapted linear
    keeps its own) a :class:`multihead.layers.linear.Linear` (``on``), or each of those a ``torch.nn.Linear`` again;
    returns how many modules changed.

    The module keeps its parameters, state_dict, hooks and ``isinstance(m, nn.Linear)``; only its forward changes:
    the few-row products of a decode step on the CPU run the kind of product
    :func:`multihead.kernels.cpu.product_kind` picks for the shape (for one bfloat16 row, the native kernel that
    reads the weight at the memory's speed), a bfloat16 prefill's products run in float32 on a CPU without bfloat16
    instructions (:func:`multihead.layers.linear.upcast`), and everything else (a GPU, autograd, other dtypes)
    is ``F.linear``. The kinds agree with ``F.linear`` to the dtype's rounding (the same sums in another order), and
    a shape runs one kind throughout a process."""
    from multihead.layers.linear import Linear

    before, after = (nn.Linear, Linear) if on else (Linear, nn.Linear)
    model.__dict__["_multihead_products"] = on  # read by each step (_enter_step)
    changed = 0
    for module in model.modules():
        if type(module) is before:
            module.__class__ = after
            changed += 1
    return changed


_steps = threading.local()  # the step_threads contexts of the forwards running in this thread


def _enter_step(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before a switched model's forward: its step runs with the threads :func:`multihead.kernels.cpu.step_threads`
    gives (fewer than configured only when following the load, :func:`multihead.kernels.cpu.follow_load`, on a busy
    machine), as a step of multihead's own models does. A float32 model that kept transformers' own products
    (``enable(products=False)``) keeps the configured threads in a step of more than one token: MKL sums those
    products by its thread count (one row a product, a decode step, gave the same bits in one thread and two)."""
    entered: list[AbstractContextManager[int]] = _steps.__dict__.setdefault("entered", [])
    follow = module.__dict__.get("_multihead_products", False)
    if not follow:
        weight = next(module.parameters(), None)
        follow = weight is None or weight.dtype not in cpu.KEEPS_THREADS or _tokens(args, kwargs) == 1
    context = cpu.step_threads(follow)
    context.__enter__()
    entered.append(context)


def _tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The tokens of a forward's batch (batch x positions), from its input_ids or inputs_embeds; None if neither."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, Tensor):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    return embeds.shape[:-1].numel() if isinstance(embeds, Tensor) else None


def _leave_step(_module: nn.Module, _args: Any, _output: Any) -> None:
    """After the forward, or after it raised: the thread count given back."""
    entered: list[AbstractContextManager[int]] = _steps.__dict__.get("entered", [])
    if entered:
        entered.pop().__exit__(None, None, None)
