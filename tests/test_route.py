"""One model route (multihead.models.route): which engine runs what --model names, decided from the file's own
metadata (a GGUF's general.architecture, a folder's config.json), the same for every command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multihead.errors import MultiheadError
from multihead.models.route import MODEL_NAMES, route


def test_shipped_names_go_to_our_port_where_there_is_one_and_to_transformers_otherwise() -> None:
    smollm2 = route("smollm2")
    assert (smollm2.engine, smollm2.port, smollm2.arch, smollm2.gguf) == ("ours", "llama", "llama", True)
    assert route(None).path == smollm2.path  # the default
    assert route("smollm2", "transformers").engine == "transformers"
    minilm = route("minilm")
    assert (minilm.engine, minilm.port, minilm.arch, minilm.gguf) == ("ours", "bert", "bert", False)
    gemma = route("gemma3")
    assert (gemma.engine, gemma.port, gemma.arch, gemma.gguf) == ("transformers", None, "gemma3", True)
    assert gemma.describe() == ("gemma3 (gemma3 GGUF) on transformers (multihead's attention): multihead has no port "
                                "of gemma3")
    with pytest.raises(MultiheadError, match=r"gemma3 is a gemma3 GGUF: multihead has no port of it .* use --engine "
                                             r"transformers"):
        route("gemma3", "ours")
    # a path is routed by what the file says, not by its name: Gemma's GGUF under another name
    assert route(str(gemma.path)).engine == "transformers" and route(str(smollm2.path)).engine == "ours"
    assert set(MODEL_NAMES) == {"smollm2", "minilm", "gemma3"}


@pytest.mark.parametrize(("model_type", "engine"), [("llama", "ours"), ("qwen2", "transformers"),
                                                    ("gemma3_text", "transformers"), ("bert", "ours")])
def test_a_folder_is_routed_by_its_config(tmp_path: Path, model_type: str, engine: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    found = route(str(tmp_path))
    assert (found.engine, found.arch, found.label) == (engine, model_type, tmp_path.name)


def test_what_cannot_be_routed_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(MultiheadError, match=r"model 'nope/model.gguf' does not exist: give one of smollm2, minilm, "
                                             "gemma3, a .gguf file or a model folder"):
        route("nope/model.gguf")
    text = tmp_path / "weights.bin"
    text.write_bytes(b"\0")
    with pytest.raises(MultiheadError, match=r"is a file but not a \.gguf"):
        route(str(text))
    with pytest.raises(MultiheadError, match=r"has no config\.json"):
        route(str(tmp_path))
    with pytest.raises(MultiheadError, match="engine 'fast' is unknown: choose one of auto, ours, transformers"):
        route("smollm2", "fast")
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF\x03\0\0\0garbage")
    with pytest.raises(MultiheadError, match=r"damaged\.gguf"):
        route(str(damaged))


def test_every_command_that_takes_model_routes_it_the_same_way(capsys: pytest.CaptureFixture[str]) -> None:
    """heads, patch, circuit, generate and tradeoff take the shipped names, refuse a port that does not exist in one
    line naming the architecture, and the short tradeoff (our port's KV heads) sends other models to --long."""
    from multihead.cli import main

    for command in (["heads"], ["patch"], ["circuit"], ["generate", "hello"], ["tradeoff", "--long"]):
        assert main([*command, "--model", "gemma3", "--engine", "ours"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "gemma3 is a gemma3 GGUF: multihead has no port of it" in err, err
    assert main(["tradeoff", "--model", "gemma3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pools, prunes and uptrains multihead's own port's KV heads: gemma3 (gemma3 GGUF) on transformers" in err
    assert main(["generate", "hello", "--model", "minilm"]) == 2
    assert "generate decodes with a causal language model: minilm (bert folder)" in capsys.readouterr().err


def test_embed_and_tune_name_the_port_they_run(capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.cli import main

    assert main(["embed", "hello", "--model", "gemma3"]) == 2
    assert "embed runs multihead's sentence-encoder port (BERT): gemma3 (gemma3 GGUF)" in capsys.readouterr().err
    assert main(["tune", "--model", "minilm"]) == 2
    assert "tune measures the decisions of a decoder's decoding: minilm (bert folder)" in (
        capsys.readouterr().err)
