"""The command line as a package (issue 26): a command's module loads only when it runs; one --dtype parser; output
into a closed pipe ends quietly; a failed run leaves no folder behind; heads written L0H11; patch shows progress."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multihead import sizing
from multihead.cli import main
from multihead.sizing import cost
from multihead.sizing.presets import preset

PYTHON = [sys.executable, "-c"]


def _run(code: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PYTHON, code], capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload]


def test_help_and_count_load_only_their_own_command() -> None:
    done = _run("import contextlib, io, sys\n"
                "from multihead.cli import main\n"
                "with contextlib.redirect_stdout(io.StringIO()):\n"
                "    try:\n"
                "        main(['--help'])\n"
                "    except SystemExit as done:\n"
                "        assert done.code == 0\n"
                "    assert main(['count', '--preset', 'gpt2', '--seq', '128']) == 0\n"
                "print(sorted(m for m in sys.modules if m.startswith(('multihead.cli.', 'multihead.models', "
                "'multihead.heads', 'transformers', 'tokenizers', 'matplotlib'))))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == str(["multihead.cli.count", "multihead.cli.flags", "multihead.cli.model"])


def test_help_lists_every_command_without_importing_one() -> None:
    done = subprocess.run([sys.executable, "-m", "multihead", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for name in ("heads", "shapes", "count", "compare", "presets", "embed", "generate", "experiment", "check",
                 "patch", "tradeoff", "circuit"):
        assert re.search(rf"^\s+{name}\s+\S", done.stdout, re.M), name


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """`multihead count ... | head -1`: the reader is gone before the output is flushed."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "multihead", "count", "--preset", "gpt2", "--seq", "128"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 1, done.stderr[-2000:]


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "BF16", "torch.bfloat16"])
def test_one_dtype_parser_takes_every_spelling(spelling: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["count", "--preset", "gpt2", "--seq", "128", "--dtype", spelling, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_cache_bytes_per_token_per_layer"] == 2 * 12 * 64 * 2  # K and V, 12 heads of 64, 2 bytes


def test_the_dtype_parser_names_one_type_by_one_name() -> None:
    from multihead.cli import flags

    assert [flags.Dtype()(s) for s in ("float", "fp32", "float32", "half", "float16", "fp16")] == ["fp32"] * 3 + [
        "fp16"] * 3
    assert flags.Dtype(("fp32", "bf16"), many=True)("float32, bfloat16,fp32") == ("fp32", "bf16")
    with pytest.raises(Exception, match="dtype 'fp16' is unknown: choose one of fp32, bf16"):
        flags.Dtype(("fp32", "bf16"))("fp16")


@pytest.mark.parametrize(("argv", "flag"), [
    (["count", "--preset", "gpt2", "--device-memory", "0"], "--device-memory"),
    (["count", "--config", ""], "--config"),
    (["compare", "--config", "", "--no-plot"], "--config"),
    (["count", "--preset", "gpt2", "--weights-dtype", ""], "--weights-dtype"),
    (["count", "--preset", "gpt2", "--seq", "\udcff"], "--seq"),
    (["count", "--preset", "gpt2", "--cache", "window:0"], "--cache"),
    (["tradeoff", "--bits", "3"], "--bits"),
    (["check", "--dtype", ""], "--dtype"),
])
def test_values_once_taken_silently_are_refused_naming_the_flag(argv: list[str], flag: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


def test_a_failed_heads_run_leaves_no_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "report"
    assert main(["heads", "--model", "gpt5", "--out", str(out)]) == 2
    assert "model 'gpt5' does not exist: give one of smollm2, minilm, gemma3" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept"
    kept.mkdir()
    assert main(["heads", "--model", "gpt5", "--out", str(kept)]) == 2
    assert kept.is_dir()  # a folder that was there before stays


def test_the_mla_report_compares_with_the_counted_mha_layer() -> None:
    from multihead import MultiHeadAttention

    mla = preset("deepseek-v3").mla
    assert mla is not None
    mha = MultiHeadAttention(d_model=mla.d_model, n_heads=mla.n_heads, head_dim=mla.v_head_dim, device="meta")
    per_token_layer = (mha.k_proj.out_features + mha.v_proj.out_features) * 2  # bf16
    r = cost.mla_report(mla, n_layers=3, seq=100, batch=2, dtype="bf16")
    assert r["cache_bytes_total"] == mla.latent_dim * 2 * 3 * 100 * 2
    assert r["cache_vs_mha"] == pytest.approx(r["cache_bytes_total"] / (per_token_layer * 3 * 100 * 2))


def test_count_reports_the_whole_model_of_multihead_sizing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["count", "--preset", "llama-3-8b", "--seq", "1024", "--tp", "2", "--device-memory", "24GiB",
                 "--weights-dtype", "q4_1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["whole_model"]
    want = sizing.whole_model(preset("llama-3-8b"), seq=1024, batch=1, dtype="bf16", weights_dtype="q4_1", tp=2,
                              memory=24 * 2**30)
    assert got == want and got["fits"] and got["tp"] == 2


def test_engines_have_one_source() -> None:
    from multihead import names
    from multihead.cli import ENGINES
    from multihead.models import route

    assert ENGINES is names.ENGINES and route.ENGINES is names.ENGINES


def test_patch_names_heads_l0h1_and_shows_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiny_checkpoints import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    argv = ["patch", "--model", str(gguf), "--clean", "abcab", "--corrupt", "abdab", "--answers", "c", "x", "--top",
            "3"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert re.search(r"(L\d+H\d+ = [+-]\d\.\d{3}  ){2}L\d+H\d+ = ", out), out
    assert not re.search(r"\b\d+\.\d+ = ", out), out
    assert "patching and attribution over 1 prompt pair(s)" in err and "1/1" in err
    assert main([*argv[:-2], "--point", "k"]) == 0
    assert re.search(r"L\d+KV\d+ = ", capsys.readouterr().out)
