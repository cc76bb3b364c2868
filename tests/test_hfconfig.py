"""The one config.json reader (multihead.hf.config, issue 26 item 4): bounded JSON, file errors in one line, typed and
ranged values, the same for presets, sizing and the loaders, and through `multihead count --config` and
`compare --config` (exit 2, one line naming the file, the key and the value). Also: the layer refuses sizes torch
cannot allocate, and the MiniLM (and Llama) tokenizer is checked against the model's embedding at load."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from multihead import AttentionConfig, MLAConfig, MultiHeadAttention, MultiheadError, MultiHeadLatentAttention
from multihead.cli import main
from multihead.hf.config import MAX_JSON_BYTES, HFConfig, read_config, read_json
from multihead.sizing.presets import from_hf_config, from_hf_dict

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "max_position_embeddings": 128, "rope_theta": 10000.0, "vocab_size": 100,
         "intermediate_size": 96, "tie_word_embeddings": False}


def _write(tmp_path: Path, cfg: dict[str, Any] | str | bytes, name: str = "config.json") -> Path:
    path = tmp_path / name
    if isinstance(cfg, bytes):
        path.write_bytes(cfg)
    else:
        path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return path


def _cli_refuses(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The command exits 2 with one line on stderr matching ``message`` (and no traceback)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    return err


# ---------------------------------------------------------------------------------------------- hostile values
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("rope_theta null", {"rope_theta": None}, r"rope_theta = null: expected a finite number in \(1, 1e\+12\]"),
    ("rope_theta a string", {"rope_theta": "10000"}, r"rope_theta = '10000': expected a finite number"),
    ("rope_theta a list", {"rope_theta": [10000.0]}, r"rope_theta = \[10000\.0\]: expected a finite number"),
    ("rope_theta 10^300", {"rope_theta": 1e300}, r"rope_theta = 1e\+300: expected a finite number in \(1, 1e\+12\]"),
    ("rope_parameters' rope_theta", {"rope_theta": ..., "rope_parameters": {"rope_theta": "x"}},
     r"rope_parameters\.rope_theta = 'x': expected a finite number"),
    ("hidden_size 10^30", {"hidden_size": 10**30},
     r"hidden_size = 1000000000000000000000000000000: expected an integer from 1 to 1,048,576 \(MAX_WIDTH"),
    ("num_hidden_layers 10^30", {"num_hidden_layers": 10**30},
     r"num_hidden_layers = 1000000000000000000000000000000: expected an integer from 1 to 4,096 \(MAX_LAYERS"),
    ("head_dim 10^9", {"head_dim": 10**9},
     r"head_dim = 1000000000: expected an integer from 1 to 1,048,576 \(MAX_WIDTH"),
    ("max_position_embeddings 'abc'", {"max_position_embeddings": "abc"},
     r"max_position_embeddings = 'abc': expected an integer from 1 to 2,147,483,648 \(MAX_CONTEXT"),
    ("max_position_embeddings -1", {"max_position_embeddings": -1}, r"max_position_embeddings = -1: expected an int"),
    ("max_position_embeddings null", {"max_position_embeddings": None},
     r"max_position_embeddings = null: expected an int"),
    ("max_position_embeddings 1e308", {"max_position_embeddings": 1e308},
     r"max_position_embeddings = 1e\+308: expected an int"),
    ("max_position_embeddings 8192.5", {"max_position_embeddings": 8192.5},
     r"max_position_embeddings = 8192\.5: expected an int"),
    ("tie_word_embeddings 'false'", {"tie_word_embeddings": "false"},
     r"tie_word_embeddings = 'false': expected true or false"),
    ("attention_bias 'false'", {"attention_bias": "false"}, r"attention_bias = 'false': expected true or false"),
    ("num_key_value_heads '2'", {"num_key_value_heads": "2"}, r"num_key_value_heads = '2': expected an integer"),
    ("vocab_size 2^64", {"vocab_size": 2**64},
     r"vocab_size = 18446744073709551616: expected an integer from 1 to 16,777,216 \(MAX_VOCAB"),
    ("intermediate_size 0", {"intermediate_size": 0}, r"intermediate_size = 0: expected an integer from 1"),
    ("sliding_window -1", {"sliding_window": -1}, r"sliding_window = -1: expected an integer from 1"),
    ("hidden_size missing", {"hidden_size": ...},
     r"has no d_model: expected one of the fields hidden_size, n_embd, d_model"),
    # sizes each within its bound whose attention no machine holds: 4,096 layers of 2^14 heads of 2^20 on 2^20
    ("attention past 2^61 parameters", {"hidden_size": 1 << 20, "num_attention_heads": 1 << 14,
                                        "num_key_value_heads": 1 << 14, "head_dim": 1 << 20,
                                        "num_hidden_layers": 1 << 12},
     r"4,096 layers of [\d,]+ attention parameters make [\d,]+: past MAX_PARAMETERS \(2\^61"),
]


def _hostile(change: dict[str, Any]) -> dict[str, Any]:
    cfg = {**LLAMA, **change}
    return {k: v for k, v in cfg.items() if v is not ...}


@pytest.mark.parametrize(("change", "message"), [(c, m) for _, c, m in HOSTILE], ids=[n for n, _, _ in HOSTILE])
def test_a_hostile_config_value_is_refused_by_the_reader_naming_the_file_key_and_value(
        tmp_path: Path, change: dict[str, Any], message: str) -> None:
    path = _write(tmp_path, _hostile(change))
    with pytest.raises(MultiheadError, match=message) as info:
        from_hf_config(path)
    assert str(path) in str(info.value)
    with pytest.raises(MultiheadError, match=message):
        from_hf_dict(_hostile(change), name="x")


@pytest.mark.parametrize(("change", "message"), [(c, m) for _, c, m in HOSTILE], ids=[n for n, _, _ in HOSTILE])
@pytest.mark.parametrize("command", ["count", "compare"])
def test_count_and_compare_refuse_a_hostile_config_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, change: dict[str, Any],
        message: str) -> None:
    path = _write(tmp_path, _hostile(change))
    extra = ["--plot", str(tmp_path / "kv.png")] if command == "compare" else []  # the plot reads max_context
    err = _cli_refuses([command, "--config", str(path), "--device-memory", "24GiB", *extra], message, capsys)
    assert str(path) in err
    assert not (tmp_path / "kv.png").exists()


def test_the_sound_config_is_read_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The reference the hostile cases change one value of: it is read, counted and compared (exit 0)."""
    import transformers

    path = _write(tmp_path, LLAMA)
    model = from_hf_config(path)
    assert (model.attention.d_model, model.attention.n_kv_heads, model.n_layers, model.max_context) == (64, 2, 2, 128)
    assert main(["count", "--config", str(path), "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)["whole_model"]
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{k: v for k, v in LLAMA.items() if k != "model_type"}))
    assert whole["total_parameters"] == sum(p.numel() for p in reference.parameters())
    assert main(["compare", "--config", str(path), "--plot", str(tmp_path / "kv.png")]) == 0
    assert (tmp_path / "kv.png").stat().st_size > 0


