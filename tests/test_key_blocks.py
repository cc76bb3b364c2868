"""A prefill's queries in blocks, each over only the keys its rows can see (multihead.kernels.sdpa.key_blocks), and a
chunk after cached keys split into the prefix and its own keys, merged by their log-sum-exp (sdpa.splits): the same
output as one SDPA call over the whole mask and as the float64 math reference (a sliding window, a ring whose seen
keys are not consecutive, an empty row; GQA and MHA chunks after a long prefix); decided only where they pay, never
under autograd or dropout, and said by explain; and tiny Gemma 3 and Llama models prefilled in chunks through the
cache kinds give the same logits with and without them (and transformers' own for the full kind)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from multihead import hf
from multihead.kernels import AttentionCall, DenseKV, attend, cpu, explain, math_attention, resolve_backend, sdpa
from multihead.kernels.sdpa import (
    AT_MOST,
    CAUSAL_BLOCKS,
    QUERY_BLOCK,
    SPLIT_BLOCKED_FROM,
    SPLIT_FROM,
    causal_blocks,
    key_blocks,
    splits,
)
from multihead.layers.masks import MaskSpec, build_mask


def _qkv(s: int, t: int, *, h: int = 4, g: int = 2, d: int = 16, dtype: torch.dtype = torch.float32
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(s * 1000 + t)
    return tuple(torch.randn(1, n, m, d, generator=gen).to(dtype) for n, m in ((h, s), (g, t), (g, t)))  # type: ignore[return-value]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """The math path in float64, K and V repeated per query head."""
    r = q.shape[1] // k.shape[1]
    out, _ = math_attention(q.double(), k.double().repeat_interleave(r, 1), v.double().repeat_interleave(r, 1), spec,
                            scale=q.shape[-1] ** -0.5)
    return out


def _one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    return sdpa.sdpa_attention(q, k, v, spec, scale=q.shape[-1] ** -0.5)


def _banded(s: int, t: int, window: int) -> torch.Tensor:
    keep = build_mask(batch=1, n_heads=4, s=s, t=t, causal=True, window=window).dense(torch.device("cpu"),
                                                                                      torch.float32)[0]
    assert keep is not None
    return keep


def _agrees(call: AttentionCall, dtype: torch.dtype) -> None:
    """The call's output (its blocks or its split) equals the float64 reference and one SDPA call over the whole
    mask, within the dtype's rounding."""
    assert isinstance(call.kv, DenseKV)
    q, k, v, spec = call.q, call.kv.keys, call.kv.values, call.mask
    out, _ = attend(call)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _reference(q, k, v, spec), atol=tol, rtol=0)
    torch.testing.assert_close(out, _one_call(q, k, v, spec), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_window_runs_in_blocks_and_equals_one_call_and_the_reference(dtype: torch.dtype) -> None:
    s, t, window = 300, 331, 32  # a chunk of 300 after 31 cached keys, each query seeing its last 32
    q, k, v = _qkv(s, t, dtype=dtype)
    spec = build_mask(batch=1, n_heads=4, s=s, t=t, causal=True, window=window)
    call = AttentionCall(q, DenseKV(k, v), spec, scale=q.shape[-1] ** -0.5)
    decision = resolve_backend(call)
    assert decision.backend == "sdpa" and decision.blocks
    blocks = key_blocks(spec, q.device, q.dtype)
    assert blocks is not None and [b.rows for b in blocks] == [slice(0, 128), slice(128, 256), slice(256, 300)]
    assert blocks[0].keys == slice(0, 31 + 128)  # the 31 cached keys and the block's own
    _agrees(call, dtype)
    assert "blocks of 128 rows" in explain(call).reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_causal_chunk_on_its_own_runs_in_blocks_where_the_kernel_skips_little(dtype: torch.dtype) -> None:
    """A plain causal float32 or bfloat16 square of CAUSAL_BLOCKS' sizes (a first chunk of up to 512 tokens) runs in
    blocks of 128 rows, each over the keys up to its last row; float64 keeps the kernel's causal flag. The same
    attention as one causal call and the reference."""
    s = 300
    q, k, v = _qkv(s, s, dtype=dtype)
    spec = build_mask(batch=1, n_heads=4, s=s, t=s, causal=True)
    assert spec.is_plain_causal and CAUSAL_BLOCKS[0] < s <= CAUSAL_BLOCKS[1]
    call = AttentionCall(q, DenseKV(k, v), spec, scale=q.shape[-1] ** -0.5)
    blocked = dtype != torch.float64
    assert resolve_backend(call).blocks == blocked == causal_blocks(s, dtype)
    blocks = key_blocks(spec, q.device, q.dtype)
    if blocked:
        assert blocks is not None and [(b.rows, b.keys) for b in blocks] == [
            (slice(0, 128), slice(0, 128)), (slice(128, 256), slice(0, 256)), (slice(256, 300), slice(0, 300))]
        assert "3 blocks of 128 rows" in explain(call).reason
    else:
        assert blocks is None and "kernel's own causal path" in explain(call).reason
    _agrees(call, dtype)


def test_a_ring_whose_seen_keys_are_not_consecutive_reads_them_by_index() -> None:
    """A cache ring holds keys out of position order: the band's columns shuffled."""
    s, t = 256, 400
    q, k, v = _qkv(s, t)
    order = torch.randperm(t, generator=torch.Generator().manual_seed(1))
    keep = _banded(s, t, window=20)[:, order]  # (s, t): column j holds the key at position order[j]
    spec = MaskSpec(batch=1, n_heads=4, s=s, t=t, keep=keep[None, None])
    blocks = key_blocks(spec, q.device, q.dtype)
    assert blocks is not None and all(isinstance(b.keys, torch.Tensor) for b in blocks)
    out, _ = attend(AttentionCall(q, DenseKV(k, v), spec, scale=q.shape[-1] ** -0.5))
    torch.testing.assert_close(out.double(), _reference(q, k, v, spec), atol=1e-5, rtol=0)


def test_a_row_with_no_key_gives_zeros_in_blocks_too() -> None:
    s, t = 256, 256
    q, k, v = _qkv(s, t)
    keep = _banded(s, t, window=8).clone()
    keep[5] = False
    spec = MaskSpec(batch=1, n_heads=4, s=s, t=t, keep=keep)
    call = AttentionCall(q, DenseKV(k, v), spec, scale=q.shape[-1] ** -0.5)
    assert resolve_backend(call).blocks  # the opened row sees every key; the others few
    out, _ = attend(call)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    torch.testing.assert_close(out.double(), _reference(q, k, v, spec), atol=1e-5, rtol=0)


def test_blocks_run_only_where_they_skip_enough_and_never_under_autograd_or_dropout() -> None:
    # a chunk of 256 after 3,840 keys sees nearly every score: one call
    spec = build_mask(batch=1, n_heads=4, s=256, t=4096, causal=True)
    assert key_blocks(spec, torch.device("cpu"), torch.float32) is None
    # a chunk of 256 after 256 keys: (128 * 384 + 128 * 512) / (256 * 512) = 0.875 > AT_MOST
    assert AT_MOST < 0.875 and key_blocks(build_mask(batch=1, n_heads=4, s=256, t=512, causal=True),
                                          torch.device("cpu"), torch.float32) is None
    # one block of rows, a plain causal square (the kernel's own flag) and a float bias: none
    assert key_blocks(build_mask(batch=1, n_heads=4, s=QUERY_BLOCK, t=400, causal=True, window=8),
                      torch.device("cpu"), torch.float32) is None
    for square in (CAUSAL_BLOCKS[0], CAUSAL_BLOCKS[1] + 1):  # a plain causal square outside CAUSAL_BLOCKS
        assert key_blocks(build_mask(batch=1, n_heads=4, s=square, t=square, causal=True), torch.device("cpu"),
                          torch.bfloat16) is None
    bias = torch.zeros(300, 300).masked_fill(~_banded(300, 300, 8), float("-inf"))
    assert key_blocks(MaskSpec(batch=1, n_heads=4, s=300, t=300, bias=bias), torch.device("cpu"),
                      torch.float32) is None
    # a mask that differs by sequence: none
    two = torch.stack([_banded(300, 300, 8), _banded(300, 300, 16)])[:, None]
    assert key_blocks(MaskSpec(batch=2, n_heads=4, s=300, t=300, keep=two), torch.device("cpu"),
                      torch.float32) is None
    q, k, v = _qkv(300, 331)
    spec = build_mask(batch=1, n_heads=4, s=300, t=331, causal=True, window=32)
    assert resolve_backend(AttentionCall(q, DenseKV(k, v), spec, scale=0.25)).blocks
    assert not resolve_backend(AttentionCall(q.requires_grad_(), DenseKV(k, v), spec, scale=0.25)).blocks
    assert not resolve_backend(AttentionCall(q.detach(), DenseKV(k, v), spec, scale=0.25, dropout_p=0.1)).blocks
    with cpu.disabled():  # the CPU speed paths' switch: the plain path, one call
        assert not resolve_backend(AttentionCall(q, DenseKV(k, v), spec, scale=0.25)).blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "g", "s", "p"), [
    (6, 2, 64, 200), (4, 4, 64, 200), (6, 2, 300, 600),  # at least SPLIT_FROM chunks' worth of cached keys
    (6, 2, 300, 150),  # its own keys in blocks: splits from SPLIT_BLOCKED_FROM
])
def test_a_chunk_after_a_long_prefix_splits_and_equals_one_call_and_the_reference(dtype: torch.dtype, h: int,
                                                                                   g: int, s: int, p: int) -> None:
    t = s + p
    q, k, v = _qkv(s, t, h=h, g=g, dtype=dtype)
    spec = build_mask(batch=1, n_heads=h, s=s, t=t, causal=True)
    call = AttentionCall(q, DenseKV(k, v), spec, scale=q.shape[-1] ** -0.5)
    decision = resolve_backend(call)
    if p < SPLIT_FROM * s and not causal_blocks(s, dtype):
        assert not decision.split
        _agrees(call, dtype)
        return
    assert p >= (SPLIT_BLOCKED_FROM if causal_blocks(s, dtype) else SPLIT_FROM) * s
    assert decision.split and not decision.blocks
    _agrees(call, dtype)
    reason = explain(call).reason
    assert f"{t - s} cached keys" in reason and (("one call a block of 128 rows" in reason) == causal_blocks(s, dtype))


