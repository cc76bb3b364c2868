"""A quantized cache's view read back in few passes (multihead.kernels.dense_view without autograd): the same keys and
values as the reference read (multihead.quant.read_keys / read_values, then the tail), bit for bit, with no
concatenation; the same greedy tokens and logits as the autograd path (concatenated) and the same bytes."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from multihead import quant
from multihead.cache import QuantizedKV, QuantizedKVCache, Slots, unpack
from multihead.kernels import cpu, dense_view
from multihead.models import LlamaConfig, LlamaModel
from multihead.quant import pack, pack_fast, unpack_fast
from multihead.sizing import cost


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_fast_unpack_equals_unpack(bits: int) -> None:
    packed = torch.randint(0, 256, (2, 3, 7, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_fast(packed, bits), unpack(packed, bits))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_fast_pack_equals_pack_for_every_code(bits: int) -> None:
    """Every code in every place of a byte (all 2^bits codes at each of the 8 / bits places), and a strided input."""
    per = 8 // bits
    every = torch.cartesian_prod(*[torch.arange(1 << bits)] * per).to(torch.uint8)  # (2^8, per): every byte
    codes = every.reshape(1, -1).expand(3, -1)  # (3, 256 * per)
    assert torch.equal(pack_fast(codes, bits), pack(codes, bits))
    assert torch.equal(unpack(pack_fast(codes, bits), bits), codes)
    strided = codes.t().contiguous().t()  # the same codes, not contiguous
    assert torch.equal(pack_fast(strided, bits), pack(codes, bits))
    if bits < 8:  # the bytes themselves: code i at bits i * bits ..
        byte = sum(int(every[5, i]) << (i * bits) for i in range(per))
        assert int(pack_fast(every[5], bits)[0]) == byte


def _filled(bits: int, dtype: torch.dtype) -> QuantizedKVCache:
    """A cache holding codes, residual tokens and room for more: 5 chunks of 12 tokens, group 8, residual 8."""
    cache = QuantizedKVCache(batch=2, n_kv_heads=3, head_dim=16, max_len=80, bits=bits, group=8, residual=8,
                             n_layers=2, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        for layer in range(2):
            k, v = (torch.randn(2, 3, 12, 16, generator=g).to(dtype) for _ in range(2))
            cache.update(layer, k, v, Slots(s=12, t=cache.used + 12, positions=None, start=None, aligned=True))
        cache.advance(12)
    assert cache.quantized == 48 and cache.used == 60  # codes and a residual of 12
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_read_equals_the_reference_read_bit_for_bit(bits: int, dtype: torch.dtype) -> None:
    cache = _filled(bits, dtype)
    k, v = (torch.randn(2, 3, 1, 16).to(dtype) for _ in range(2))
    r, n = cache.used - cache.quantized, cache.quantized
    for layer in range(2):
        old_k = quant.read_keys(cache.codes_k[layer], cache.scale_k[layer], cache.min_k[layer], n, bits=bits,
                                group=8, dtype=dtype)
        old_v = quant.read_values(cache.codes_v[layer], cache.scale_v[layer], cache.min_v[layer], n, bits=bits,
                                  group=8, dtype=dtype)
        want_k = torch.cat([old_k, cache.res_k[layer, :, :, :r], k], dim=2)
        want_v = torch.cat([old_v, cache.res_v[layer, :, :, :r], v], dim=2)
        with torch.no_grad():
            view = cache.update(layer, k, v, Slots(s=1, t=61, positions=None, start=None, aligned=True),
                                read_only=True)
            assert isinstance(view, QuantizedKV) and (view.n, view.t) == (48, 61)
            got = dense_view(view)
        assert got.keys.dtype == dtype and torch.equal(got.keys, want_k) and torch.equal(got.values, want_v)


def test_the_read_makes_no_concatenation() -> None:
    """The read-back writes the codes' keys and values into one new tensor each: the native codec's one op a tensor
    where the kernels are built (they are here), PyTorch's one multiply-add a tensor with the fast paths off; never a
    concatenation or a separate multiply and add."""
    cache = _filled(4, torch.float32)
    k = torch.randn(2, 3, 1, 16)
    view = cache.update(0, k, k, Slots(s=1, t=61, positions=None, start=None, aligned=True), read_only=True)
    for fast in (True, False):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            if fast:
                dense_view(view)
            else:
                with cpu.disabled():
                    dense_view(view)
        ops = {e.key: e.count for e in prof.key_averages()}
        read = "multihead::dequantize_into" if fast else "aten::addcmul"
        assert ops.get(read) == 2 and not set(ops) & {"aten::cat", "aten::mul", "aten::add"}, (fast, sorted(ops))


def test_decoding_gives_the_autograd_paths_tokens_and_logits_and_the_same_bytes() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_context=96)
    model = LlamaModel(config).eval()
    prompt = torch.randint(0, 96, (1, 30))

    def decode(grad: bool) -> tuple[list[int], torch.Tensor, int]:
        cache = model.new_cache(1, 60, bits=4, group=8, residual=8)
        with torch.set_grad_enabled(grad):
            logits = model(prompt, cache=cache)
            cache.advance(30)
            tokens, steps = [], []
            for _ in range(12):
                nxt = logits[:, -1:].argmax(-1)
                tokens.append(int(nxt))
                logits = model(nxt, cache=cache)
                cache.advance(1)
                steps.append(logits[0, -1].detach())
        return tokens, torch.stack(steps), cache.bytes

    fast, reference = decode(False), decode(True)  # with autograd the keys need a gradient: read back concatenated
    assert fast[0] == reference[0]
    torch.testing.assert_close(fast[1], reference[1], atol=1e-5, rtol=1e-5)
    assert fast[2] == reference[2] == cost.quantized_cache_bytes(config.attention(), context=60, bits=4, group=8,
                                                                 residual=8, n_layers=2, dtype="fp32")
