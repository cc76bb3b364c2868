"""One mask convention for the whole package: boolean True means "may attend".

What decides which keys a query sees is gathered into a :class:`MaskSpec` and kept structural (``causal``,
``window``) as long as possible, so that a fused kernel can use its own causal path; a dense tensor is made only when
a kernel needs one.

- ``mask``: a bool tensor (True = may attend) or a float tensor added to the scores (``-inf`` forbids a key),
  shaped ``(s, t)``, ``(1, s, t)`` or ``(b|1, h|1, s, t)``.
- ``key_padding_mask``: ``(b, t)`` bool, True = a real token (the opposite of torch.nn.MultiheadAttention's, where
  True means padding: pass ``~torch_mask``).
- ``causal``: query i of s sees keys up to ``t - s + i`` (bottom-right alignment, what a KV cache needs; for s == t it
  is the usual lower triangle).
- ``window``: with causal, query i sees at most the last ``window`` keys: ``t - s + i - window < j <= t - s + i``.
- ``documents``: ``(b, s)`` integer ids of the documents packed into each sequence (self-attention): a token sees
  only tokens of its own document. Combines with the rest (``causal=True`` for packed causal training).

A query row with no allowed key yields zeros (in the output and in the weights), never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from multihead.errors import MultiheadError


def causal_keep(s: int, t: int, *, window: int | None = None, device: torch.device | str | None = None) -> Tensor:
    """The (s, t) bool mask of causal attention aligned bottom-right, with an optional sliding window.

    Query i sits at position ``p = t - s + i`` among the keys; it may attend to key j iff ``j <= p`` and, with a
    window, ``j > p - window``.
    """
    q_pos = torch.arange(t - s, t, device=device).unsqueeze(-1)  # (s, 1)
    k_pos = torch.arange(t, device=device).unsqueeze(0)  # (1, t)
    keep = k_pos <= q_pos  # (s, t)
    if window is not None:
        keep = keep & (k_pos > q_pos - window)
    return keep


def positions_keep(q_positions: Tensor, t: int, *, window: int | None = None) -> Tensor:
    """The (b, 1, s, t) bool mask of causal attention by absolute positions (a KV cache's view).

    Query i of sequence b at position p = q_positions[b, i] may attend to cache slot j iff ``j <= p`` and, with a
    window, ``j > p - window``. Slots past a sequence's length lie beyond every query's position, so they are
    never seen.
    """
    q_pos = q_positions[:, None, :, None]  # (b, 1, s, 1)
    k_pos = torch.arange(t, device=q_positions.device)  # (t,)
    keep = k_pos <= q_pos  # (b, 1, s, t)
    if window is not None:
        keep = keep & (k_pos > q_pos - window)
    return keep


@dataclass(frozen=True)
class MaskSpec:
    """Which keys each query may see, for queries (b, h, s) over keys (b, g, t).

    ``keep`` (bool) and ``bias`` (float) are already validated and broadcastable to (b, h, s, t).

    A spec is made once per model step and shared by every layer: what is derived from it (the dense mask of
    :meth:`dense`, flex attention's block mask) is made on first use and kept on the spec for the other layers.
    """

    batch: int
    n_heads: int
    s: int
    t: int
    causal: bool = False
    window: int | None = None
    keep: Tensor | None = None
    bias: Tensor | None = None
    q_positions: Tensor | None = None  # (b, s): with a KV cache, causal by absolute positions instead of alignment
    documents: Tensor | None = None  # (b, s) document ids, s == t: a token sees its own document only
    padding: Tensor | None = None  # (b, t) bool, True = a real key: padded keys' K and V are zeroed before attention
    memo: dict[Any, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def is_empty(self) -> bool:
        """True when every query may attend to every key (a single bottom-right aligned causal query sees all)."""
        if self.keep is not None or self.bias is not None or self.documents is not None:
            return False
        if not self.causal:
            return True
        return self.s == 1 and self.q_positions is None and (self.window is None or self.window >= self.t)

    def every_key_visible(self) -> bool:
        """Whether every query may attend to every key: :attr:`is_empty`, or one decode query a sequence, causal by
        positions at or after the last key (a batch continuing at one cached length); read once and kept."""
        if self.is_empty:
            return True
        if (self.s != 1 or not self.causal or self.q_positions is None or self.window is not None
                or self.keep is not None or self.bias is not None or self.documents is not None):
            return False
        seen = self.memo.get("every key visible")
        if seen is None:
            seen = self.memo["every key visible"] = bool((self.q_positions >= self.t - 1).all())
        return bool(seen)

    def key_keep(self, device: torch.device) -> Tensor | None:
        """For one decode query a sequence (s == 1) whose mask is a choice of keys, the same for every head (a
        sliding layer's ring, a streaming head's sinks and window): that choice as a (b, t) bool tensor (True = seen),
        which the native decode kernels take. None for any other mask (a float bias, document ids, key padding, a
        choice that differs by head, or a row with no key). Made once and kept on the spec."""
        if (self.s != 1 or self.bias is not None or self.documents is not None or self.padding is not None
                or torch.compiler.is_compiling()):
            return None
        key = ("key keep", device)
        if key in self.memo:
            found: Tensor | None = self.memo[key]
            return found
        keep, _, has_key = self.dense(device, torch.float32)
        found = None
        if keep is not None and (has_key is None or bool(has_key.all())):
            if keep.ndim == 4 and keep.shape[1] == 1:  # (b | 1, 1, 1, t)
                found = keep[:, 0, 0, :].expand(self.batch, self.t).contiguous()
            elif keep.ndim == 2:  # (s, t): the same for every sequence
                found = keep[0].expand(self.batch, self.t).contiguous()
        self.memo[key] = found
        return found

    @property
    def is_plain_causal(self) -> bool:
        """True when the mask is exactly the square lower triangle (what fused kernels' is_causal flag means)."""
        if self.is_empty:
            return False
        return (self.causal and self.window is None and self.keep is None and self.bias is None and self.s == self.t
                and self.q_positions is None and self.documents is None)

    @property
    def may_have_empty_rows(self) -> bool:
        """False when the structure guarantees every query at least one key (so no guard is needed)."""
        if self.keep is not None or self.bias is not None:
            return True
        return self.causal and self.q_positions is None and self.s > self.t

    def dense(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Materialise the mask for a kernel: (keep, bias, has_key).

        ``keep`` is bool (True = may attend) or None for "all", ``bias`` a float tensor in ``dtype`` promoted to at
        least float32 (never rounded to a low-precision dtype), or None.
        Rows with no allowed key are opened up (all keys allowed, bias 0) so that no kernel sees an empty row, and
        ``has_key`` (bool, ``(.., s, 1)``) says which rows were empty so their output can be zeroed afterwards; it is
        None when no row can be empty. Made once per (device, dtype) and kept on this spec.
        """
        key = ("dense", device, dtype)
        found = self.memo.get(key)
        if found is None:
            found = self._dense(device, dtype)
            if not torch.compiler.is_compiling():
                self.memo[key] = found
        return found

    def _dense(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        keep = self.keep
        if self.causal:
            if self.q_positions is not None:
                structural = positions_keep(self.q_positions, self.t, window=self.window)  # (b, 1, s, t)
            else:
                structural = causal_keep(self.s, self.t, window=self.window, device=device)  # (s, t)
            keep = structural if keep is None else keep & structural
        if self.documents is not None:
            same = self.documents[:, None, :, None] == self.documents[:, None, None, :]  # (b, 1, s, t)
            keep = same if keep is None else keep & same
        # a float mask is added in at least float32: rounded to bfloat16 a bias of -150 moves by up to 0.5, which
        # reweights keys by e^0.5 (PyTorch's kernels take a float32 mask with low-precision inputs)
        work = torch.promote_types(dtype, torch.float32)
        bias = self.bias.to(device=device, dtype=work) if self.bias is not None else None
        if not self.may_have_empty_rows:
            return keep, bias, None
        allowed = keep
        if bias is not None:
            finite = bias != float("-inf")
            allowed = finite if allowed is None else allowed & finite
        assert allowed is not None
        has_key = allowed.any(dim=-1, keepdim=True)  # (.., s, 1)
        if keep is not None:
            keep = keep | ~has_key
        if bias is not None:
            bias = bias.masked_fill(~has_key, 0.0)
        return keep, bias, has_key


def _check_device(name: str, tensor: Tensor, device: torch.device | None) -> None:
    if device is not None and tensor.device != device:
        raise MultiheadError(f"{name} is on {tensor.device} but the inputs are on {device}: move it, e.g. "
                             f"{name}.to({str(device)!r})")


def _check_broadcast(name: str, shape: tuple[int, ...], target: tuple[int, ...], legend: str) -> None:
    pairs = zip(reversed(shape), reversed(target), strict=False)
    if len(shape) > len(target) or any(a not in (1, b) for a, b in pairs):
        raise MultiheadError(f"{name} of shape {tuple(shape)} does not broadcast to {legend} = {tuple(target)}")


def build_mask(
    *,
    batch: int,
    n_heads: int,
    s: int,
    t: int,
    mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    q_positions: Tensor | None = None,
    documents: Tensor | None = None,
    device: torch.device | None = None,
    validate: bool = True,
) -> MaskSpec:
    """Validate the mask arguments of one attention call and gather them into a :class:`MaskSpec`.

    Shapes, dtypes and devices (``device``: the inputs') are always checked. With ``validate`` (the default; skipped
    under torch.compile, where it would cost a pass over the mask in every call) a float mask is also checked for NaN
    and +inf, which would turn the outputs of their rows into NaN: -inf forbids a key, any finite value weights it.
    """
    if not isinstance(causal, bool):
        raise MultiheadError(f"causal ({causal!r}) must be True or False")
    if window is not None and not causal:
        raise MultiheadError(
            f"window ({window}) is a causal sliding window (each query sees the last {window} keys up to itself): "
            "call with causal=True, or pass an explicit mask for another pattern"
        )
    target = (batch, n_heads, s, t)
    legend = "(b, n_heads, s, t)"
    keep: Tensor | None = None
    bias: Tensor | None = None
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise MultiheadError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.ndim not in (2, 3, 4):
            raise MultiheadError(
                f"mask has {mask.ndim} dimensions (shape {tuple(mask.shape)}): give (s, t), (1, s, t) or "
                f"(b|1, n_heads|1, s, t) = {target}"
            )
        if mask.ndim == 3 and mask.shape[0] != 1:
            raise MultiheadError(
                f"mask of shape {tuple(mask.shape)} is ambiguous: a 3-D mask would broadcast its first dimension "
                f"against n_heads, not the batch; use mask[:, None] for a per-batch mask (b, 1, s, t) or give "
                f"{legend} = {target}"
            )
        _check_broadcast("mask", tuple(mask.shape), target, legend)
        _check_device("mask", mask, device)
        if mask.dtype == torch.bool:
            keep = mask
        elif mask.is_floating_point():
            if validate and not torch.compiler.is_compiling():
                bad = torch.isnan(mask) | (mask == float("inf"))
                if bool(bad.any()):
                    where = tuple(int(i) for i in bad.nonzero()[0])
                    raise MultiheadError(
                        f"the float mask holds NaN or +inf ({int(bad.sum())} entries, the first at {where}, value "
                        f"{float(mask[where])}): they make those rows NaN; use -inf to forbid a key, a finite value "
                        "to weight it (or validate=False to skip this check)")
            bias = mask
        else:
            raise MultiheadError(
                f"mask has dtype {mask.dtype}: use a bool mask (True = may attend) or a float mask added to the scores"
            )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise MultiheadError(f"key_padding_mask must be a torch.Tensor, got {type(key_padding_mask).__name__}")
        if key_padding_mask.dtype != torch.bool:
            raise MultiheadError(
                f"key_padding_mask has dtype {key_padding_mask.dtype}: it must be bool, True = a real token "
                "(torch.nn.MultiheadAttention's is the opposite: pass ~its_mask)"
            )
        _check_device("key_padding_mask", key_padding_mask, device)
        if tuple(key_padding_mask.shape) != (batch, t):
            raise MultiheadError(
                f"key_padding_mask of shape {tuple(key_padding_mask.shape)} must be (b, t) = {(batch, t)}"
            )
        pad = key_padding_mask[:, None, None, :]  # (b, 1, 1, t)
        keep = pad if keep is None else keep & pad
    if documents is not None:
        if not isinstance(documents, Tensor):
            raise MultiheadError(f"documents must be a torch.Tensor, got {type(documents).__name__}")
        if documents.dtype.is_floating_point or documents.dtype.is_complex or documents.dtype == torch.bool:
            raise MultiheadError(f"documents has dtype {documents.dtype}: it must hold integer document ids")
        if s != t:
            raise MultiheadError(f"documents are for self-attention over packed sequences: s ({s}) must equal t ({t})")
        _check_device("documents", documents, device)
        if tuple(documents.shape) != (batch, s):
            raise MultiheadError(f"documents of shape {tuple(documents.shape)} must be (b, s) = {(batch, s)}")
    return MaskSpec(batch=batch, n_heads=n_heads, s=s, t=t, causal=causal, window=window, keep=keep, bias=bias,
                    q_positions=q_positions, documents=documents, padding=key_padding_mask)