def test_the_split_is_refused_for_a_short_prefix_a_window_positions_float64_autograd_and_dropout() -> None:
    s = 64
    q, k, v = _qkv(s, s + SPLIT_FROM * s)
    assert splits(build_mask(batch=1, n_heads=4, s=s, t=s + SPLIT_FROM * s, causal=True), q, k, v)
    short = build_mask(batch=1, n_heads=4, s=s, t=s + SPLIT_FROM * s - 1, causal=True)
    assert not splits(short, q, k[:, :, 1:], v[:, :, 1:])
    windowed = build_mask(batch=1, n_heads=4, s=s, t=3 * s, causal=True, window=100)
    by_position = build_mask(batch=1, n_heads=4, s=s, t=3 * s, causal=True,
                             q_positions=torch.arange(2 * s, 3 * s)[None])
    assert not splits(windowed, q, k, v) and not splits(by_position, q, k, v)
    spec = build_mask(batch=1, n_heads=4, s=s, t=3 * s, causal=True)
    assert not splits(spec, q.double(), k.double(), v.double())
    assert resolve_backend(AttentionCall(q, DenseKV(k, v), spec, scale=0.25)).split
    assert not resolve_backend(AttentionCall(q.requires_grad_(), DenseKV(k, v), spec, scale=0.25)).split
    assert not resolve_backend(AttentionCall(q.detach(), DenseKV(k, v), spec, scale=0.25, dropout_p=0.1)).split
    with cpu.disabled():
        assert not resolve_backend(AttentionCall(q.detach(), DenseKV(k, v), spec, scale=0.25)).split


