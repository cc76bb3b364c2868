"""multihead.kernels.cpu's bfloat16 speed path (the split product with the weight as the left operand, the native
kernel) and the opt-in load-following threads: the same tokens and logits within bfloat16 rounding as plain PyTorch, and
under load fewer threads but the same kernels and the same numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from multihead.errors import MultiheadError
from multihead.kernels import cpu
from multihead.layers import linear
from multihead.layers.linear import Linear
from multihead.models.generate import generate_ids
from tests_support import aten_ops, teacher_forced_logits

pytestmark = pytest.mark.usefixtures("two_threads")  # two threads, whatever the machine


@pytest.fixture
def following():  # type: ignore[no-untyped-def]
    """The load-following thread count on for the test (as if two cores were free until a test pins fewer)."""
    cpu.follow_load(True)
    cpu.pin_spare_cores(2)
    yield
    cpu.pin_spare_cores(None)
    cpu.follow_load(None)




@pytest.fixture(scope="module")
def smollm2_bf16():  # type: ignore[no-untyped-def]
    from multihead.models import load_llama

    return load_llama(dtype=torch.bfloat16)[0]


def _teacher_forced_logits(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Logits of a 6-token prompt then one token a step through the cache (the decode path), float32."""
    return teacher_forced_logits(model, ids).float()  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["split", "native"])
