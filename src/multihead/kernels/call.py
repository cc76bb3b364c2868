"""What one call of the attention core is, what the dispatcher decides for it, and what explain says: the records the
dispatcher (:mod:`multihead.kernels`) and every backend module share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from multihead.cache.view import DenseKV, KVView, LatentKV, QuantizedKV
from multihead.errors import MultiheadError
from multihead.layers.masks import MaskSpec

BACKENDS = ("auto", "sdpa", "math", "flex")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise MultiheadError(f"backend {backend!r} is unknown: choose one of {', '.join(map(repr, BACKENDS))}")
    return backend


TensorFn = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class CallHooks:
    """The hooks at one call's core, made from a module's hook points by :func:`multihead.layers.hooks.call_hooks`.

    Each is a function tensor -> tensor that returns its input (to read it) or a replacement of the same shape, or
    None where nothing is hooked: ``q`` (b, h, s, d), ``k`` and ``v`` (b, g, t, d) as they enter the kernel,
    ``pattern`` the weights (b, h, s, t), ``z`` the output (b, h, s, dv). ``names`` are the module's hooked points,
    as :func:`explain` lists them. Hooks only see and replace tensors: what a hooked pattern means for the kernel is
    :func:`resolve_backend`'s rule, and the weighted sum of a replaced pattern is the math path's.
    """

    q: TensorFn | None = None
    k: TensorFn | None = None
    v: TensorFn | None = None
    pattern: TensorFn | None = None
    z: TensorFn | None = None
    names: tuple[str, ...] = ()

    @property
    def at_core(self) -> bool:
        """Whether a hook needs the core's tensors as tensors: q, k, v or the pattern (z comes after any kernel)."""
        return self.q is not None or self.k is not None or self.v is not None or self.pattern is not None


@dataclass(slots=True)
class AttentionCall:
    """One call of the attention core, as :func:`attend` runs it and :func:`explain` describes it.

    q (b, h, s, d); ``kv`` the keys and values as a view (:mod:`multihead.cache.view`; a :class:`DenseKV` of k
    (b, g, t, d) and v (b, g, t, dv) without a cache) with g dividing h (query head i reads KV head i // (h / g));
    ``mask`` the call's :class:`~multihead.layers.masks.MaskSpec` (a head-wise view's groups carry their own);
    ``dropout_p`` the dropout on the weights (0 outside
    training); ``backend`` one of BACKENDS; ``need_weights`` whether the (b, h, s, t) weights are returned;
    ``softcap`` caps the scaled scores as ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2); ``sinks``
    (h,) are learned sink logits, one per query head, that take part in each row's softmax denominator and add
    nothing to the output (gpt-oss); ``hooks`` the hook points at this core (:class:`CallHooks`, None when nothing
    is hooked); ``rows_are_heads`` marks a call whose query rows are one decode step's query heads folded onto
    their single KV head (MLA's absorbed decode: q (b, 1, h, .) over k (b, 1, t, .)).
    """

    q: Tensor
    kv: KVView
    mask: MaskSpec
    scale: float
    dropout_p: float = 0.0
    backend: str = "auto"
    need_weights: bool = False
    softcap: float | None = None
    sinks: Tensor | None = None
    hooks: CallHooks | None = None
    rows_are_heads: bool = False

    @property
    def k(self) -> Tensor:
        """The keys (b, g, t, d) of a dense view."""
        return _dense(self.kv).keys

    @property
    def v(self) -> Tensor:
        """The values (b, g, t, dv) of a dense view."""
        return _dense(self.kv).values

    @property
    def needs_grad(self) -> bool:
        if not torch.is_grad_enabled():
            return False
        kv = self.kv
        if isinstance(kv, DenseKV):
            tensors = [kv.keys, kv.values]
        elif isinstance(kv, QuantizedKV):
            tensors = [kv.tail_k, kv.tail_v]
        elif isinstance(kv, LatentKV):
            tensors = [kv.latents] + ([] if kv.up is None else [kv.up])
        else:
            tensors = [t for group in kv.groups for t in (group.kv.keys, group.kv.values)]
        return self.q.requires_grad or any(t.requires_grad for t in tensors)


def _dense(kv: KVView) -> DenseKV:
    if not isinstance(kv, DenseKV):
        raise MultiheadError(f"this needs the keys and values as tensors, and the view is a {type(kv).__name__}: "
                             "read it back with multihead.kernels.dense_view")
    return kv


class Dispatch(NamedTuple):
    """How :func:`attend` computes a call, as :func:`resolve_backend` decides it.

    ``backend`` is the kernel that computes the output ("math", "sdpa", "flex" or "native"); ``reason`` why this one
    and what keeps a faster one out; ``fold`` that SDPA runs a GQA decode step with each KV head's query heads as its
    rows (:func:`multihead.kernels.cpu.fold_gqa_decode`); ``pattern_beside`` that a hooked pattern is made by the math
    path beside the fused kernel (a hook that returns a replacement makes the output its weighted sum, the math path's);
    ``dequantize`` that a quantized view is read back into dense keys and values first (then dispatched again as
    dense); ``native`` which native kernel runs: "dense" (:func:`multihead.kernels.native.attend_dense`) or "quantized"
    (:func:`multihead.kernels.native.attend_q4` / :func:`~multihead.kernels.native.attend_q8`), else None;
    ``blocks`` that SDPA runs the queries in blocks, each over only the keys its rows see
    (:func:`multihead.kernels.sdpa.key_blocks`); ``split`` that it runs a chunk after cached keys as the prefix and
    the chunk's own keys, merged by their log-sum-exp (:func:`multihead.kernels.sdpa.splits`).
    """

    backend: str
    reason: str
    fold: bool = False
    pattern_beside: bool = False
    dequantize: bool = False
    native: str | None = None
    blocks: bool = False
    split: bool = False


@dataclass(frozen=True)
class KernelChoice:
    """Which attention kernel runs for a call, and why.

    ``backend`` is the kernel family that computes the output ("sdpa", "math", "flex" or "native"); ``kernel`` the
    implementation underneath
    (for SDPA the one PyTorch selects: "flash", "efficient", "cudnn", "math", ...); ``reason`` says why this one
    and, when it is not the fastest available, what keeps the faster one out.
    """

    backend: str
    kernel: str
    reason: str
    mask: str

    def __str__(self) -> str:
        return f"{self.backend} ({self.kernel}), mask: {self.mask}: {self.reason}"