def test_sizing_fields_are_checked_at_read_time_so_count_refuses_them(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A value only the whole-model count reads (an MoE field) is refused when the file is read, by name, so count
    exits 2 instead of printing a whole-model line that says nothing about the file."""
    cfg = {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 10**30}
    path = _write(tmp_path, cfg)
    message = r"num_experts_per_tok = 1000000000000000000000000000000: expected an integer from 1 to 65,536"
    _cli_refuses(["count", "--config", str(path)], message, capsys)
    cfg["num_experts_per_tok"] = 9  # within its range, but more than the 8 experts a layer has
    with pytest.raises(MultiheadError, match=r"num_experts_per_tok = 9: expected at most the 8 experts a layer has"):
        from multihead.sizing import model_size

        model_size(from_hf_dict(cfg))


def test_a_whole_model_past_the_parameter_bound_is_refused_by_count_not_reported_unavailable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every field in range, the whole model past 2^61 parameters: count exits 2 naming the bound (it printed a
    'whole model: unavailable' line and exited 0), while a family the count does not know is still only said."""
    cfg = {**LLAMA, "model_type": "mixtral", "hidden_size": 1 << 20, "num_attention_heads": 8192,
           "num_key_value_heads": 8192, "num_hidden_layers": 4096, "intermediate_size": 1 << 20,
           "num_local_experts": 1024, "num_experts_per_tok": 2}
    _cli_refuses(["count", "--config", str(_write(tmp_path, cfg))], r"parameters: past MAX_PARAMETERS \(2\^61", capsys)
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    assert main(["count", "--config", str(_write(unknown, {**LLAMA, "model_type": "rwkv"})), "--json"]) == 0
    assert "not counted yet" in json.loads(capsys.readouterr().out)["whole_model"]["unavailable"]


def test_null_means_absent_only_where_transformers_reads_it_so() -> None:
    """head_dim, num_key_value_heads, sliding_window, q_lora_rank, n_inner: null is the default, as in the configs
    transformers writes (Mixtral's head_dim, Qwen2's sliding_window); elsewhere null is refused."""
    import transformers

    for config in (transformers.MixtralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                              num_hidden_layers=2, intermediate_size=32),
                   transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                            num_hidden_layers=2),
                   transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2)):
        cfg = config.to_dict()
        assert None in cfg.values()
        model = from_hf_dict(cfg)
        assert (model.attention.d_model, model.attention.head_dim) == (64, 16)
    with pytest.raises(MultiheadError, match="num_hidden_layers = null"):
        from_hf_dict({**LLAMA, "num_hidden_layers": None})