# ------------------------------------------------------------------------------------------ a real prefill, chunked
W = 24  # the tiny model's sliding window
CHUNK, CHUNKS = 160, 3


def _gemma3() -> Any:
    config = transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, sliding_window=W,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _prefill(model: Any, tokens: torch.Tensor, kind: dict[str, Any]) -> torch.Tensor:
    cache = hf.new_cache(model, tokens.shape[1], **kind)
    with torch.no_grad():
        for i in range(0, tokens.shape[1], CHUNK):
            last: torch.Tensor = model(tokens[:, i:i + CHUNK], cache=cache).logits[0, -1]
    return last


@pytest.mark.parametrize("kind", [{}, {"bits": 4}, {"window": 64, "sink_tokens": 4}])
def test_a_chunked_prefill_through_each_kind_runs_its_sliding_layers_in_blocks(
        kind: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same logits with and without blocks (and, for the full kind, transformers' uncached logits)."""
    model = _gemma3()
    tokens = torch.randint(0, 97, (1, CHUNK * CHUNKS), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(tokens).logits[0, -1]  # transformers' sdpa, uncached
    ran: list[int] = []
    over = sdpa._over_blocks

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        ran.append(len(args[3]))
        return over(*args, **kwargs)

    monkeypatch.setattr(sdpa, "_over_blocks", counted)
    hf.enable(model)
    blocked = _prefill(model, tokens, kind)
    assert len(ran) >= 2 * CHUNKS and set(ran) == {2}  # the sliding layers of every chunk, in two blocks
    ran.clear()
    monkeypatch.setattr(sdpa, "AT_MOST", -1.0)  # no call runs in blocks
    whole = _prefill(model, tokens, kind)
    assert ran == []
    torch.testing.assert_close(blocked, whole, atol=2e-5, rtol=0)
    if not kind:  # every key: the uncached model's logits
        torch.testing.assert_close(blocked, plain, atol=2e-5, rtol=0)


def _llama() -> Any:
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=192, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", [{}, {"bits": 8}])
def test_a_chunked_prefill_of_a_llama_splits_its_late_chunks(kind: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks 3 and 4 of 160 tokens follow 320 and 480 cached ones: split, with the same logits as unsplit."""
    model = _llama()
    tokens = torch.randint(0, 97, (1, CHUNK * 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(tokens).logits[0, -1]
    ran: list[int] = []
    split = sdpa._split_prefix

    def counted(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ran.append(q.shape[2])
        return split(q, *args, **kwargs)

    monkeypatch.setattr(sdpa, "_split_prefix", counted)
    hf.enable(model)
    merged = _prefill(model, tokens, kind)
    assert ran == [CHUNK] * 4  # two chunks, two layers
    monkeypatch.setattr(sdpa, "SPLIT_FROM", 10**6)
    whole = _prefill(model, tokens, kind)
    assert len(ran) == 4
    torch.testing.assert_close(merged, whole, atol=2e-5, rtol=0)
    if not kind:
        torch.testing.assert_close(merged, plain, atol=2e-5, rtol=0)