def test_smollm2_bf16_decodes_the_same_tokens_and_logits_with_and_without_the_speed_paths(  # type: ignore[no-untyped-def]
        smollm2, smollm2_bf16, kind: str) -> None:
    """Greedy decoding of 8 tokens: the same tokens, up to a near tie (a step where the float32 reference's logits
    for the two paths' tokens differ by less than the two bfloat16 paths' errors together: there the paths may part,
    and from there on they continue different texts). Logits: the bfloat16 model's error to the float32 model (an
    independent reference: same weights, plain float32 products) is at most 1.25x plain bfloat16's plus half a bfloat16
    step of the largest logit. Each projection's output is rounded to bfloat16 either way; the split only changes
    the order of the float32 sums before that rounding, so the two paths differ by bfloat16 rounding steps (2^-8
    relative) carried through 30 layers, not by a different error (on the Xeon of RESULTS.md they came out equal).
    The same for multihead.kernels.native's kernel (float32 sums rounded once), every one-row product through it."""
    ref32, tok = smollm2
    model = smollm2_bf16
    w = model.layers[0].gate_proj.weight
    assert w.dtype == torch.bfloat16
    assert cpu.split_product(1, w, torch.zeros(1, w.shape[1], dtype=torch.bfloat16)) == 2  # the bf16 split is on
    prompt = tok.encode("Once upon a time, in a land far away,")
    cpu.force_product(kind)
    fast = list(generate_ids(model, [prompt], max_new_tokens=8))
    with cpu.disabled():
        plain = list(generate_ids(model, [prompt], max_new_tokens=8))
    ids = torch.tensor([prompt])
    with torch.no_grad(), aten_ops() as ops:  # inference, as decoding runs
        model(ids[:, :1])
    if kind == "split":
        assert "bmm.default" in ops.names  # the split product runs at one row
    else:  # every one-row product ran in the native kernel: no aten product at all
        assert not {"mm.default", "addmm.default", "bmm.default", "mv.default"} & set(ops.names)
    ids = torch.tensor([prompt + [t[0] for t in plain]])  # the prompt and plain's tokens, teacher-forced
    got = _teacher_forced_logits(model, ids)
    with cpu.disabled():
        want = _teacher_forced_logits(model, ids)
        ref = _teacher_forced_logits(ref32, ids)
    err_fast, err_plain = (got - ref).abs().max().item(), (want - ref).abs().max().item()
    half_step = ref.abs().max().item() * 2.0**-9
    assert err_fast <= 1.25 * err_plain + half_step, (err_fast, err_plain, half_step)
    n = min(len(fast), len(plain))
    same = next((i for i, (a, b) in enumerate(zip(fast[:n], plain[:n], strict=True)) if a != b), n)
    assert same < n or len(fast) == len(plain)  # the same tokens, or a first token that differs
    if same < n:  # the greedy texts part only at a near tie
        pos, a, b = len(prompt) - 1 + same, fast[same][0], plain[same][0]
        assert abs(ref[0, pos, a] - ref[0, pos, b]).item() <= err_fast + err_plain, (same, a, b)
    # the top token agrees wherever it is not a near tie: a position where the paths pick different tokens is one
    # where the float32 reference's two logits are closer than the two bfloat16 paths' errors together
    for pos in (got.argmax(-1) != want.argmax(-1)).nonzero()[:, 1].tolist():
        a, b = got[0, pos].argmax().item(), want[0, pos].argmax().item()
        assert abs(ref[0, pos, a] - ref[0, pos, b]).item() <= err_fast + err_plain, (pos, a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("rows", [1, 3, cpu.SPLIT_MAX_ROWS, cpu.SPLIT_MAX_ROWS + 1])
def test_low_precision_split_equals_f_linear_within_rounding(dtype: torch.dtype, rows: int) -> None:
    layer = Linear(384, 192, bias=True, dtype=dtype)
    x = torch.randn(2, rows, 384, dtype=dtype)
    split = 2 if 2 * rows <= cpu.SPLIT_MAX_ROWS else 1
    assert cpu.split_product(2 * rows, layer.weight, x) == split
    got = layer(x)
    want = F.linear(x, layer.weight, layer.bias)
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    # each output rounded once to the dtype: within one rounding step of the float64 product, as F.linear is
    step = torch.finfo(dtype).eps * exact.abs().clamp_min(1.0)
    assert ((got.double() - exact).abs() <= 1.5 * step + 1e-3).all()
    assert ((want.double() - exact).abs() <= 1.5 * step + 1e-3).all()


def test_low_precision_splits_in_two_with_one_thread_and_falls_back_where_it_cannot() -> None:
    w = torch.randn(192, 384, dtype=torch.bfloat16)
    x = torch.randn(1, 384, dtype=torch.bfloat16)
    torch.set_num_threads(1)  # the fixture restores two
    assert cpu.split_product(1, w, x) == 2  # the layout gains with one thread too
    assert cpu.split_product(1, torch.randn(193, 384, dtype=torch.bfloat16), x) == 1  # odd rows: plain
    assert cpu.split_product(1, w, x.float()) == 1  # mixed dtypes: F.linear says what it does with them
    assert cpu.split_product(1, torch.randn(6, 8, dtype=torch.bfloat16), x[:, :8]) == 1  # small: in cache
    assert cpu.split_product(1, w.float(), x.float()) == 1  # float32 with one thread: plain
    with cpu.disabled():
        assert cpu.split_product(1, w, x) == 1


@pytest.mark.usefixtures("following")
def test_the_split_never_follows_the_load_only_the_thread_count_does() -> None:
    w = torch.randn(192, 384)
    x = torch.randn(1, 384)
    assert cpu.free_threads() == 2 and cpu.split_product(1, w, x) == 2
    for spare, threads in [(1.4, 1), (1.6, 2), (0.0, 1), (-3.0, 1), (64.0, 2)]:
        cpu.pin_spare_cores(spare)
        assert cpu.free_threads() == threads
        assert cpu.split_product(1, w, x) == 2  # the blocks are the configured threads', whatever the load
        assert cpu.split_product(1, w.bfloat16(), x.bfloat16()) == 2
    cpu.follow_load(False)  # MULTIHEAD_FOLLOW_LOAD=0: the load is never read
    cpu.pin_spare_cores(0.0)
    assert cpu.free_threads() == 2


@pytest.mark.usefixtures("following")
def test_busy_processes_show_in_the_reading() -> None:
    """The unpinned reading: as many busy processes as the machine has cores leave no core free."""
    cpu.pin_spare_cores(None)
    n = min(os.cpu_count() or 1, 16)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        deadline = time.monotonic() + 5.0
        while cpu.free_threads() != 1 and time.monotonic() < deadline:
            time.sleep(cpu.LOAD_EVERY)
        assert cpu.free_threads() == 1
        assert cpu.split_product(1, torch.randn(192, 384), torch.randn(1, 384)) == 2
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


@pytest.mark.usefixtures("following")
@pytest.mark.parametrize(("readings", "threads"), [
    ([1.0, 0.0, 0.0, 0.0], 2),  # a transient in one reading: every core still free
    ([0.0, 0.0, 1.0, 0.0], 2),
    ([1.0, 1.0, 1.0, 1.0], 1),  # a process runnable in every reading keeps a core busy
    ([2.0, 3.0, 2.0, 2.0], 1),
], ids=["transient-first", "transient-later", "busy", "two-busy"])
def test_a_stale_load_reading_is_taken_afresh_from_several(monkeypatch: pytest.MonkeyPatch, readings: list[float],
                                                           threads: int) -> None:
    """After a pause (a long prefill, another program's turn) one instantaneous reading must not decide the next
    step's threads: the least of several readings does, and between steps a reading moves the average only a little."""
    monkeypatch.setattr(cpu._Load, "cores", staticmethod(lambda: 2))
    load = cpu._Load()  # never read: stale
    fed = [*readings, 1.0]
    taken: list[float] = []
    monkeypatch.setattr(load, "read", lambda: taken.append(fed[len(taken)]) or taken[-1])
    monkeypatch.setattr(cpu, "_load", load)
    cpu.pin_spare_cores(None)
    assert cpu.free_threads() == threads
    assert taken == readings  # STALE_READINGS readings, once
    assert cpu.free_threads() == threads and len(taken) == len(readings)  # fresh: not read again at once
    if threads == 2:  # a fresh average: one more transient a LOAD_EVERY later weighs LOAD_SMOOTHING, not all
        load.at = time.monotonic() - cpu.LOAD_EVERY
        assert cpu.free_threads() == 2 and load.others == pytest.approx(cpu.LOAD_SMOOTHING, rel=0.05)
        assert len(taken) == len(readings) + 1


def test_the_load_is_followed_by_default_and_a_bad_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    cpu.pin_spare_cores(None)
    try:
        for said, on in ((None, True), ("1", True), ("0", False)):
            cpu.follow_load(None)
            if said is None:
                monkeypatch.delenv("MULTIHEAD_FOLLOW_LOAD", raising=False)
            else:
                monkeypatch.setenv("MULTIHEAD_FOLLOW_LOAD", said)
            assert cpu.following_load() is on
        for said in ("yes", "", "2"):
            cpu.follow_load(None)
            monkeypatch.setenv("MULTIHEAD_FOLLOW_LOAD", said)
            with pytest.raises(MultiheadError, match=rf"MULTIHEAD_FOLLOW_LOAD={said!r}: set 1 .* or 0"):
                cpu.following_load()
        monkeypatch.setenv("MULTIHEAD_FOLLOW_LOAD", "0")
        cpu.follow_load(True)  # the call wins over the environment
        assert cpu.following_load()
    finally:
        cpu.follow_load(None)


def test_without_following_the_load_nothing_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu.follow_load(None)
    monkeypatch.setenv("MULTIHEAD_FOLLOW_LOAD", "0")
    monkeypatch.setattr(cpu._Load, "read", staticmethod(lambda: pytest.fail("the load was read")))
    cpu.pin_spare_cores(None)
    try:
        assert not cpu.following_load() and cpu.free_threads() == 2
        with cpu.step_threads() as inside:
            assert inside == 2
        assert not cpu.product_in_one_thread(2, torch.zeros(192, 384, dtype=torch.bfloat16))
    finally:
        cpu.follow_load(None)


@pytest.mark.usefixtures("following")
def test_a_low_precision_split_runs_in_one_thread_where_cores_are_busy_and_the_count_comes_back() -> None:
    layer = Linear(384, 192, dtype=torch.bfloat16)
    x = torch.randn(1, 384, dtype=torch.bfloat16)
    assert not cpu.product_in_one_thread(2, layer.weight)  # two cores free (the fixture)
    free = layer(x)
    cpu.pin_spare_cores(1.0)
    assert cpu.product_in_one_thread(2, layer.weight)
    assert not cpu.product_in_one_thread(1, layer.weight)  # plain F.linear: PyTorch's own threads
    assert not cpu.product_in_one_thread(2, layer.weight.float())  # float32 falls back to F.linear instead
    with cpu.disabled():
        assert not cpu.product_in_one_thread(2, layer.weight)
    seen: list[int] = []
    layer.register_forward_hook(lambda m, i, o: seen.append(torch.get_num_threads()))
    busy = layer(x)
    assert torch.get_num_threads() == 2 and seen == [2]  # the count is back once the product ran
    assert torch.equal(busy, free)  # the same blocks, the same sums


def test_a_low_precision_rms_norm_is_f_rms_norm_within_a_step_and_plain_is_transformers_formula() -> None:
    from multihead.layers.norms import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576) * 0.5 + 1)
    x = (torch.randn(64, 576) * 3).bfloat16()
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    fast = norm(x)
    assert torch.equal(fast, F.rms_norm(x, (576,), norm.weight, 1e-5))
    with cpu.disabled():
        plain = norm(x)
    # within one bfloat16 step (2^-8 relative) of the float64 formula, and no further off than transformers' formula
    assert ((fast.double() - exact).abs() <= 2.0**-8 * exact.abs() + 1e-6).all()
    assert (fast.double() - exact).abs().max() <= (plain.double() - exact).abs().max()
    x32 = x.float()
    want = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(plain, want)  # transformers' LlamaRMSNorm, bit for bit