def test_transformers_5_rope_parameters_give_the_rope_base_presets_and_the_loader_agree_on() -> None:
    """transformers 5 writes rope_theta inside rope_parameters: the reader takes it there (presets read 10000.0 for
    every such config before the readers were one), the same value the Llama loader reads."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0}).to_dict()
    assert "rope_theta" not in cfg
    rope = from_hf_dict(cfg).attention.rope
    assert rope is not None and rope.base == 500000.0
    assert HFConfig(cfg, where="x").rope_theta == 500000.0


# ---------------------------------------------------------------------------------------------- files
FILE_CASES: list[tuple[str, bytes, str]] = [
    ("100,000 deep", b"[" * 100_000 + b"]" * 100_000, r"nests arrays or objects 100,000 deep: more than 100"),
    ("a 2 MB integer", b'{"hidden_size": ' + b"9" * 2_000_000 + b"}",
     r"holds an integer of 2,000,000 digits: more than 64"),
    ("not UTF-8", b'{"model_type": "\xff\xfe"}', r"is not UTF-8 text: byte 0xff at offset 16"),
    ("an array", b"[]", r"must hold a JSON object, not an array"),
    ("null", b"null", r"must hold a JSON object, not null"),
    ("cut", b'{"hidden_size": ', r"is not valid JSON"),
    ("a BOM", b"\xef\xbb\xbf{}", r"is not valid JSON"),
]


@pytest.mark.parametrize(("content", "message"), [(c, m) for _, c, m in FILE_CASES], ids=[n for n, _, _ in FILE_CASES])
def test_a_damaged_config_file_is_one_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      content: bytes, message: str) -> None:
    path = _write(tmp_path, content)
    with pytest.raises(MultiheadError, match=message) as info:
        read_config(path)
    assert f"config file {str(path)!r}" in str(info.value)
    for command in ("count", "compare"):
        _cli_refuses([command, "--config", str(path), "--no-plot"] if command == "compare" else
                     [command, "--config", str(path)], message, capsys)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = json.dumps({"model_type": "[" * 500 + '"{' * 300, "nested": [[[{"a": "]]]"}]]]})
    assert read_json_text(text)["nested"] == [[[{"a": "]]]"}]]]


def read_json_text(text: str) -> Any:
    from multihead.hf.config import parse_json

    return parse_json(text, "text")


def test_missing_folder_fifo_and_oversized_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = []
    cases.append((tmp_path / "nope.json", "does not exist"))
    cases.append((tmp_path, "does not exist"))  # a folder without config.json
    with pytest.raises(MultiheadError, match=r"JSON file '.*' is a folder, not a file"):
        read_json(tmp_path)  # (a config path that is a folder is the folder holding config.json)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    cases.append((fifo, r"is not a file \(a device, pipe or socket\)"))
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: refused by its size before a byte is read
    cases.append((big, r"is 67,108,865 bytes: more than 67,108,864"))
    (tmp_path / "through").write_text("a file, not a folder")
    cases.append((tmp_path / "through" / "config.json", "does not exist"))
    for path, message in cases:
        with pytest.raises(MultiheadError, match=message):
            from_hf_config(path)
        _cli_refuses(["count", "--config", str(path)], message, capsys)


def test_a_file_the_os_refuses_to_read_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/self/mem is a regular file whose read fails with EIO (at offset 0, nothing is mapped); a permission
    error (made by hand: the tests run as root, who may read anything) is reported the same way."""
    if Path("/proc/self/mem").exists():
        _cli_refuses(["count", "--config", "/proc/self/mem"], r"config file '/proc/self/mem' cannot be read: "
                                                              r"Input/output error", capsys)
    path = _write(tmp_path, LLAMA)
    real_open = open

    def refusing_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refusing_open)
    _cli_refuses(["count", "--config", str(path)], rf"config file {re.escape(repr(str(path)))} cannot be read: "
                                                   r"Permission denied", capsys)


