"""The speed of multihead against its anchors, measured side by side (``make bench``, ``benchmarks/cpu.py``,
``benchmarks/gpu.py``). Kept out of the installed package: the targets and anchors are the project's, not a user's.

Every comparison runs multihead and its anchor in one process, alternating, and reports the ratio of the medians
(absolute times on shared machines are noisy; the ratio is what is compared with the target). Each benchmark runs in
a fresh process of its own, so that what an earlier one allocated cannot move its figures. P1-P3 also give the page
faults per call of each side: with glibc's malloc an eager anchor's large temporaries (the (s, t) scores, repeated
K/V) are mapped afresh and fault their pages in, often at every call; on the machine of benchmarks/RESULTS.md that
was 98,000 faults per P2 eager step and 70,000 per P1 call of nn.MultiheadAttention, and P3's anchor ran at about 5
or about 18 ms per step as the allocator's state went (so it now writes into buffers made once). The faults say what a
run paid for fresh memory.

CPU, float32 (P1-P5):

- P1 layer inference, d_model 768, 12 heads, batch 4, 1024 tokens: time / torch.nn.MultiheadAttention's fast path.
- P2 training step (forward + backward), 512 tokens, causal: time / nn.MultiheadAttention, and time / an eager
  attention that repeats K/V (the common Hugging Face eager path, :func:`multihead.verify.check.plain_layer`).
- P3 GQA decode step (9 query heads, 3 KV heads, head_dim 64, 4096 cached tokens): speed-up over repeating K/V.
- P4 a 16k-token causal forward: peak memory over the bytes of Q, K, V and the output.
- P5 attention core throughput as a share of the float32 matmul rate measured in the same run.

GPU, bfloat16 (G1-G4, where CUDA is present):

- G1 prefill forward, head_dim 128, 16k tokens per batch: TFLOP/s / the best of PyTorch's SDPA backends.
- G2 forward + backward, same shapes.
- G3 GQA decode (batch 8, 32k cached, 32 query / 8 KV heads, head_dim 128): TB/s of KV read / the device copy rate.
- G4 GQA prefill with padding and causal masks (batch 4, 4096 tokens, 32/8 heads): speed-up over SDPA given the
  dense boolean mask.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.cache import DenseKV, KVCache
from multihead.errors import MultiheadError
from multihead.kernels import AttentionCall, attend
from multihead.layers.attention import MultiHeadAttention
from multihead.layers.masks import build_mask
from multihead.verify.check import plain_layer

CPU_BENCHMARKS = ("P1", "P2", "P3", "P4", "P5")
GPU_BENCHMARKS = ("G1", "G2", "G3", "G4")


@dataclass(frozen=True)
class Result:
    """One benchmark line: what was compared, both measurements, the ratio and whether it meets the target."""

    name: str
    what: str
    anchor: str
    ours: str
    theirs: str
    ratio: str
    target: str
    met: bool
    note: str = ""


def machine() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), cores, and the GPU if any."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{name}, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


def header(kind: str, repeats: int) -> str:
    return (f"machine: {machine()}; torch {torch.__version__}; {kind}; median of {repeats} alternating repeats; "
            f"{datetime.date.today()}")


def alternate(a: Callable[[], object], b: Callable[[], object], repeats: int,
              sync: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """Median seconds of a and of b, run alternately after one warm-up each."""
    a(), b()
    sync()
    ta, tb = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        a()
        sync()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        b()
        sync()
        tb.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def page_faults(fn: Callable[[], object], repeats: int = 3) -> int | None:
    """Median minor page faults of one call of fn (pages the allocator handed out fresh), or None where unknown."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    counts = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return int(statistics.median(counts))


def faults_note(ours: Callable[[], object], anchor: Callable[[], object]) -> str:
    """Page faults per call of each side: large fresh allocations fault their pages in, which costs time (glibc's
    malloc maps big blocks afresh, so an eager anchor's (s, t) scores or repeated K/V can cost more in faults than
    in arithmetic, and how much depends on the allocator's state)."""
    a, b = page_faults(ours), page_faults(anchor)
    return "" if a is None or b is None else f"page faults per call: multihead {a:,}, anchor {b:,}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


