"""The attention core, ``softmax(q k^T * scale + mask) v``, and the one dispatcher that decides how to compute it.

Shapes follow the package legend: q (b, h, s, d); keys and values (b, g, t, d) with g = n_kv_heads dividing h.
Keys and values stay g heads wide: query head i reads KV head i // (h / g). No kernel repeats K/V in memory.

A call (:class:`AttentionCall`) is q, a view of the keys and values as the cache holds them
(:mod:`multihead.cache.view`: dense rows, low-bit codes with a full-precision tail, or a head-wise layer's groups),
the mask and the options. :func:`attend` computes it and :func:`explain` says how, from the same decision
(:func:`resolve_backend`): this module alone picks what runs.

Kernels:

- ``"sdpa"``: PyTorch's fused ``scaled_dot_product_attention`` with GQA passed natively (``enable_gqa``); it picks
  flash / memory-efficient / cuDNN / math kernels underneath. The default.
- ``"math"``: the readable path written with matmul and softmax; it returns the per-head weights (b, h, s, t).
- ``"flex"``: PyTorch's flex attention with a block mask made from the mask's structure (causal with s != t,
  sliding windows, key padding, packed documents, a cache's positions): masked blocks are skipped and no dense mask
  is made (:mod:`multihead.kernels.flex`). Compiled on first use for each shape.
- ``"native"``: a CPU decode step in :mod:`multihead.kernels.native`'s kernels: over dense keys each KV head read
  once for its query heads (``attend_dense``), or over a 4- or 8-bit store's codes as they are, never dequantised
  (``attend_q4`` / ``attend_q8``). Taken by ``"auto"`` where every key is visible and nothing needs the keys as
  tensors (no weights, no k, v or pattern hook, no gradient, no dropout).

``backend="auto"`` (the default) is chosen per call from the inputs: ``"math"`` when weights are requested (only it
materialises them); ``"flex"`` on a GPU when the mask has structure that SDPA could only take as a dense tensor
(long enough for blocks to be skipped, no dropout); ``"native"`` for the CPU decode steps above where
:mod:`multihead.kernels.cpu` says so (a rule, or the host's tuning table: never the clock); ``"sdpa"`` otherwise. On
the CPU ``"auto"`` keeps SDPA for a structured mask, whose CPU flash kernel takes the mask without materialising scores,
because flex attention must be compiled for each new shape there. A quantized view that no native kernel takes is
read back dense first (:mod:`multihead.quant`), then dispatched as dense keys. A head-wise layer's groups attend
one call each, with their query heads and their own mask, and z goes back in head order.

MLA's absorbed decode step (its query heads folded into the rows of one latent head) runs ``"math"``.

The room, a module a concern: this module is the dispatcher (the backend policy, :func:`prepare`, :func:`attend`,
:func:`explain`); ``call`` the records a call and a decision are; ``sdpa``, ``matmul`` (the math path), ``flex`` and
``native/`` the backends; ``views`` a quantized view read back and a head-wise view's groups; ``latent`` MLA's
paths; ``cpu`` the CPU decisions as data and ``tuning`` the step that measures them into the host's table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from multihead.cache.view import DenseKV, GroupedKV, LatentKV, QuantizedKV
from multihead.errors import MultiheadError
from multihead.kernels import codec, cpu, flex, native
from multihead.kernels.call import (
    BACKENDS,
    AttentionCall,
    CallHooks,
    Dispatch,
    KernelChoice,
    TensorFn,
    check_backend,
)
from multihead.kernels.latent import LATENT_PATHS, LatentCore, latent_call, mla_path
from multihead.kernels.matmul import attention_weights, math_attention, weighted_sum, weighted_values
from multihead.kernels.sdpa import QUERY_BLOCK, causal_blocks, key_blocks, sdpa_attention, splits
from multihead.kernels.views import dense_view, group_calls
from multihead.layers.masks import MaskSpec

__all__ = ["BACKENDS", "LATENT_PATHS", "AttentionCall", "CallHooks", "DenseKV", "Dispatch", "KernelChoice",
           "LatentCore", "TensorFn", "attend", "attention_weights", "check_backend", "codec", "cpu", "dense_view",
           "explain", "flex", "group_calls", "latent_call", "math_attention", "mla_path", "native", "prepare",
           "resolve_backend", "sdpa_attention", "structure", "weighted_sum", "weighted_values"]


def structure(spec: MaskSpec) -> str | None:
    """What in the mask a block-sparse kernel can use and SDPA cannot take as a flag, or None."""
    if spec.is_empty or spec.is_plain_causal:
        return None
    parts = []
    if spec.causal:
        if spec.window is not None:
            parts.append(f"sliding window {spec.window}")
        if spec.q_positions is not None:
            parts.append("causal by cache positions")
        elif spec.s != spec.t:
            parts.append("causal with s != t")
    if spec.documents is not None:
        parts.append("packed documents")
    if spec.keep is not None and spec.keep.ndim == 4 and spec.keep.shape[1:3] == (1, 1):
        parts.append("key padding")
    if (spec.keep is not None and spec.keep.shape[-2] != 1) or spec.bias is not None:
        return None  # a dense (s, t) mask of the user's: it is one tensor for every kernel
    return ", ".join(parts) if parts else None


PATTERN_BESIDE = ("; the pattern (b, h, s, t) is made from the same q, k and mask for the pattern hook, and a hook "
                  "that returns a replacement makes this call's output pattern @ v (the math path)")


NATIVE_CODES = ("a decode step over the codes as they are stored (multihead.kernels.native.attend_q4 / attend_q8: "
                "read once inside the attention, never dequantised; every key visible, or the keys the step hides "
                "masked in the kernel; nothing hooked at the core)")

NATIVE_DECODE = ("this CPU decode step runs in multihead.kernels.native.attend_dense (each KV head read once for "
                 "its query heads, every key visible, or the keys the step hides masked in the kernel; {why})")


def resolve_backend(call: AttentionCall, *, device: torch.device | None = None) -> Dispatch:
    """The one backend policy: what runs for ``call`` (on ``device``, default q's: a what-if for another device).

    Every rule of which kernel runs is here: what the view holds (dense keys, codes that a native kernel reads as
    they are or that are read back first), what the inputs require or forbid (weights, sink logits, softcap,
    dropout, gradients, an explicit backend), what is fastest for them ('auto': the mask's structure, the device,
    MLA's folded decode), what the hooks need (a hooked pattern beside a fused kernel) and the CPU decisions it
    looks up in :mod:`multihead.kernels.cpu` (rules and the host's tuning table, never a timing). :func:`attend` runs
    the decision and :func:`explain` describes it. A head-wise view is decided group by group (:func:`group_calls`).
    """
    device = call.q.device if device is None else device
    kv = call.kv
    if isinstance(kv, GroupedKV):
        raise MultiheadError("a head-wise view is decided group by group: multihead.kernels.group_calls(call)")
    if isinstance(kv, LatentKV):
        raise MultiheadError("a latent view is decided on the path it takes: multihead.kernels.latent_call(call)")
    key = _dispatch_key(call, device)
    if key is None:
        return _resolve(call, device)
    found: Dispatch | None = call.mask.memo.get(key)
    if found is None:
        found = call.mask.memo[key] = _resolve(call, device)
    return found


def _dispatch_key(call: AttentionCall, device: torch.device) -> tuple[Any, ...] | None:
    """Everything of a call the decision reads beside its mask, as the key it is kept under in the mask's memo: the
    layers of one step share the step's mask and mostly ask with the same shapes, so the decision is made once a
    step for each form of call (a decode step of SmolLM2 asks 30 times). None (not kept) for a call with hooks or
    sink logits, under torch.compile, or in a mode watching the calls."""
    if call.hooks is not None or call.sinks is not None or torch.compiler.is_compiling() or cpu.in_a_mode():
        return None
    q, kv = call.q, call.kv
    view: tuple[Any, ...]
    if isinstance(kv, DenseKV):
        k, v = kv.keys, kv.values
        view = (k.shape, k.stride(), k.dtype, k.device, k.requires_grad, v.shape, v.stride(), v.dtype, v.device,
                v.requires_grad)
    elif isinstance(kv, QuantizedKV):
        view = (kv.bits, kv.group, kv.n, kv.tail_k.shape, kv.tail_k.requires_grad, kv.tail_v.requires_grad)
    else:
        return None
    return ("dispatch", device, q.shape, q.dtype, q.device, q.requires_grad, torch.is_grad_enabled(), view,
            call.dropout_p, call.backend, call.need_weights, call.softcap, call.rows_are_heads, cpu.enabled())


def _resolve(call: AttentionCall, device: torch.device) -> Dispatch:
    """:func:`resolve_backend`'s decision, made."""
    kv = call.kv
    if isinstance(kv, QuantizedKV):
        why_not = _native_quantized_refused(call, kv, device)
        if why_not is None:
            return Dispatch("native", NATIVE_CODES, native="quantized")
        return Dispatch("dequantize", f"the {kv.bits}-bit codes are read back into keys and values first "
                        f"({why_not})", dequantize=True)
    backend, reason = _backend(call, device)
    fold = backend == "sdpa" and _folds(call, device)
    native_kind: str | None = None
    if backend == "sdpa" and device.type == "cpu":
        why = _native_dense(call)
        if why is not None:
            backend, reason, fold, native_kind = "native", NATIVE_DECODE.format(why=why), False, "dense"
    plain = (backend == "sdpa" and device.type == "cpu" and cpu.enabled() and not cpu.in_a_mode() and not fold
             and call.dropout_p == 0.0 and not call.needs_grad)  # off with the CPU speed paths, and in a mode
    split = plain and splits(call.mask, call.q, call.k, call.v)
    blocks = plain and not split and key_blocks(call.mask, device, call.q.dtype) is not None
    beside = call.hooks is not None and call.hooks.pattern is not None and backend != "math"
    return Dispatch(backend, reason + PATTERN_BESIDE if beside else reason, fold, beside, False, native_kind, blocks,
                    split)


def _native_quantized_refused(call: AttentionCall, kv: QuantizedKV, device: torch.device) -> str | None:
    """None where a native kernel attends over the call's codes as they are; else why not. What is the same for
    every layer of a step (the mask, the kernels being there, no mode watching) is asked once a step (the mask's
    memo)."""
    spec = call.mask
    if kv.bits not in (4, 8):
        return f"no native kernel reads {kv.bits}-bit codes"
    if kv.bits == 4 and kv.group % 2:
        return f"the 4-bit kernel reads a value group as whole bytes: group {kv.group} is odd"
    if call.q.shape[2] != 1:
        return f"{call.q.shape[2]} queries: the native kernels take one decode step"
    if device.type != "cpu":
        return f"on {device.type}: the native kernels are the CPU's"
    if call.need_weights:
        return "weights requested"
    if call.hooks is not None and call.hooks.at_core:
        return "a hook at the core needs q, k, v or the pattern as tensors"
    if call.backend != "auto":
        return f"backend {call.backend!r} asked for"
    if call.dropout_p > 0.0 or call.needs_grad or call.softcap is not None or call.sinks is not None:
        return "dropout, gradients, softcap or sink logits"
    compiling = torch.compiler.is_compiling()
    step_wide: str | None = None if compiling else spec.memo.get(("native codes", kv.bits))
    if step_wide is None:
        step_wide = ""
        if spec.padding is not None or not (_visible(spec) or _key_keep(spec, device) is not None):
            step_wide = "not every key is visible to every query, and the keys seen are not one choice for every head"
        elif not cpu.native_quantized_decode(kv.bits):
            why = native.unavailable()
            step_wide = "the native kernels are off or not built here" + (f" ({why})" if why else "")
        if not compiling:
            spec.memo[("native codes", kv.bits)] = step_wide
    return step_wide or None


def _key_keep(spec: MaskSpec, device: torch.device) -> Tensor | None:
    """The keys a decode step's queries see, as the native kernels take them ((b, t) bool, the same for every
    head), or None: a mask of another form, or under torch.compile (which keys are seen is read from the data)."""
    if torch.compiler.is_compiling():
        return None
    return spec.key_keep(device)


def _native_keep(spec: MaskSpec, device: torch.device) -> Tensor | None:
    """What a native kernel the decision chose is given to hide: None where every key is visible."""
    return None if _visible(spec) else _key_keep(spec, device)


def _visible(spec: MaskSpec) -> bool:
    """Every key visible to every query, read without a device sync under torch.compile (the structure alone)."""
    return spec.is_empty if torch.compiler.is_compiling() else spec.every_key_visible()


def _native_dense(call: AttentionCall) -> str | None:
    """Why a CPU SDPA decode step runs in the native dense kernel (the decision's source), or None."""
    spec, q = call.mask, call.q
    if (q.shape[2] != 1 or call.needs_grad or call.dropout_p > 0.0 or spec.padding is not None
            or call.softcap is not None or call.sinks is not None or call.backend != "auto"):
        return None
    k, v = call.k, call.v
    if not native.dense_fits(q, k, v) or not (_visible(spec) or _key_keep(spec, q.device) is not None):
        return None  # (the mask's values are read last)
    return cpu.native_decode_attention(q.shape[0], q.shape[1], k.shape[1], k.dtype, k.shape[2])


def _backend(call: AttentionCall, device: torch.device) -> tuple[str, str]:
    """The kernel for the output, and why: what the call requires first, then what was asked, then 'auto'."""
    backend = check_backend(call.backend)
    if call.need_weights:
        if backend in ("sdpa", "flex"):
            raise MultiheadError(
                f"backend {backend!r} cannot return attention weights (fused kernels never materialise them): "
                "use backend='math' or 'auto' with return_weights=True"
            )
        return "math", ("weights requested: only the math path materialises the (b, h, s, t) weights; without "
                        "return_weights the fused SDPA path runs")
    if backend == "math":
        return "math", "math path asked for explicitly; the fused SDPA path ('auto') is faster"
    if call.sinks is not None:
        if backend in ("sdpa", "flex"):
            raise MultiheadError(
                f"backend {backend!r} cannot take sink logits (s_aux): a sink needs each row's log-sum-exp, which "
                "SDPA does not return and PyTorch's CPU flex attention cannot (return_lse); use 'math' or 'auto'"
            )
        return "math", ("sink logits (s_aux) join each row's softmax: the math path takes them (no fused kernel here "
                        "returns the log-sum-exp they need)")
    if backend == "sdpa":
        if call.softcap is not None:
            raise MultiheadError("backend 'sdpa' cannot cap scores (softcap): use 'auto', 'math' or 'flex'")
        return "sdpa", "SDPA asked for explicitly"
    if backend == "flex":
        _check_flex(call, device)
        return "flex", "flex attention asked for explicitly"
    return _auto(call, device)


def _check_flex(call: AttentionCall, device: torch.device) -> None:
    if call.dropout_p > 0.0:
        raise MultiheadError(f"backend 'flex' has no dropout (dropout_p {call.dropout_p}): use 'sdpa', or eval()")
    if not flex.available():
        raise MultiheadError(f"backend 'flex' needs torch >= 2.5 with flex attention (this is {torch.__version__})")
    if (why := _no_flex(call, device)) is not None:
        raise MultiheadError(f"backend 'flex': {why}; use 'sdpa', 'math' or 'auto'")
    if call.needs_grad and device.type == "cpu":
        raise MultiheadError("backend 'flex' has no backward on the CPU (PyTorch's flex attention): run under "
                             "torch.no_grad() or choose backend 'sdpa' for training on the CPU")


def _no_flex(call: AttentionCall, device: torch.device) -> str | None:
    """Why flex attention's kernel cannot take this call's shapes on ``device``
    (:func:`multihead.kernels.flex.unsupported`)."""
    _, h, s, d = call.q.shape
    return flex.unsupported(d, s, h // call.kv.n_kv_heads, device)


def _auto(call: AttentionCall, device: torch.device) -> tuple[str, str]:
    """'auto': the fastest kernel that takes the call's inputs on ``device``."""
    spec, dropout_p = call.mask, call.dropout_p
    if call.rows_are_heads:
        return "math", (f"the {spec.s} query heads of one decode step run as the rows of their one KV head: two "
                        "matrix products (the math path) beat the fused kernels there, 1.2-3x on an H200 and a 2-core "
                        "CPU (benchmarks/mla_decode.py)")
    if call.softcap is not None:
        no_flex = _no_flex(call, device)
        if device.type == "cuda" and flex.available() and dropout_p == 0.0 and no_flex is None:
            return "flex", "scores are capped (softcap): flex attention applies it in its score_mod"
        return "math", ("scores are capped (softcap), which SDPA cannot do; the math path applies it (flex attention "
                        f"would, on a GPU without dropout{'' if no_flex is None else ', but ' + no_flex})")
    found = structure(spec)
    if found is None:
        return "sdpa", "fused SDPA is the default"
    if dropout_p > 0.0:
        return "sdpa", f"the mask has structure ({found}) but flex attention has no dropout"
    if device.type != "cuda":
        return "sdpa", (f"the mask has structure ({found}); on the CPU flex attention compiles for each new shape, "
                        "so SDPA's CPU kernel takes the mask (backend='flex' for the block-sparse kernel)")
    if spec.s < flex.BLOCK:
        return "sdpa", f"the mask has structure ({found}) but {spec.s} queries are fewer than one block"
    if not flex.available():
        return "sdpa", f"the mask has structure ({found}) but this torch has no flex attention"
    if (no_flex := _no_flex(call, device)) is not None:
        return "sdpa", f"the mask has structure ({found}) but {no_flex}"
    return "flex", f"the mask has structure ({found}): flex attention skips the masked blocks, no dense mask"


def _folds(call: AttentionCall, device: torch.device) -> bool:
    """SDPA's GQA decode fold, as :mod:`multihead.kernels.cpu` decides it for this device."""
    q, k = call.q, call.k
    return cpu.fold_gqa_decode(q.shape[0], q.shape[1], k.shape[1], q.shape[2], device, call.mask.is_plain_causal,
                               k.shape[2], k.dtype)


def attend(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """softmax(q k^T * scale + mask) v for q (b, h, s, d) over the call's view of the keys and values, with the
    call's hooks.

    Returns (out (b, h, s, dv), weights (b, h, s, t) or None). Weights are those multiplied into v, after dropout.
    q, k and v pass their hooks first, the kernel :func:`resolve_backend` decides runs (a hooked pattern inside the
    math path, or made beside a fused kernel), and the output passes the z hook.
    """
    if isinstance(call.kv, GroupedKV):
        return _attend_groups(call), None
    if isinstance(call.kv, LatentKV):
        if _their_threads(call.q):  # the latent's products: PyTorch's
            with cpu.configured_threads():
                return _attend_latent(call)
        return _attend_latent(call)
    call, decision, _ = prepare(call, run_hooks=True)
    if not decision.native and call.q.shape[-2] == 1 and _their_threads(call.q):
        with cpu.configured_threads():
            return _attend(call, decision)
    return _attend(call, decision)


def _their_threads(q: Tensor) -> bool:
    """Whether PyTorch's kernels over ``q`` run with the configured threads: inside a step with fewer, for a dtype
    whose sums depend on the thread count (:func:`multihead.kernels.cpu.configured_threads`). Asked for a decode
    step's attention (one query row a head; a prefill's SDPA gave the same bits in one thread and two on both hosts)
    and MLA's latent products; no context manager where none is needed (the idle path)."""
    return cpu.fewer_threads() and q.dtype in cpu.KEEPS_THREADS and q.is_cpu


def _attend(call: AttentionCall, decision: Dispatch) -> tuple[Tensor, Tensor | None]:
    """:func:`attend` of a prepared call with its decision."""
    hooks = call.hooks
    q, spec = call.q, call.mask
    pattern = None if hooks is None else hooks.pattern
    weights: Tensor | None = None
    if decision.native == "quantized":
        kv = call.kv
        assert isinstance(kv, QuantizedKV)
        out = torch.ops.multihead.attend_quantized(  # the store's own buffers, laid out for it
            kv.bits, q, kv.codes_k, kv.scale_k, kv.min_k, kv.codes_v, kv.scale_v, kv.min_v, kv.n, kv.group,
            kv.tail_k, kv.tail_v, call.scale, _native_keep(spec, q.device))
    elif decision.backend == "math":
        out, weights = math_attention(q, call.k, call.v, spec, scale=call.scale, dropout_p=call.dropout_p,
                                      softcap=call.softcap, sinks=call.sinks, pattern=pattern)
        weights = weights if call.need_weights else None
    elif decision.backend == "flex":
        out = flex.flex_attention(q, call.k, call.v, spec, scale=call.scale, softcap=call.softcap)
    elif decision.native == "dense":  # (dense_fits asked by the decision, of these very tensors)
        out = torch.ops.multihead.attend_dense(q, call.k, call.v, call.scale, _native_keep(spec, q.device))
    else:
        blocks = key_blocks(spec, q.device, q.dtype) if decision.blocks else None  # (kept on the spec)
        out = sdpa_attention(q, call.k, call.v, spec, scale=call.scale, dropout_p=call.dropout_p, fold=decision.fold,
                             blocks=blocks, split=decision.split)
    if decision.pattern_beside:
        assert pattern is not None
        out = _pattern_beside(call, out, pattern)
    if hooks is not None and hooks.z is not None:
        out = hooks.z(out)
    return out, weights


def prepare(call: AttentionCall, *, run_hooks: bool) -> tuple[AttentionCall, Dispatch, str]:
    """One call over dense or quantized keys made ready for its kernel, the one preparation :func:`attend` and
    :func:`explain` share: the keys counted against the mask, the q hook (``run_hooks``: attend runs the hooks,
    explain only decides), the decision, codes that no native kernel takes (or whose keys are hooked) read back
    into keys and values and decided again, the k and v hooks. Returns the call as the kernel takes it, the
    decision, and what was done before it ("" or the read-back's reason and "; ")."""
    _check_keys(call)
    hooks = call.hooks
    if run_hooks and hooks is not None and hooks.q is not None:
        call = dataclasses.replace(call, q=hooks.q(call.q))
    decision = resolve_backend(call)
    kv_hooked = hooks is not None and (hooks.k is not None or hooks.v is not None)
    before = ""
    if decision.dequantize or (kv_hooked and not isinstance(call.kv, DenseKV)):  # keys as tensors, then decided again
        before = decision.reason + "; "
        call = dataclasses.replace(call, kv=dense_view(call.kv))
        decision = resolve_backend(call)
    if run_hooks and kv_hooked:
        assert hooks is not None
        k = call.k if hooks.k is None else hooks.k(call.k)
        v = call.v if hooks.v is None else hooks.v(call.v)
        call = dataclasses.replace(call, kv=DenseKV(k, v))
        decision = resolve_backend(call)
    return call, decision, before


def _check_keys(call: AttentionCall) -> None:
    assert not isinstance(call.kv, GroupedKV | LatentKV)
    t = call.kv.t
    if call.mask.t != t:
        raise MultiheadError(f"the step's mask covers {call.mask.t} keys but this call has {t}: make the step for "
                             "the same inputs and cache")


# ---------------------------------------------------------------------------------------------- head-wise views
def _attend_groups(call: AttentionCall) -> Tensor:
    hooks = call.hooks
    if hooks is not None and hooks.q is not None:
        call = dataclasses.replace(call, q=hooks.q(call.q))
    calls, order = group_calls(call)
    assert isinstance(call.kv, GroupedKV)
    groups = call.kv.groups
    b, h, s, _ = call.q.shape
    outs = [attend(c)[0] for c in calls]  # (b, |group| * h / g, s, dv) each
    if order is None:
        z = outs[0]  # (b, h, s, dv): the layer is one group
    elif len(firsts := [group.first for group in groups if group.first is not None]) == len(groups):
        # runs of consecutive KV heads: put side by side in the order of their first heads, no gather
        z = torch.cat([outs[i] for i in sorted(range(len(outs)), key=firsts.__getitem__)], dim=1)  # (b, h, s, dv)
    else:
        r = h // call.kv.n_kv_heads  # query heads per KV head
        z = torch.cat([out.reshape(b, -1, r, s, out.shape[-1]) for out in outs], dim=1)  # (b, g, r, s, dv)
        z = z.index_select(1, order).reshape(b, h, s, -1)  # (b, h, s, dv): back in head order
    if hooks is not None and hooks.z is not None:
        z = hooks.z(z)
    return z


# ---------------------------------------------------------------------------------------------- latent views (MLA)
def _attend_latent(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    core = latent_call(call)
    z, weights = attend(core.call)  # expanded: hook_z ran in the call
    if core.w_uv is not None:  # absorbed: W_UV after the weighted sum, then hook_z
        z_lat = z.transpose(1, 2) if core.folded else z  # (b, h, s, rank)
        z = torch.einsum("bhsr,hvr->bhsv", z_lat, core.w_uv)  # (b, h, s, dv)
        hooks = call.hooks
        if hooks is not None and hooks.z is not None:
            z = hooks.z(z)
    return z, weights


def _pattern_beside(call: AttentionCall, out: Tensor, pattern: TensorFn) -> Tensor:
    """A fused kernel's output with the pattern hooked: the pattern made exactly as the math path makes it (same q, k
    and mask) for the hook; a replacement makes the output its weighted sum (the math path's), else ``out`` stays."""
    made = attention_weights(call.q, call.k, call.mask, scale=call.scale, softcap=call.softcap, sinks=call.sinks)
    edited = pattern(made)
    if edited is made:
        return out
    return weighted_sum(edited, call.v, call.dropout_p)[0]


def _describe_mask(spec: MaskSpec) -> str:
    if spec.is_empty:
        return "none"
    parts = []
    if spec.causal:
        parts.append("causal" + (f", window {spec.window}" if spec.window is not None else ""))
        if spec.s != spec.t:
            parts.append(f"bottom-right aligned (s {spec.s}, t {spec.t})")
    if spec.keep is not None:
        parts.append(f"bool {tuple(spec.keep.shape)}")
    if spec.bias is not None:
        parts.append(f"float {tuple(spec.bias.shape)}")
    if spec.documents is not None:
        parts.append("packed documents")
    return "; ".join(parts)


def explain(call: AttentionCall) -> KernelChoice:
    """Which kernel :func:`attend` runs for this call, and why, without running it (nor its hooks): the decision of
    :func:`resolve_backend`, the kernel underneath (for SDPA the one PyTorch selects), and the hooked points."""
    if isinstance(call.kv, LatentKV):
        core = latent_call(call)
        choice = explain(core.call)
        return KernelChoice(choice.backend, choice.kernel, f"{core.describe()}; {choice.reason}", choice.mask)
    if isinstance(call.kv, GroupedKV):
        calls, _ = group_calls(call)
        choices = [explain(dataclasses.replace(c, hooks=call.hooks and CallHooks(names=call.hooks.names)))
                   for c in calls]
        if len(choices) == 1:
            return choices[0]
        reason = "head-wise cache, one call per group of KV heads: " + "; ".join(
            f"{name} KV heads: {choice}" for name, choice in zip(("full", "streaming"), choices, strict=True))
        return KernelChoice(choices[0].backend, choices[0].kernel, reason, choices[0].mask)
    call, decision, before = prepare(call, run_hooks=False)
    if decision.native == "quantized":
        assert isinstance(call.kv, QuantizedKV)
        kernel, reason = f"multihead.kernels.native.attend_q{call.kv.bits}", decision.reason
    elif decision.backend == "flex":
        kernel = "flex_attention"
        reason = decision.reason + f"; {flex.sparsity(call.mask, call.q.device):.0%} of the 128 x 128 blocks skipped"
    elif decision.backend == "math":
        kernel, reason = "matmul+softmax", decision.reason
    elif decision.native == "dense":
        kernel, reason = "multihead.kernels.native.attend_dense", decision.reason
    else:
        kernel = _sdpa_kernel(call)
        reason = decision.reason + _sdpa_details(call, decision, kernel)
    if call.hooks is not None and call.hooks.names:
        reason += f"; hooked: {', '.join(call.hooks.names)}"
    return KernelChoice(decision.backend, kernel, before + reason, _describe_mask(call.mask))


def _sdpa_kernel(call: AttentionCall) -> str:
    """The kernel PyTorch's SDPA selects for the call (its private chooser), or "unknown"."""
    choice_fn = getattr(torch, "_fused_sdp_choice", None)
    if choice_fn is None:
        return "unknown"
    from torch.nn.attention import SDPBackend

    q, k, v, spec = call.q, call.k, call.v, call.mask
    dense: Tensor | None = None
    if not (spec.is_empty or spec.is_plain_causal):
        keep, bias, _ = spec.dense(q.device, q.dtype)
        dense = bias if bias is not None else keep
    try:
        code = choice_fn(q, k, v, dense, call.dropout_p, spec.is_plain_causal, scale=call.scale,
                         enable_gqa=k.shape[1] != q.shape[1])
        return str(SDPBackend(code).name.lower().removesuffix("_attention"))
    except (RuntimeError, ValueError, TypeError):  # private API: report it as unknown rather than fail
        return "unknown"


def _sdpa_details(call: AttentionCall, decision: Dispatch, kernel: str) -> str:
    """What the SDPA call does with the inputs, and what keeps a faster kernel out."""
    q, k, spec = call.q, call.k, call.mask
    reason = ""
    if decision.fold:
        reason += f"; one query per head: the {q.shape[1] // k.shape[1]} query heads of each KV head run as its rows"
    blocks = key_blocks(spec, q.device, q.dtype) if decision.blocks else None
    if blocks is not None:
        share = sum((b.rows.stop - b.rows.start) * (b.keys.stop - b.keys.start if isinstance(b.keys, slice)
                                                    else b.keys.numel()) for b in blocks) / (spec.s * spec.t)
        reason += (f"; the queries run in {len(blocks)} blocks of {QUERY_BLOCK} rows, each over only the keys its rows "
                   f"can see ({share:.0%} of the scores one call would compute)")
    if decision.split:
        own = (f"one call a block of {QUERY_BLOCK} rows over the keys up to its last row"
               if causal_blocks(spec.s, q.dtype) else "another with the kernel's causal flag")
        reason += (f"; the {spec.t - spec.s} cached keys, which every query sees, run in one call with each KV head's "
                   f"{q.shape[1] // k.shape[1]} query heads as its rows and no mask, the chunk's own {spec.s} keys in "
                   f"{own}, the parts merged by their log-sum-exp")
    if spec.is_plain_causal and blocks is not None:
        reason += "; each block's part of the causal mask is passed as a dense tensor"
    elif spec.is_empty or spec.is_plain_causal or decision.split:
        reason += "; no dense mask is made" + (" (the kernel's own causal path)" if spec.causal else "")
    else:
        reason += (
            ("; each block's part of the mask" if blocks is not None else "; the mask")
            + " is passed as a dense tensor, which keeps some fused kernels out"
            + (" (causal with s != t or a window has no flag in SDPA)" if spec.causal else "")
        )
        if (structure(spec) is not None and flex.available() and spec.s >= flex.BLOCK
                and _no_flex(call, q.device) is None):
            reason += (f"; flex attention would skip {flex.sparsity(spec, q.device):.0%} of the 128 x 128 blocks "
                       "(see benchmarks/RESULTS.md for when that pays on the CPU)")
    if kernel == "math":
        reason += "; PyTorch's math kernel runs, materialising the (s, t) scores"
        if call.dropout_p > 0.0 and q.device.type == "cpu":
            reason += ": its CPU fused kernel takes no dropout (eval() or dropout 0 gives the fused kernel)"
        elif structure(spec) is not None and call.dropout_p == 0.0:
            reason += ": backend='flex' avoids it"
        else:
            reason += ": no fused kernel takes these inputs here"
    return reason