def test_the_loaders_read_json_through_the_same_bounds(tmp_path: Path) -> None:
    from multihead.models.loaders import load_llama

    (tmp_path / "config.json").write_bytes(b'{"model_type": "llama", "vocab_size": ' + b"7" * 5000 + b"}")
    with pytest.raises(MultiheadError, match=r"config\.json' holds an integer of 5,000 digits"):
        load_llama(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "rope_theta": None}))
    with pytest.raises(MultiheadError, match=r"config\.json': rope_theta = null: expected a finite number"):
        load_llama(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "tie_word_embeddings": "false"}))
    with pytest.raises(MultiheadError, match=r"tie_word_embeddings = 'false': expected true or false"):
        load_llama(tmp_path)
    assert read_json(tmp_path / "config.json")["model_type"] == "llama"


# ---------------------------------------------------------------------------------------------- layer sizes
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"d_model": 2**64, "n_heads": 1}, r"d_model \(18,446,744,073,709,551,616\) is 2\^60 or more"),
    ({"d_model": 10**400, "n_heads": 1}, r"d_model \(about 2\^1328\) is 2\^60 or more"),
    ({"d_model": 2**40, "n_heads": 1}, r"W_Q would hold d_model x n_heads \* head_dim = 1,099,511,627,776 x "
                                       r"1,099,511,627,776 = [\d,]+ elements: 2\^60 or more"),
    ({"d_model": 64, "n_heads": 4, "kv_dim": 2**59}, r"W_K would hold kv_dim x n_kv_heads \* head_dim"),
    ({"d_model": 64, "n_heads": 2**20, "head_dim": 2**40}, r"W_Q would hold d_model x n_heads \* head_dim"),
], ids=["d_model 2^64", "d_model 10^400", "d_model 2^40", "kv_dim 2^59", "heads x head_dim 2^60"])
def test_the_layer_refuses_sizes_torch_cannot_allocate(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(MultiheadError, match=message):
        AttentionConfig(**kwargs)
    with pytest.raises(MultiheadError, match=message), torch.device("meta"):
        MultiHeadAttention(**kwargs)


def test_the_largest_allocatable_weight_is_still_accepted() -> None:
    """The bound is 2^60 - 1 elements a weight (float64 bytes under 2^63): a layer of 2^59-element weights builds
    (on the meta device, which allocates nothing)."""
    with torch.device("meta"):
        layer = MultiHeadAttention(d_model=2**30, n_heads=1, head_dim=2**29, bias=False)
    assert layer.q_proj.weight.numel() == 2**59


def test_mla_refuses_sizes_torch_cannot_allocate() -> None:
    base = {"n_heads": 16, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    with pytest.raises(MultiheadError, match=r"W_DQ would hold d_model x q_lora_rank"):
        MLAConfig(d_model=2**40, q_lora_rank=2**30, **base)
    with pytest.raises(MultiheadError, match=r"W_Q would hold d_model x n_heads \* \(qk_nope_head_dim"), \
            torch.device("meta"):
        MultiHeadLatentAttention(d_model=2**58, **base)
    with pytest.raises(MultiheadError, match=r"kv_lora_rank \([\d,]+\) is 2\^60 or more"):
        MLAConfig(d_model=64, **{**base, "kv_lora_rank": 2**61})


# ---------------------------------------------------------------------------------------------- tokenizers
def _damaged_bert(tmp_path: Path, damage: Any) -> Path:
    from tests_support import minilm_dir
    from tiny_checkpoints import write_tiny_bert

    folder = write_tiny_bert(tmp_path / "bert", minilm_dir())
    tok = json.loads((folder / "tokenizer.json").read_text())
    damage(tok)
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


def _no_unk(tok: dict[str, Any]) -> None:
    del tok["model"]["vocab"]["[UNK]"]
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "[UNK]"]


def _vocab_past(tok: dict[str, Any]) -> None:
    tok["model"]["vocab"]["hello"] = 30522


def _cls_past(tok: dict[str, Any]) -> None:
    tok["post_processor"]["special_tokens"]["[CLS]"]["ids"] = [40000]


def _added_past(tok: dict[str, Any]) -> None:
    tok["added_tokens"].append({"id": 30522, "special": True, "content": "[NEW]", "single_word": False,
                                "lstrip": False, "rstrip": False, "normalized": False})


@pytest.mark.parametrize(("damage", "message"), [
    (_no_unk, r"its unknown-word token '\[UNK\]' is not in its vocabulary"),
    (_vocab_past, r"token 'hello' has id 30,522, past the model's embedding of 30,522 tokens \(ids 0 to 30,521\)"),
    (_cls_past, r"it adds the special token '\[CLS\]' with id 40,000, past the model's embedding of 30,522 tokens"),
    (_added_past, r"token '\[NEW\]' has id 30,522, past the model's embedding"),  # (refused before too, by count)
], ids=["no [UNK]", "a vocabulary id past the embedding", "[CLS] past the embedding", "an added token past it"])
def test_a_minilm_tokenizer_the_model_cannot_embed_is_refused_at_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Any, message: str) -> None:
    """The first three loaded before and failed at embed (IndexError, or the tokenizer's own exception for a word
    without [UNK]); now the load refuses them, naming the file, the token and the id."""
    from multihead.models.bert import load_sentence_encoder

    folder = _damaged_bert(tmp_path, damage)
    with pytest.raises(MultiheadError, match=message) as info:
        load_sentence_encoder(folder)
    assert f"{str(folder / 'tokenizer.json')!r}" in str(info.value)
    _cli_refuses(["embed", "a text", "--model", str(folder)], message, capsys)


