"""all-MiniLM-L6-v2 on MultiHeadAttention against sentence-transformers on the same folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from multihead import MultiheadError
from multihead.models import load_sentence_encoder
from tests_support import minilm_dir

pytestmark = pytest.mark.slow  # the real all-MiniLM-L6-v2, and sentence-transformers as the reference

SENTENCES = [
    "A man is eating food.",
    "Multi-head attention runs several attention heads in parallel, each with its own projections, then "
    "concatenates them and projects back.",
    "x",
    "The width is split, not multiplied.",
]


@pytest.fixture(scope="module")
def encoder():  # type: ignore[no-untyped-def]
    return load_sentence_encoder()


@pytest.fixture(scope="module")
def reference():  # type: ignore[no-untyped-def]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu")


def test_embeddings_equal_sentence_transformers(encoder, reference) -> None:  # type: ignore[no-untyped-def]
    ours = encoder.embed(SENTENCES)
    ref = reference.encode(SENTENCES, convert_to_tensor=True)
    assert ours.shape == (4, 384)
    assert (ours - ref).abs().max() <= 1e-5
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(4))


def test_long_text_is_truncated_like_sentence_transformers(encoder, reference) -> None:  # type: ignore[no-untyped-def]
    long_text = " ".join(["attention"] * 400)
    _, _, truncated = encoder.tokenize([long_text, "short"])
    assert truncated == [True, False] and encoder.max_length == 256
    ours = encoder.embed([long_text])
    ref = reference.encode([long_text], convert_to_tensor=True)
    assert (ours - ref).abs().max() <= 1e-5


def test_padding_does_not_change_an_embedding(encoder) -> None:  # type: ignore[no-untyped-def]
    alone = encoder.embed(["x"])
    batched = encoder.embed(["x", SENTENCES[1]])[:1]
    torch.testing.assert_close(alone, batched, atol=1e-6, rtol=1e-6)


def _copy_model(tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(minilm_dir(), target)
    return target


def test_missing_truncated_and_corrupt_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(MultiheadError, match="does not exist"):
        load_sentence_encoder(tmp_path / "nowhere")
    folder = _copy_model(tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    with pytest.raises(MultiheadError, match=r"safetensors file .* is damaged"):
        load_sentence_encoder(folder)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(MultiheadError, match=r"safetensors file .* is damaged"):
        load_sentence_encoder(folder)
    weights.unlink()
    with pytest.raises(MultiheadError, match=r"has no model\.safetensors"):
        load_sentence_encoder(folder)


def test_bad_config_and_tokenizer(tmp_path: Path) -> None:
    folder = _copy_model(tmp_path)
    (folder / "tokenizer.json").write_text("{broken")
    with pytest.raises(MultiheadError, match=r"tokenizer file .* could not be read"):
        load_sentence_encoder(folder)
    (folder / "config.json").write_text('{"model_type": "bert", "hidden_size": 384, "num_attention_heads": 12}')
    with pytest.raises(MultiheadError, match="has no 'vocab_size' field"):
        load_sentence_encoder(folder)
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(MultiheadError, match="describes a 'gpt2' model: supported is bert"):
        load_sentence_encoder(folder)


def test_bad_texts(encoder) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MultiheadError, match="texts is empty"):
        encoder.embed([])
    with pytest.raises(MultiheadError, match="list of strings"):
        encoder.embed("not a list")