@pytest.mark.usefixtures("following")
def test_a_model_step_runs_with_the_threads_of_the_free_cores_and_computes_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Following the load changes how many threads a step runs with, never which kernels it runs nor what it
    computes: the decisions key by the configured count, so every step explains the same kernels, and a float32
    product of more than one row (whose sums MKL splits by its thread count: on a 2-core Intel Xeon 13 rows of a
    576 x 576 weight gave other bits in 1 thread than in 2) and PyTorch's float32 decode attention (on an AMD EPYC)
    run with the configured threads. The logits are the same bits, prefill and decode, in both dtypes."""
    from multihead.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                   max_context=64)).eval()
    seen: list[int] = []
    model.layers[1].register_forward_hook(lambda m, i, o: seen.append(torch.get_num_threads()))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        idle = model(ids)  # two cores free (the fixture)
        cpu.pin_spare_cores(1.0)  # one core left by other processes
        loaded = model(ids)
        with cpu.disabled():
            model(ids)
    assert seen == [2, 1, 2] and torch.get_num_threads() == 2
    assert torch.equal(loaded, idle)  # the same kernels, in one thread
    products: list[tuple[int, torch.dtype, int]] = []  # (rows, dtype, threads) of each product a loaded step runs
    attentions: list[tuple[int, torch.dtype, int]] = []  # (rows, dtype, threads) of each SDPA a loaded step runs
    plain, plain_onednn, plain_sdpa = F.linear, linear.onednn_linear, F.scaled_dot_product_attention
    cpu.force_product(None)  # the default rules' products (F.linear, oneDNN's on some CPUs), not the forced split

    def product(run: Any) -> Any:
        return lambda x, w, b=None: (cpu.free_threads() == 1 and products.append(
            (x.numel() // x.shape[-1], w.dtype, torch.get_num_threads()))) or run(x, w, b)

    monkeypatch.setattr(F, "linear", product(plain))
    monkeypatch.setattr(linear, "onednn_linear", product(plain_onednn))
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **kw: (cpu.free_threads() == 1 and (
        attentions.append((q.shape[-2], q.dtype, torch.get_num_threads())))) or plain_sdpa(q, *a, **kw))
    for dtype in (torch.float32, torch.bfloat16):
        big = LlamaModel(LlamaConfig(vocab_size=256, d_model=576, n_layers=2, n_heads=9, n_kv_heads=3,
                                     ffn_dim=1536, max_context=64), dtype=dtype).eval()
        runs, choices = [], []
        for spare in (2.0, 1.0):
            cpu.pin_spare_cores(spare)
            cache = big.new_cache(1, 40)
            with torch.no_grad():
                steps = [big(torch.arange(13)[None] % 256, cache=cache)]
                cache.advance(13)
                for i in range(6):
                    steps.append(big(torch.tensor([[i + 7]]), cache=cache))
                    cache.advance(1)
                h = big.embed(torch.tensor([[3]]))
                with cpu.step_threads():  # a model step's threads, as the forward above ran them
                    choices.append(big.layers[0].attn.explain(h, causal=True, cache=cache.layer(0)))
            runs.append(steps)
        assert choices[0] == choices[1], dtype
        for a, b in zip(*runs, strict=True):  # the prefill, then each decode step
            assert torch.equal(a, b), dtype
    # in a loaded step the float32 products of 13 rows and PyTorch's float32 decode attention ran with the configured
    # two threads (on some CPUs their sums depend on the count); the prefill's attention and bfloat16 in one
    assert {(rows, dtype, threads) for rows, dtype, threads in products if rows > 1} == {
        (13, torch.float32, 2), (13, torch.bfloat16, 1)}
    assert set(attentions) == {(1, torch.float32, 2), (13, torch.float32, 1), (1, torch.bfloat16, 1),
                               (13, torch.bfloat16, 1)}
    cpu.pin_spare_cores(1.0)
    with cpu.step_threads() as inside:
        assert inside == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), cpu.step_threads():
        raise RuntimeError("a layer raised")
    assert torch.get_num_threads() == 2  # given back when the step raises too


def test_a_default_device_changes_no_decision_and_no_bit() -> None:
    """torch.set_default_device (a function mode that only places new tensors) is not a mode that watches the calls:
    the decisions and the logits are those of a process without it; a mode that does watch (here one that sees every
    torch function) still gets PyTorch's plain kernels."""
    from torch.overrides import TorchFunctionMode

    from multihead.models import LlamaConfig, LlamaModel

    class Watching(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=256, d_model=576, n_layers=2, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                                   max_context=64), dtype=torch.bfloat16).eval()

    def decode() -> list[Tensor]:
        cache = model.new_cache(1, 40)
        with torch.no_grad():
            steps = [model(torch.arange(20)[None] % 256, cache=cache)]
            cache.advance(20)
            for i in range(4):
                steps.append(model(torch.tensor([[i + 7]]), cache=cache))
                cache.advance(1)
        return steps

    plain = decode()
    with torch.device("cpu"):
        assert not cpu.in_a_mode()
        placed = decode()
    with Watching():
        assert cpu.in_a_mode()
    assert all(torch.equal(a, b) for a, b in zip(plain, placed, strict=True))
