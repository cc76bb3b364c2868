"""multihead.sizing.compare: the MLA variant it adds to a model's comparison."""

from __future__ import annotations

import pytest

from multihead import AttentionConfig
from multihead.sizing import compare
from multihead.sizing.presets import ModelConfig


def _model(n_heads: int, head_dim: int = 16) -> ModelConfig:
    return ModelConfig(name="tiny", attention=AttentionConfig(d_model=n_heads * head_dim, n_heads=n_heads),
                       n_layers=2, causal=True)


@pytest.mark.parametrize("n_heads", [1, 2])
def test_no_mla_variant_where_a_latent_of_4_head_dims_would_compress_nothing(n_heads: int) -> None:
    # K and V of n_heads heads are 2 * n_heads * head_dim wide: not wider than a latent of 4 * head_dim
    assert compare.model_mla(_model(n_heads)) is None
    assert not any(r.variant.startswith("MLA") for r in compare.compare_variants(_model(n_heads), seq=8))


def test_the_mla_variant_has_deepseeks_proportions() -> None:
    mla = compare.model_mla(_model(4, head_dim=16))
    assert mla is not None
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim) == (64, 8, 16, 16)
    rows = compare.compare_variants(_model(4, head_dim=16), seq=8)
    assert rows[-1].variant == "MLA (r 64, rope 8)"
    assert rows[-1].kv_bytes_per_token == (64 + 8) * 2 * 2  # latent and RoPE key, bf16, 2 layers


def test_an_unexpected_error_building_the_mla_variant_surfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**_: object) -> None:
        raise RuntimeError("a bug in MLAConfig")

    monkeypatch.setattr(compare, "MLAConfig", broken)
    with pytest.raises(RuntimeError, match="a bug in MLAConfig"):
        compare.model_mla(_model(4))
