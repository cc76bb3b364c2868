"""The block-sparse backend (flex attention) and the dispatch that chooses it, on the CPU.

Flex attention is compiled for each shape on first use, so these tests share a few shapes. The expected outputs come
from the float64 oracle (multihead.verify.reference) given the equivalent dense mask.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import to_np
from multihead import KVCache, MultiHeadAttention
from multihead.cache import DenseKV
from multihead.errors import MultiheadError
from multihead.kernels import AttentionCall, flex, resolve_backend
from multihead.layers.masks import MaskSpec, build_mask, causal_keep
from multihead.verify.reference import Weights, multihead_attention

pytestmark = pytest.mark.skipif(not flex.available(), reason="this torch has no flex attention")

B, S, D_MODEL = 2, 256, 64
ATOL, RTOL = 3e-5, 3e-4


def _layer(n_heads: int = 4, n_kv_heads: int = 2, window: int | None = None, rope: float | None = None
           ) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(d_model=D_MODEL, n_heads=n_heads, n_kv_heads=n_kv_heads, window=window, rope=rope)


def _documents() -> torch.Tensor:
    """Two sequences packing 3 and 2 documents (ids restart per sequence)."""
    docs = torch.zeros(B, S, dtype=torch.long)
    docs[0, 100:], docs[0, 180:] = 1, 2
    docs[1, 40:] = 1
    return docs


def _document_keep(docs: torch.Tensor) -> np.ndarray:
    return (docs[:, None, :, None] == docs[:, None, None, :]).numpy()  # (b, 1, s, s)


@pytest.mark.parametrize("case", ["causal", "window", "padding", "documents", "bool-mask", "float-mask"])
def test_flex_equals_oracle(case: str) -> None:
    window = 48 if case == "window" else None
    layer = _layer(window=window)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, D_MODEL, generator=gen)
    kwargs: dict = {"causal": case in ("causal", "window", "documents", "padding")}
    ref: dict = {"causal": kwargs["causal"]}
    if case == "padding":
        lengths = torch.tensor([S, 97])
        kwargs["key_padding_mask"] = ref["key_padding_mask"] = torch.arange(S)[None] < lengths[:, None]
        ref["key_padding_mask"] = ref["key_padding_mask"].numpy()
    if case == "documents":
        kwargs["documents"] = _documents()
        ref["mask"] = _document_keep(kwargs["documents"])
    if case == "bool-mask":
        keep = torch.rand(B, 1, S, S, generator=gen) < 0.5
        keep[:, :, 7] = False  # a query with no key: zeros, not NaN
        kwargs["mask"], ref["mask"] = keep, keep.numpy()
    if case == "float-mask":
        bias = torch.randn(1, 4, S, S, generator=gen).masked_fill(torch.rand(1, 4, S, S, generator=gen) < 0.3,
                                                                   float("-inf"))
        kwargs["mask"], ref["mask"] = bias, bias.double().numpy()
    want, _ = multihead_attention(layer.config, Weights.of(layer), to_np(x), None, **ref)
    with torch.no_grad():  # flex attention has no backward on the CPU
        got = layer(x, backend="flex", **kwargs)
    assert not torch.isnan(got).any()
    np.testing.assert_allclose(to_np(got), want, atol=ATOL, rtol=RTOL)


def test_flex_decodes_from_a_cache_with_different_lengths() -> None:
    """Per-sequence cache positions become a block mask: decoding equals the uncached forward for each sequence."""
    layer = _layer(rope=10000.0)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, D_MODEL, generator=gen)
    lengths = [S - 3, S - 60]
    cache = KVCache(batch=B, n_kv_heads=2, head_dim=16, max_len=S)
    with torch.no_grad():
        layer(x[:, : S - 3], causal=True, cache=cache.layer(0), backend="flex")
        cache.advance(S - 3, lengths=lengths)
        step = torch.stack([x[0, S - 3], x[1, S - 60]])[:, None]  # each sequence's next token
        got = layer(step, causal=True, cache=cache.layer(0), backend="flex")  # (b, 1, d_model)
        for i, n in enumerate(lengths):
            alone = layer(x[i : i + 1, : n + 1], causal=True, backend="math")[0, -1]
            torch.testing.assert_close(got[i, 0], alone, atol=ATOL, rtol=RTOL)


def _blocks_with_a_key(keep: torch.Tensor) -> tuple[int, int]:
    """(blocks holding at least one allowed pair, all blocks) of a (s, t) mask cut into 128 x 128 blocks."""
    s, t = keep.shape
    qb, kb = -(-s // flex.BLOCK), -(-t // flex.BLOCK)
    padded = torch.zeros(qb * flex.BLOCK, kb * flex.BLOCK, dtype=torch.bool)
    padded[:s, :t] = keep
    blocks = padded.reshape(qb, flex.BLOCK, kb, flex.BLOCK)
    return int(blocks.any(dim=(1, 3)).sum()), qb * kb


@pytest.mark.parametrize(("s", "window"), [(1024, None), (1024, 128), (1024, 300), (300, None), (700, 200)])
def test_block_mask_skips_exactly_the_fully_masked_blocks(s: int, window: int | None) -> None:
    spec = build_mask(batch=1, n_heads=1, s=s, t=s, causal=True, window=window)
    with_key, blocks = _blocks_with_a_key(causal_keep(s, s, window=window))
    want = 1.0 - with_key / blocks
    assert flex.sparsity(spec, torch.device("cpu")) == pytest.approx(want)
    assert want > (0.4 if s == 1024 else 0.2)  # causal alone skips 28 of 64 blocks at 1024; 3 of 9 at 300


def test_a_mask_that_skips_nothing_reports_zero_at_any_length() -> None:
    spec = build_mask(batch=2, n_heads=1, s=300, t=300, key_padding_mask=torch.ones(2, 300, dtype=torch.bool))
    assert flex.sparsity(spec, torch.device("cpu")) == 0.0  # PyTorch's element count gave -64% here


def test_a_block_mask_is_made_once_per_step_and_follows_a_new_step() -> None:
    keep = torch.arange(S)[None] < torch.tensor([S, 130])[:, None]
    spec = build_mask(batch=B, n_heads=4, s=S, t=S, key_padding_mask=keep, causal=True)
    first = flex.block_mask(spec, torch.device("cpu"))
    assert flex.block_mask(spec, torch.device("cpu")) is first  # the next layer of the step reuses it
    keep[1, 130:200] = True  # the next step's mask: a new spec, a new block mask, and the result follows it
    again = build_mask(batch=B, n_heads=4, s=S, t=S, key_padding_mask=keep, causal=True)
    assert flex.block_mask(again, torch.device("cpu")) is not first
    layer = _layer()
    x = torch.randn(B, S, D_MODEL)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, key_padding_mask=keep, causal=True, backend="flex"),
                                   layer(x, key_padding_mask=keep, causal=True, backend="math"), atol=ATOL, rtol=RTOL)


def test_documents_on_every_backend_equal_the_dense_mask() -> None:
    layer = _layer()
    x = torch.randn(B, S, D_MODEL)
    docs = _documents()
    dense = torch.from_numpy(_document_keep(docs))
    for backend in ("sdpa", "math"):
        torch.testing.assert_close(layer(x, documents=docs, causal=True, backend=backend),
                                   layer(x, mask=dense, causal=True, backend="math"), atol=ATOL, rtol=RTOL)


def test_auto_dispatch_explains_its_choice() -> None:
    window = build_mask(batch=1, n_heads=4, s=512, t=512, causal=True, window=64)
    plain = build_mask(batch=1, n_heads=4, s=512, t=512, causal=True)
    short = build_mask(batch=1, n_heads=4, s=16, t=16, causal=True, window=4)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def call(spec: MaskSpec, dropout_p: float = 0.0, head_dim: int = 16, **kw: object) -> AttentionCall:
        x = torch.zeros(1, 4, 512, head_dim)
        return AttentionCall(x, DenseKV(x, x), spec, scale=1.0, dropout_p=dropout_p, **kw)  # type: ignore[arg-type]

    plan = resolve_backend(call(window), device=cuda)
    assert plan.backend == "flex" and "sliding window 64" in plan.reason
    # heads under 16 wide: flex attention's GPU kernel refuses them (seen on an H200, torch 2.11), so SDPA takes the
    # mask, the math path the softcap, and an explicit 'flex' is refused naming the width
    plan = resolve_backend(call(window, head_dim=8), device=cuda)
    assert plan.backend == "sdpa" and "needs head_dim >= 16 (this is 8)" in plan.reason
    assert resolve_backend(call(window, softcap=30.0), device=cuda).backend == "flex"
    plan = resolve_backend(call(window, head_dim=8, softcap=30.0), device=cuda)
    assert plan.backend == "math" and "needs head_dim >= 16 (this is 8)" in plan.reason
    with pytest.raises(MultiheadError, match=r"backend 'flex': flex attention's GPU kernel needs head_dim >= 16 "
                                             r"\(this is 8\)"):
        resolve_backend(call(window, head_dim=8, backend="flex"), device=cuda)
    assert resolve_backend(call(window, head_dim=8), device=cpu).backend == "sdpa"
    # grouped heads, fewer queries than a block but more rows than one (48 x 4 = 192): no decoding kernel on the GPU
    short_q = build_mask(batch=1, n_heads=8, s=48, t=48, causal=True)
    q8, k2 = torch.zeros(1, 8, 48, 16), torch.zeros(1, 2, 48, 16)
    capped = AttentionCall(q8, DenseKV(k2, k2), short_q, scale=1.0, softcap=30.0)
    plan = resolve_backend(capped, device=cuda)
    assert plan.backend == "math" and "no block for 48 queries x 4 query heads a KV head (192 rows" in plan.reason
    with pytest.raises(MultiheadError, match="decoding kernel has no block for 48 queries x 4"):
        resolve_backend(AttentionCall(q8, DenseKV(k2, k2), short_q, scale=1.0, backend="flex"), device=cuda)
    one = build_mask(batch=1, n_heads=8, s=1, t=48, causal=True)  # a decode step's 4 rows fit a block
    step = AttentionCall(q8[:, :, :1], DenseKV(k2, k2), one, scale=1.0, softcap=30.0)
    assert resolve_backend(step, device=cuda).backend == "flex"
    assert resolve_backend(capped, device=cpu).backend == "math"  # the CPU's own reason, not the GPU's
    assert resolve_backend(call(plain), device=cuda).backend == "sdpa"  # SDPA's causal flag
    assert resolve_backend(call(short), device=cuda).backend == "sdpa"  # under one block
    assert resolve_backend(call(window, 0.1), device=cuda).backend == "sdpa"
    plan = resolve_backend(call(window), device=cpu)
    assert plan.backend == "sdpa" and "backend='flex'" in plan.reason
    layer = _layer(window=64)
    x = torch.randn(1, 512, D_MODEL)
    choice = layer.explain(x, causal=True, backend="flex")
    auto = layer.explain(x, causal=True)  # on the CPU: SDPA, and what flex would skip (9 of 16 blocks)
    assert auto.backend == "sdpa" and "flex attention would skip 56% of the 128 x 128 blocks" in auto.reason
    assert choice.backend == "flex" and "blocks skipped" in choice.reason


def test_flex_refuses_what_it_cannot_do() -> None:
    layer = _layer()
    x = torch.randn(1, 8, D_MODEL)
    with pytest.raises(MultiheadError, match="cannot return attention weights"):
        layer(x, backend="flex", return_weights=True)
    drop = MultiHeadAttention(d_model=D_MODEL, n_heads=4, dropout=0.1).train()
    with pytest.raises(MultiheadError, match=r"no dropout \(dropout_p 0.1\)"):
        drop(x, backend="flex")
    with pytest.raises(MultiheadError, match="no backward on the CPU"):
        layer(x, backend="flex")  # parameters require grad, grad mode is on


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"documents": torch.zeros(2, 8)}, r"documents has dtype torch.float32: it must hold integer document ids"),
    ({"documents": torch.zeros(1, 8, dtype=torch.long)}, r"documents of shape \(1, 8\) must be \(b, s\) = \(2, 8\)"),
    ({"documents": torch.zeros(2, 8, dtype=torch.long), "context": torch.randn(2, 8, D_MODEL)},
     "documents are for self-attention"),
])
def test_bad_documents_are_named(kwargs: dict, message: str) -> None:
    layer = _layer()
    x = torch.randn(2, 8, D_MODEL)
    context = kwargs.pop("context", None)
    with pytest.raises(MultiheadError, match=message):
        layer(x, context, **kwargs)


def test_a_kernel_that_does_not_compile_is_refused_naming_the_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the H200 showed: inductor's lowering error is long and names no layer; the error says the inputs."""
    from torch._inductor.exc import InductorError

    def fails(*args: object, **kwargs: object) -> torch.Tensor:
        raise InductorError(NotImplementedError("NYI: embedding dimension must be at least 16 but got E=8"), None)

    monkeypatch.setattr(flex, "_kernel", lambda: fails)
    q, k = torch.zeros(1, 4, 8, 8), torch.zeros(1, 2, 8, 8)
    spec = build_mask(batch=1, n_heads=4, s=8, t=8, causal=True)
    with pytest.raises(MultiheadError, match=r"flex attention did not compile for q \(1, 4, 8, 8\), k/v "
                                             r"\(1, 2, 8, 8\) torch.float32 on cpu \(InductorError: .*NYI: embedding"):
        flex.flex_attention(q, k, k, spec, scale=1.0)

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise ValueError("not the compiler's")

    monkeypatch.setattr(flex, "_kernel", lambda: broken)  # anything else passes through as it was raised
    with pytest.raises(ValueError, match="not the compiler's"):
        flex.flex_attention(q, k, k, spec, scale=1.0)
