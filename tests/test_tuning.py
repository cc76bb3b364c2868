"""multihead.kernels.tuning and `multihead tune`: a model's decisions measured once and written to the host's table; the
table read back by the decisions, checked, and a bad file said (never a crash of a forward pass)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from multihead.errors import MultiheadError
from multihead.kernels import cpu, tuning
from multihead.models import LlamaConfig, LlamaModel


def _tiny(dtype: torch.dtype = torch.bfloat16) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=512, d_model=576, n_layers=2, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                                  max_context=512), dtype=dtype).eval()


@pytest.fixture
def table_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MULTIHEAD_TUNING_DIR", str(tmp_path))
    cpu.reload_table()
    yield tmp_path
    monkeypatch.undo()
    cpu.reload_table()


def test_tuning_a_model_writes_every_decision_it_looks_up_and_the_decisions_then_read_them(table_dir: Path) -> None:
    model = _tiny()
    entries = tuning.tune_model(model, lengths=(100, 300), repeats=3, flush=False)
    shapes = {(576, 576), (192, 576), (1536, 576), (576, 1536), (512, 576)}  # q/o, k/v, gate/up, down, the head
    products = {k for k in entries if k.startswith("product")}
    assert {tuple(map(int, k.split()[1].split("x"))) for k in products} == shapes
    attention = {k for k in entries if k.startswith("native-attention")}
    assert attention == {cpu.attention_key("native-attention", 1, 9, 3, torch.bfloat16, t, 2) for t in (100, 300)}
    data = json.loads(cpu.table_path().read_text())
    assert data["entries"] == entries and data["host"] == cpu.host()
    assert set(data["measured"]) == {k for k in entries if not k.endswith(" compiled")}  # (a graph's choice for
    # a "blas" key is the fastest other kind measured for it, no measurement of its own)
    assert cpu.table() == entries  # read back by this process at its next decision
    cpu.force_product(None)
    shape = (576, 576, torch.bfloat16, 1, 2, 2)
    key = cpu.product_key(*shape)
    assert cpu.product_kind(shape, cpu.PRODUCT_KINDS, native_default=False) == entries[key]
    # a second tune merges: what it did not measure stays
    tuning.write_table({key: "linear"})
    assert cpu.table()[key] == "linear" and len(cpu.table()) == len(entries)
    assert tuning.clear_table() and cpu.table() == {} and not tuning.clear_table()


def test_a_transformers_model_is_tuned_for_our_products_in_it_and_the_heads_its_config_names(table_dir: Path
                                                                                            ) -> None:
    """hf.enable makes a transformers model's nn.Linear multihead's Linear: tune measures their shapes as the port's,
    and the decode attention of the heads the caller reads from its config."""
    import transformers

    from multihead import hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512,
                                      tie_word_embeddings=True)
    model = hf.enable(transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval())
    entries = tuning.tune_model(model, lengths=(100, 300), repeats=3, flush=False, heads=[(9, 3, 64)], n_layers=2,
                                write=False)
    shapes = {(576, 576), (192, 576), (1536, 576), (576, 1536), (512, 576)}  # as the port's: the head is tied
    assert {tuple(map(int, k.split()[1].split("x"))) for k in entries if k.startswith("product")} == shapes
    assert {k for k in entries if k.startswith("native-attention")} == {
        cpu.attention_key("native-attention", 1, 9, 3, torch.bfloat16, t, 2) for t in (100, 300)}
    for heads in ([(9, 2, 64)], [], [(9, 3)], [(9, 3, 0)]):
        with pytest.raises(MultiheadError, match=r"heads \(.*\) must be \(h, g, d\) positive ints, g dividing h"):
            tuning.tune_model(model, heads=heads, n_layers=2, write=False)
    assert not cpu.table_path().exists()


def test_the_cli_tunes_a_transformers_folder_on_transformers(table_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.cli import main
    from multihead.cli import tune as tune_cli
    from tiny_checkpoints import write_tiny_hf_qwen2

    assert tune_cli.LENGTHS == tuning.LENGTHS  # the flag's default without importing torch
    folder = write_tiny_hf_qwen2(tmp_path / "qwen2")
    assert main(["tune", "--model", str(folder), "--dtype", "fp32", "--lengths", "64", "--repeats", "3"]) == 0
    said = capsys.readouterr()
    assert f"tuning {folder.name} on transformers" in said.err and "decisions written to" in said.out


def test_bad_arguments_are_refused_by_name(table_dir: Path) -> None:
    model = _tiny(torch.float32)
    with pytest.raises(MultiheadError, match=r"lengths \(\[0\]\) must be positive ints"):
        tuning.tune_model(model, lengths=(0,))
    with pytest.raises(MultiheadError, match=r"batch \(0\)"):
        tuning.tune_model(model, batch=0)
    with cpu.disabled(), pytest.raises(MultiheadError, match="nothing to tune"):
        tuning.tune_model(model)
    with pytest.raises(MultiheadError, match="no multihead Linear or attention layer"):
        tuning.tune_model(torch.nn.Sequential(torch.nn.ReLU()))
    with pytest.raises(MultiheadError, match=r"entry 'product 1x1' holds 'fast': it must be one of linear, mv"):
        tuning.write_table({"product 1x1": "fast"})
    with pytest.raises(MultiheadError, match=r"entry 'speed x' names no decision"):
        tuning.write_table({"speed x": "linear"})
    assert not cpu.table_path().exists()  # nothing written


@pytest.mark.parametrize(("text", "said"), [
    ("{not json", "not valid JSON"),
    ('{"format": "multihead-tuning", "version": 99, "entries": {}}', "not a multihead tuning table of version 1"),
    ('{"format": "multihead-tuning", "version": 1, "entries": {"product 1x1": 3}}', "holds 3: it must be one of"),
    ('{"format": "multihead-tuning", "version": 1, "entries": []}', "'entries' must be an object"),
    ("[1, 2]", "must hold a JSON object"),
], ids=["not-json", "version", "bad-kind", "entries-list", "array"])
@pytest.mark.slow  # child processes that build or load torch: seconds each
def test_a_bad_table_is_said_once_and_the_rules_decide(table_dir: Path, text: str, said: str) -> None:
    """A forward pass never fails on the cache folder's file: a warning names the file and what is wrong, and the
    default rules decide; `multihead tune --show` refuses it with the same words (exit 2, one line)."""
    cpu.table_path().parent.mkdir(parents=True, exist_ok=True)
    cpu.table_path().write_text(text)
    cpu.reload_table()
    with pytest.warns(UserWarning, match=said):
        assert cpu.table() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.table() == {}  # read once: not said again
    done = subprocess.run([sys.executable, "-m", "multihead", "tune", "--show"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MULTIHEAD_TUNING_DIR": str(table_dir)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("multihead tune: error: ") and said in done.stderr


@pytest.mark.slow  # child processes that build or load torch: seconds each
def test_the_cli_shows_and_clears_the_table_and_refuses_bad_flags(table_dir: Path) -> None:
    env = {**os.environ, "MULTIHEAD_TUNING_DIR": str(table_dir)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "multihead", "tune", *args], capture_output=True, text=True,
                              timeout=120, env=env)

    shown = json.loads(cli("--show", "--json").stdout)
    assert shown["entries"] == {} and shown["host"] == cpu.host() and set(shown["defaults"]) == set(cpu.DEFAULTS)
    tuning.write_table({cpu.product_key(576, 576, torch.bfloat16, 1, 2, 2): "blas"})
    text = cli("--show").stdout
    assert f"tuning table: {cpu.table_path()}" in text and "product 576x576 bfloat16 rows=1 blocks=2" in text
    assert json.loads(cli("--clear", "--json").stdout)["removed"] is True and not cpu.table_path().exists()
    for args, said in ((("--show", "--clear"), "--show and --clear do not go together"),
                       (("--lengths", "0"), "--lengths"), (("--repeats", "2"), "--repeats"),
                       (("--dtype", "fp16"), "--dtype")):
        done = cli(*args)
        assert done.returncode == 2 and said in done.stderr and done.stderr.count("\n") == 1, (args, done.stderr)


@pytest.mark.slow
def test_the_cli_tunes_smollm2_and_a_decode_reads_what_it_wrote(table_dir: Path) -> None:
    env = {**os.environ, "MULTIHEAD_TUNING_DIR": str(table_dir)}
    done = subprocess.run([sys.executable, "-m", "multihead", "tune", "--dtype", "bf16", "--lengths", "64",
                           "--repeats", "3", "--json"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["path"] == str(cpu.table_path()) and len(out["entries"]) >= 6
    assert json.loads(cpu.table_path().read_text())["entries"] == out["entries"]


def test_a_float32_model_is_tuned_for_its_prefills_products_too(table_dir: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """A float32 model's table also holds each weight shape's prefill product (512 rows: F.linear, MKL's, against
    oneDNN's matmul), under the one key every prefill's rows share, and a prefill then runs the kind it holds."""
    from multihead.layers import linear as linear_module

    model = _tiny(torch.float32)
    entries = tuning.tune_model(model, lengths=(100,), repeats=3, flush=False)
    threads = cpu.intra_op_threads()
    shapes = {(576, 576), (192, 576), (1536, 576), (576, 1536), (512, 576)}
    prefill = {k: v for k, v in entries.items() if " rows=65+ " in k}
    assert set(prefill) == {cpu.product_key(o, i, torch.float32, 512, 1, threads) for o, i in shapes}
    assert set(prefill.values()) <= {"linear", "onednn"}
    measured = json.loads(cpu.table_path().read_text())["measured"]
    assert all(set(measured[k]) == {"linear", "onednn"} for k in prefill)
    cpu.force_product(None)
    key = cpu.product_key(1536, 576, torch.float32, 512, 1, threads)
    calls: list[int] = []
    plain = linear_module.onednn_linear
    monkeypatch.setattr(linear_module, "onednn_linear", lambda x, w, b: calls.append(x.shape[0]) or plain(x, w, b))
    for kind in ("onednn", "linear"):
        tuning.write_table({key: kind})
        calls.clear()
        with torch.no_grad():
            linear_module.linear(torch.randn(300, 576), torch.randn(1536, 576))
        assert calls == ([300] if kind == "onednn" else [])