def test_the_sound_minilm_tokenizer_still_loads_and_embeds(tmp_path: Path) -> None:
    from multihead.models.bert import load_sentence_encoder

    folder = _damaged_bert(tmp_path, lambda tok: None)
    assert tuple(load_sentence_encoder(folder).embed(["hello \U0001F600 world"]).shape) == (1, 8)


def test_a_llama_tokenizer_id_past_the_embedding_is_refused_at_load(tmp_path: Path) -> None:
    from multihead.models.loaders import load_llama
    from tiny_checkpoints import write_tiny_hf_llama

    folder = write_tiny_hf_llama(tmp_path / "llama")
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"]["vocab"]["Ġthe"] = 262  # the model embeds 262 tokens: ids 0 to 261
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(MultiheadError, match=r"its tokenizer: token 'Ġthe' has id 262, past the model's embedding "
                                             r"of 262 tokens"):
        load_llama(folder)


def test_a_multimodal_config_is_read_by_its_text_model_with_the_family_defaults_named() -> None:
    """Gemma 3's published multimodal configs leave the heads, head_dim, vocabulary and window of their text_config
    to transformers' Gemma3TextConfig: the reader takes the same defaults (held against transformers' own), lists
    them, and keeps the outer model_type and the parts it does not read."""
    import transformers

    from multihead.hf.config import FAMILY_DEFAULTS
    from multihead.sizing.presets import published

    theirs = transformers.Gemma3TextConfig()
    assert {k: getattr(theirs, k) for k in FAMILY_DEFAULTS["gemma3_text"]} == FAMILY_DEFAULTS["gemma3_text"]
    _, values = published("gemma-3-4b")
    cfg = HFConfig(values, where="gemma-3-4b")
    assert (cfg.container, cfg.towers, cfg.model_type) == ("gemma3", ("vision_config",), "gemma3_text")
    assert cfg.defaulted == {k: v for k, v in FAMILY_DEFAULTS["gemma3_text"].items() if k != "sliding_window"}
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.window) == (8, 4, 256, 262_208, 1024)
    plain = HFConfig(LLAMA, where="llama")
    assert (plain.container, plain.towers, plain.defaulted) == ("", (), {})


def test_a_multimodal_configs_tie_word_embeddings_stands_for_its_text_models_where_that_does_not_say() -> None:
    """transformers ties a multimodal model's LM head by its outer tie_word_embeddings (Mistral3Config's default is
    true); the text_config's own word, where it has one, is what its checkpoint was written with (Mistral Small
    3.1 holds a separate LM head and says nothing at the top), so it is read first."""
    text = {k: v for k, v in LLAMA.items() if k != "tie_word_embeddings"} | {"model_type": "mistral"}
    outer = {"model_type": "mistral3", "tie_word_embeddings": True, "vision_config": {"hidden_size": 32}}
    assert HFConfig({**outer, "text_config": text}, where="m").flag("tie_word_embeddings") is True
    said = HFConfig({**outer, "text_config": {**text, "tie_word_embeddings": False}}, where="m")
    assert said.flag("tie_word_embeddings") is False
    with pytest.raises(MultiheadError, match="tie_word_embeddings = 'yes': expected true or false"):
        HFConfig({**outer, "tie_word_embeddings": "yes", "text_config": text}, where="m")
