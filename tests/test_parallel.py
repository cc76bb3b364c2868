"""Tensor parallelism across processes (gloo on CPU, launched by torchrun): outputs equal one process, each rank
holds 1/world of the weights and cache, bad world sizes and failing ranks end promptly with clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
TIMEOUT = 300  # seconds: a hang fails the test instead of blocking the suite


def torchrun(n: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           *args], capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=HERE)


@pytest.mark.slow  # child processes that build or load torch: seconds each
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_layers_equal_the_whole_layer_and_hold_a_share(world: int) -> None:
    done = torchrun(world, str(HERE / "parallel_worker.py"), "layer")
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-3000:]  # stdout: how far each rank got
    assert done.stdout.count(" ok,") >= world  # every rank checked at least one configuration
    assert done.stdout.count(": left the group") == world


def test_generate_tp3_gives_the_tokens_of_one_process(smollm2) -> None:  # type: ignore[no-untyped-def]
    from multihead.models.generate import generate_ids

    model, tok = smollm2
    prompt = "The capital of France is"
    want = [t for s in generate_ids(model, [tok.encode(prompt)], max_new_tokens=8) for t in s]
    done = torchrun(3, "-m", "multihead", "generate", prompt, "--tp", "3", "--max-new-tokens", "8", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    assert json.loads(lines[0])["tokens"] == want


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4, 6])
def test_embed_tp_equals_one_process(world: int) -> None:
    from multihead.models import load_sentence_encoder

    texts = ["A man is eating food.", "Heads split the width, they do not multiply it."]
    want = load_sentence_encoder().embed(texts)
    done = torchrun(world, "-m", "multihead", "embed", *texts, "--tp", str(world), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("{")))
    got = torch.tensor([e["embedding"] for e in data["embeddings"]])
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.slow
def test_a_world_size_that_does_not_divide_the_kv_heads_is_refused() -> None:
    done = torchrun(2, "-m", "multihead", "generate", "hi", "--tp", "2")
    assert done.returncode != 0
    assert ("cannot split n_heads (9), n_kv_heads (3), ffn_dim (1536) over 2 processes: valid world sizes are 1, 3"
            in done.stderr)
    assert "Traceback" not in done.stderr.split("multihead generate: error")[0][-500:]


def test_tp_without_a_launcher_says_how_to_launch(capsys: pytest.CaptureFixture[str]) -> None:
    from multihead.cli import main

    env = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK") if k in os.environ}
    try:
        assert main(["embed", "hi", "--tp", "2"]) == 2
    finally:
        os.environ.update(env)
    assert "run under torchrun --nproc-per-node 2" in capsys.readouterr().err


@pytest.mark.slow  # child processes that build or load torch: seconds each
def test_a_failing_rank_fails_the_run_promptly() -> None:
    start = time.monotonic()
    done = torchrun(2, str(HERE / "parallel_worker.py"), "fail")
    assert done.returncode != 0
    assert "rank 1 fails on purpose" in done.stderr
    assert time.monotonic() - start < TIMEOUT / 2


def test_finish_without_a_process_group_does_nothing() -> None:
    import torch.distributed as dist

    from multihead.layers import parallel

    assert not dist.is_initialized()
    parallel.finish()  # the CLI calls it after every run, --tp or not
    assert not dist.is_initialized()


def test_leave_flushes_what_is_buffered_and_exits_with_the_status() -> None:
    code = ("import sys; from multihead.layers import parallel; sys.stdout.write('unflushed out'); "
            "sys.stderr.write('unflushed err'); parallel.leave(3)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONUNBUFFERED": ""})
    assert (done.returncode, done.stdout, done.stderr) == (3, "unflushed out", "unflushed err")


def test_check_world_size_names_the_valid_ones() -> None:
    from multihead import MultiheadError
    from multihead.layers.parallel import check_world_size, valid_world_sizes

    assert valid_world_sizes(12, 12, 1536) == [1, 2, 3, 4, 6, 12]
    with pytest.raises(MultiheadError, match=r"over 5 processes: valid world sizes are 1, 2, 4, 8"):
        check_world_size(5, n_heads=32, n_kv_heads=8)