# ---------------------------------------------------------------------------------------------- CPU
def p1(repeats: int) -> Result:
    torch.manual_seed(0)
    anchor = nn.MultiheadAttention(768, 12, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(anchor).eval()
    x = torch.randn(4, 1024, 768)
    with torch.no_grad():
        t_ours, t_anchor = alternate(lambda: ours(x), lambda: anchor(x, x, x, need_weights=False), repeats)
        note = faults_note(lambda: ours(x), lambda: anchor(x, x, x, need_weights=False))
    r = t_ours / t_anchor
    return Result("P1", "inference d768 h12 b4 s1024", "nn.MultiheadAttention (fast path)", _ms(t_ours),
                  _ms(t_anchor), f"{r:.2f}x time", "<= 0.70x", r <= 0.70, note)


def p2(repeats: int) -> list[Result]:
    torch.manual_seed(0)
    anchor = nn.MultiheadAttention(768, 12, batch_first=True)
    ours = MultiHeadAttention.from_torch(anchor)
    x = torch.randn(4, 512, 768, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(512)

    def step_ours() -> None:
        ours(x, causal=True).sum().backward()

    def step_anchor() -> None:
        anchor(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0].sum().backward()

    def step_eager() -> None:
        plain_layer(ours, x, None, True).sum().backward()

    t_ours, t_anchor = alternate(step_ours, step_anchor, repeats)
    t_ours2, t_eager = alternate(step_ours, step_eager, repeats)
    r1, r2 = t_ours / t_anchor, t_ours2 / t_eager
    what = "train step d768 h12 b4 s512 causal"
    return [Result("P2", what, "nn.MultiheadAttention", _ms(t_ours), _ms(t_anchor), f"{r1:.2f}x time", "<= 1.0x",
                   r1 <= 1.0, faults_note(step_ours, step_anchor)),
            Result("P2", what, "eager, K/V repeated", _ms(t_ours2), _ms(t_eager), f"{r2:.2f}x time", "<= 0.5x",
                   r2 <= 0.5, faults_note(step_ours, step_eager))]


@dataclass
class DecodeCase:
    """P3's decode step: a SmolLM2-shaped GQA layer (9 query heads, 3 KV heads, head_dim 64) with 4096 tokens cached,
    multihead's step and the anchor's, both returning the layer's output for the new token."""

    layer: MultiHeadAttention
    x: Tensor  # (1, 1, 576), the new token
    cache: KVCache
    ours: Callable[[], Tensor]
    anchor: Callable[[], Tensor]


def decode_case(cached: int = 4096) -> DecodeCase:
    torch.manual_seed(0)
    layer = MultiHeadAttention(d_model=576, n_heads=9, n_kv_heads=3, bias=False).eval()
    cache = KVCache(batch=1, n_kv_heads=3, head_dim=64, max_len=cached + 1)
    x = torch.randn(1, 1, 576)
    k_all = torch.randn(1, 3, cached + 1, 64)
    v_all = torch.randn(1, 3, cached + 1, 64)
    cache.k[0].copy_(k_all)
    cache.v[0].copy_(v_all)
    cache.advance(cached)

    def ours() -> Tensor:
        y: Tensor = layer(x, causal=True, cache=cache.layer(0))  # writes slot 4096, attends to 4097 keys; not advanced
        return y

    # The anchor at its best: its concatenated and repeated K/V are written into buffers made once, so it pays for
    # the copies but not for fresh pages (with glibc's malloc, tensors of these sizes were mapped afresh at every
    # step in some processes and not in others: 6,000 page faults and 18.9 ms per step against 0 and 4-5.5 ms).
    k_cat, v_cat = torch.empty(1, 3, cached + 1, 64), torch.empty(1, 3, cached + 1, 64)
    k_rep, v_rep = torch.empty(1, 9, cached + 1, 64), torch.empty(1, 9, cached + 1, 64)

    def anchor() -> Tensor:
        q = layer.q_proj(x).view(1, 1, 9, 64).transpose(1, 2)
        torch.cat([k_all[:, :, :cached], layer.k_proj(x).view(1, 1, 3, 64).transpose(1, 2)], 2, out=k_cat)
        torch.cat([v_all[:, :, :cached], layer.v_proj(x).view(1, 1, 3, 64).transpose(1, 2)], 2, out=v_cat)
        for cat, rep in ((k_cat, k_rep), (v_cat, v_rep)):  # repeat_interleave(3, 1), into the buffer
            rep.view(1, 3, 3, cached + 1, 64).copy_(cat[:, :, None].expand(1, 3, 3, cached + 1, 64))
        out = F.scaled_dot_product_attention(q, k_rep, v_rep)
        y: Tensor = layer.o_proj(out.transpose(1, 2).reshape(1, 1, 576))
        return y

    return DecodeCase(layer, x, cache, ours, anchor)


def p3(repeats: int) -> Result:
    case = decode_case()
    with torch.no_grad():
        torch.testing.assert_close(case.ours(), case.anchor(), atol=1e-5, rtol=1e-4)  # the same step, or no comparison
        t_ours, t_rep = alternate(case.ours, case.anchor, repeats * 20)
        note = faults_note(case.ours, case.anchor)
    r = t_rep / t_ours
    return Result("P3", "GQA decode step 9/3 heads d64, 4096 cached", "K/V repeated per step",
                  f"{t_ours * 1e6:.0f} us", f"{t_rep * 1e6:.0f} us", f"{r:.2f}x faster", ">= 3x faster", r >= 3.0,
                  note)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size (Linux >= 4.0)


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak memory allocated while fn runs, above what was held before it (its result kept until the end)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        del out
        return torch.cuda.max_memory_allocated() - before
    gc.collect()  # garbage freed during fn would hide fn's own pages from the peak
    _reset_peak_rss()
    before = _rss()
    out = fn()
    peak = _peak_rss()
    del out
    return peak - before


def p4(device: str = "cpu", dtype: torch.dtype = torch.float32, tokens: int = 16384) -> Result:
    """Peak memory of a causal forward over ``tokens`` tokens, over the bytes of Q, K, V and the output."""
    torch.manual_seed(0)
    d_model, heads = 768, 12
    layer = MultiHeadAttention(d_model=d_model, n_heads=heads, bias=False, device=device, dtype=dtype).eval()
    x = torch.randn(1, tokens, d_model, device=device, dtype=dtype)
    with torch.no_grad():
        layer(x[:, :256], causal=True)  # warm-up: kernels and thread pools allocated before measuring
        try:
            extra = peak_extra_bytes(lambda: layer(x, causal=True), torch.device(device))
        except OSError as e:
            return Result("P4", f"{tokens}-token causal forward d768 h12", "bytes of Q, K, V and output",
                          "unmeasured", "-", f"peak memory unavailable here ({e})", "<= 1.25x", False)
    qkvo = 4 * tokens * d_model * x.element_size()
    r = extra / qkvo
    return Result("P4", f"{tokens}-token causal forward d768 h12", "bytes of Q, K, V and output",
                  f"{extra / 2**20:.0f} MiB peak", f"{qkvo / 2**20:.0f} MiB", f"{r:.2f}x", "<= 1.25x", r <= 1.25)


def in_fresh_process(name: str, repeats: int) -> list[Result]:
    """Benchmark ``name`` (P1-P5) in a new Python process: what an earlier benchmark allocated, freed or left in the
    allocator's state cannot move this one's figures (P4's peak memory, the anchors' page faults)."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            "import json, dataclasses, torch; import bench; "
            f"torch.set_num_threads({torch.get_num_threads()}); "
            f"print(json.dumps([dataclasses.asdict(r) for r in bench.run_cpu({repeats}, ({name!r},), fresh=False)]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise MultiheadError(f"{name} failed in its process: {done.stderr.strip().splitlines()[-1:]}")
    return [Result(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def p5(repeats: int) -> Result:
    torch.manual_seed(0)
    b, h, s, d = 4, 12, 1024, 64
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    a, m = torch.randn(2048, 2048), torch.randn(2048, 2048)
    spec = build_mask(batch=b, n_heads=h, s=s, t=s)
    with torch.no_grad():
        t_attn, t_mm = alternate(lambda: attend(AttentionCall(q, DenseKV(k, v), spec, scale=d**-0.5)),
                                 lambda: a @ m, repeats)
    attn_rate = 4 * b * h * s * s * d / t_attn  # QK^T and PV, 2 FLOPs per multiply-add
    mm_rate = 2 * 2048**3 / t_mm
    r = attn_rate / mm_rate
    return Result("P5", "attention core b4 h12 s1024 d64", "fp32 matmul 2048^3", f"{attn_rate / 1e9:.1f} GFLOP/s",
                  f"{mm_rate / 1e9:.1f} GFLOP/s", f"{r:.0%} of matmul", ">= 60%", r >= 0.60)


def run_cpu(repeats: int = 5, only: tuple[str, ...] = CPU_BENCHMARKS, *, fresh: bool = True) -> list[Result]:
    """P1-P5 (those in ``only``, in that order), each in a fresh process unless ``fresh=False``."""
    unknown = [n for n in only if n not in CPU_BENCHMARKS]
    if unknown:
        raise MultiheadError(f"unknown CPU benchmark(s) {', '.join(unknown)}: choose from {', '.join(CPU_BENCHMARKS)}")
    results: list[Result] = []
    for name in only:
        if fresh:
            results.extend(in_fresh_process(name, repeats))
        elif name == "P1":
            results.append(p1(repeats))
        elif name == "P2":
            results.extend(p2(repeats))
        elif name == "P3":
            results.append(p3(repeats))
        elif name == "P4":
            results.append(p4())
        elif name == "P5":
            results.append(p5(repeats))
    return results


# ---------------------------------------------------------------------------------------------- GPU
def _device_time(fn: Callable[[], object], repeats: int, device: str = "cuda") -> float:
    """Median seconds of fn on the GPU, timed with CUDA events after a warm-up (on the CPU, with the clock: the
    GPU benchmarks' code is exercised there at a tiny size)."""
    if device != "cuda":
        return alternate(fn, lambda: None, repeats)[0]
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return statistics.median(times)


def _best_sdpa(fn: Callable[[], object], repeats: int, device: str) -> tuple[float, str]:
    """The fastest of PyTorch's fused SDPA backends for fn (each tried alone), and its name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best, name = float("inf"), "none"
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                t = _device_time(fn, repeats, device)
        except RuntimeError:  # the backend does not support these inputs
            continue
        if t < best:
            best, name = t, backend.name.lower()
    return best, name


def _attention_kernels(fn: Callable[[], object]) -> str:
    """The GPU kernels of one call of fn whose names say attention (flash, fmha, cudnn, ...), for the record."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    words = ("flash", "fmha", "cudnn", "attention", "attn", "sdpa")
    names = sorted({e.key for e in prof.key_averages() if any(w in e.key.lower() for w in words)})
    return ", ".join(n[:80] for n in names) or "none named"


def _cudnn_first(fn: Callable[[], object], repeats: int) -> float:
    """fn's time with SDPA's cuDNN backend put first in PyTorch's priority list (the others behind it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        return _device_time(fn, repeats)


def _prefill(repeats: int, backward: bool, device: str = "cuda", tiny: int = 1) -> Result:
    b, h, s, d = 8 // tiny, 16 // tiny, 2048 // tiny, 128  # 16k tokens per batch, FlashAttention's benchmark shape
    dev, dt = device, torch.bfloat16
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dt, requires_grad=backward) for _ in range(3))
    grad = torch.randn(b, h, s, d, device=dev, dtype=dt)
    spec = build_mask(batch=b, n_heads=h, s=s, t=s, causal=True)
    scale = d**-0.5

    def ours() -> object:
        out, _ = attend(AttentionCall(q, DenseKV(k, v), spec, scale=scale))
        return out.backward(grad) if backward else out

    def sdpa() -> object:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.backward(grad) if backward else out

    flops = 4 * b * h * s * s * d / 2 * (3.5 if backward else 1.0)  # causal half; backward 2.5x the forward
    t_ours = _device_time(ours, repeats, dev)
    t_best, best = _best_sdpa(sdpa, repeats, dev)
    r = t_best / t_ours
    name, what = ("G2", "forward + backward") if backward else ("G1", "prefill forward")
    note = ""
    if dev == "cuda":  # which kernel the default order gave, and what cuDNN first would give (torch's order moves)
        note = (f"multihead ran {_attention_kernels(ours)}; SDPA's default order ran {_attention_kernels(sdpa)}; "
                f"multihead with cuDNN first in the order: {flops / _cudnn_first(ours, repeats) / 1e12:.0f} TFLOP/s")
    return Result(name, f"{what} b{b} h{h} s{s} d{d} causal bf16", f"best SDPA backend ({best})",
                  f"{flops / t_ours / 1e12:.0f} TFLOP/s", f"{flops / t_best / 1e12:.0f} TFLOP/s", f"{r:.2f}x",
                  ">= 0.95x", r >= 0.95, note)


def _decode(repeats: int, device: str = "cuda", tiny: int = 1) -> Result:
    b, h, g, d, cached = 8 // tiny, 32 // tiny, 8 // tiny, 128, 32768 // tiny
    dev, dt = device, torch.bfloat16
    layer = MultiHeadAttention(d_model=h * d, n_heads=h, n_kv_heads=g, bias=False, device=dev, dtype=dt).eval()
    cache = KVCache(batch=b, n_kv_heads=g, head_dim=d, max_len=cached + 1, dtype=dt, device=dev)
    cache.advance(cached)
    x = torch.randn(b, 1, h * d, device=dev, dtype=dt)
    q = torch.randn(b, h, 1, d, device=dev, dtype=dt)
    spec = build_mask(batch=b, n_heads=h, s=1, t=cached + 1, causal=True)
    k, v = cache.k[0], cache.v[0]
    with torch.no_grad():
        t_core = _device_time(lambda: attend(AttentionCall(q, DenseKV(k, v), spec, scale=d**-0.5)), repeats, dev)
        t_layer = _device_time(lambda: layer(x, causal=True, cache=cache.layer(0)), repeats, dev)
    kv_bytes = k.nbytes + v.nbytes
    src = torch.empty(kv_bytes // 2, device=dev, dtype=dt)
    dst = torch.empty_like(src)
    t_copy = _device_time(lambda: dst.copy_(src), repeats, dev)
    copy_rate = 2 * src.nbytes / t_copy  # read + write
    rate = kv_bytes / t_core
    return Result("G3", f"GQA decode b{b} {h}/{g} heads d{d}, {cached} cached (layer step {t_layer * 1e6:.0f} us)",
                  "device copy rate (read + write)", f"{rate / 1e12:.2f} TB/s", f"{copy_rate / 1e12:.2f} TB/s",
                  f"{rate / copy_rate:.0%} of copy", ">= 4.0 TB/s", rate >= 4.0e12)


def _masked_prefill(repeats: int, device: str = "cuda", tiny: int = 1) -> Result:
    b, h, g, d, s = 4, 32 // tiny, 8 // tiny, 128, 4096 // tiny
    dev, dt = device, torch.bfloat16
    layer = MultiHeadAttention(d_model=h * d, n_heads=h, n_kv_heads=g, bias=False, device=dev, dtype=dt).eval()
    x = torch.randn(b, s, h * d, device=dev, dtype=dt)
    lengths = torch.tensor([s, s * 3 // 4, s // 2, s // 4], device=dev)
    valid = torch.arange(s, device=dev)[None] < lengths[:, None]  # (b, t)
    dense = torch.ones(s, s, dtype=torch.bool, device=dev).tril()[None, None] & valid[:, None, None, :]
    with torch.no_grad():
        chosen = layer.explain(x, key_padding_mask=valid, causal=True)
        t_ours = _device_time(lambda: layer(x, key_padding_mask=valid, causal=True), repeats, dev)
        t_dense = _device_time(lambda: layer(x, mask=dense, backend="sdpa"), repeats, dev)
    r = t_dense / t_ours
    return Result("G4", f"GQA prefill b{b} s{s} {h}/{g} heads, padding + causal (auto: {chosen.backend})",
                  "SDPA with the dense bool mask", _ms(t_ours), _ms(t_dense), f"{r:.2f}x faster", ">= 2.5x faster",
                  r >= 2.5)


def run_gpu(repeats: int = 20, only: tuple[str, ...] = GPU_BENCHMARKS, *, device: str = "cuda",
            tiny: int = 1) -> list[Result]:
    """G1-G4 on the GPU. ``device="cpu", tiny=8`` runs the same code at 1/8 of the sizes on the CPU (the tests do,
    so that the GPU script cannot break unseen); those figures mean nothing against the targets."""
    if device == "cuda" and not torch.cuda.is_available():
        raise MultiheadError("the GPU benchmarks need CUDA, and torch.cuda.is_available() is False here")
    results: list[Result] = []
    for name in only:
        if name == "G1":
            results.append(_prefill(repeats, backward=False, device=device, tiny=tiny))
        elif name == "G2":
            results.append(_prefill(repeats, backward=True, device=device, tiny=tiny))
        elif name == "G3":
            results.append(_decode(repeats, device=device, tiny=tiny))
        elif name == "G4":
            results.append(_masked_prefill(repeats, device=device, tiny=tiny))
    return results


def table(results: list[Result]) -> str:
    lines = ["| | benchmark | anchor | multihead | anchor | ratio | target | met |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.what} | {r.anchor} | {r.ours} | {r.theirs} | {r.ratio} | {r.target} | "
                     f"{'yes' if r.met else 'NO'} |")
    notes = [f"- {r.name} against {r.anchor}: {r.note}" for r in results if r.note]
    return "\n".join(lines + (["", *notes] if notes else []))


def as_dicts(results: list[Result]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
