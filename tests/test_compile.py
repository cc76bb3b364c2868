"""The layer compiles with fullgraph=True (no graph breaks) on the fused path and gives the eager result."""

from __future__ import annotations

import pytest
import torch

from multihead import MultiHeadAttention


@pytest.mark.slow
def test_fused_path_compiles_fullgraph() -> None:
    torch._dynamo.reset()
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2, rope=10000.0).eval()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(2, 9, 32)
    keep = torch.rand(2, 1, 9, 9) < 0.7
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 6:] = False
    with torch.no_grad():
        for kwargs in [dict(causal=True), dict(mask=keep), dict(key_padding_mask=valid, causal=True)]:
            torch.testing.assert_close(compiled(x, **kwargs), layer(x, **kwargs), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_flex_path_compiles_fullgraph_inside_a_compiled_model() -> None:
    """Inside a compiled region the block mask is built in the graph and flex attention is traced directly."""
    torch._dynamo.reset()
    layer = MultiHeadAttention(d_model=32, n_heads=4, n_kv_heads=2, window=40, backend="flex").eval()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(2, 256, 32)
    docs = torch.zeros(2, 256, dtype=torch.long)
    docs[:, 100:] = 1
    with torch.no_grad():
        got = compiled(x, causal=True, documents=docs)
        want = layer(x, causal=True, documents=docs, backend="math")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.usefixtures("two_threads")  # the split product where a decode row's product may choose
def test_a_transformers_model_on_our_attention_and_products_compiles_whole_over_its_static_cache() -> None:
    """transformers' compiled decoding (its StaticCache, explicit cache positions) with multihead's attention and
    products traces as one graph (fullgraph=True) and decodes transformers' own logits (its sdpa and nn.Linear, the
    model before hf.enable), step by step. multihead's own caches do not take this path: their view rides on the
    keys tensor (multihead.hf.cache says so, is_compileable False)."""
    import transformers

    from multihead import hf

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(1))

    def decode(forward) -> torch.Tensor:  # type: ignore[no-untyped-def]
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        out = []
        with torch.no_grad():
            model(ids[:, :8], cache=cache)
            for i in range(8, 12):
                at = torch.tensor([i])
                out.append(forward(ids[:, i:i + 1], cache=cache, cache_position=at, position_ids=at[None]).logits)
        return torch.cat(out, dim=1)

    model.set_attn_implementation("sdpa")
    want = decode(model.forward)
    hf.enable(model)
    assert type(model.model.layers[0].mlp.up_proj) is not torch.nn.Linear  # multihead's products
    got = decode(torch.compile(model.forward, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
