"""The speed decisions measured on a small CPU, gathered in one place behind one switch.

Each function here answers "take the fast path for this call?" for one trick that gives the same result as the plain
code (within the dtype's rounding) and was measured faster on the 2-core machine of benchmarks/RESULTS.md:

- :func:`split_product`: which few-row projections (decoding) may choose their kind of product, and the row blocks
  of the split one (over the intra-op threads that find a free core, :func:`free_threads`: other processes'
  runnable threads are read from the kernel, so a loaded machine gets plain F.linear for float32);
- :func:`product_kind`: the kind each such product runs (F.linear, torch.mv, the split, low precision with oneDNN
  off, or multihead.native's bfloat16 kernel), measured for its shape (:mod:`multihead.linear` runs them);
- :func:`step_threads`: on a loaded machine a model step runs with as many intra-op threads as cores are free;
- :func:`product_in_one_thread`: on a loaded machine a split low-precision product runs with one intra-op thread;
- :func:`fold_gqa_decode`: a GQA decode step with the query heads of each KV head folded into rows, so SDPA's CPU
  kernel reads each KV head once (consulted by :func:`multihead.kernels.resolve_backend`, the one place that decides
  which kernel runs and how; run by :func:`multihead.kernels.sdpa_attention`);
- :func:`native_decode_attention`: a decode step attends in a native kernel that reads each KV head once;
- :func:`native_quantized_decode`: a decode step over a 4- or 8-bit cache attends over the codes in a native kernel;
- :func:`fused_low_precision_norm`: a bfloat16/float16 RMSNorm as PyTorch's ``F.rms_norm``;
- :func:`plain_decode_mask`: one sequence continuing at its cached length attends with a plain bottom-right causal
  mask instead of a mask by positions (no per-call position tensor in the kernel);
- :func:`slice_cache_write`: sequences that all continue at the same length write the cache as one slice copy instead
  of index arithmetic.

``set_enabled(False)`` (or ``with disabled():``) turns every one of them off, so the plain path can be compared with
the fast one on a whole model (the tests do: same tokens, same logits within float32 rounding). Under torch.compile
the switch is read when the graph is traced.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from multihead.masks import MaskSpec

_enabled = True

# split product: at most this many rows (tokens x batch), weights of at least this many elements
SPLIT_MAX_ROWS = 64
SPLIT_MIN_WEIGHT = 65536
SPLIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def enabled() -> bool:
    """Whether the CPU fast paths are on (the default)."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn every fast path of this module on or off, process-wide."""
    global _enabled
    _enabled = bool(on)


@contextmanager
def disabled() -> Iterator[None]:
    """The plain paths while the block runs."""
    before = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(before)


def _threads() -> int:
    return torch.get_num_threads()


# under torch.compile the thread count is read once, when the graph is traced (set_num_threads before compiling)
intra_op_threads: Callable[[], int] = torch.compiler.assume_constant_result(_threads)

LOAD_EVERY = 0.1  # seconds between two readings of the other processes' runnable threads
LOAD_SMOOTHING = 0.3  # weight of a new reading in the running average, readings LOAD_EVERY s apart
# After 2 x LOAD_EVERY s without a reading, one reading would weigh over half the average (1 - 0.7^2), enough to
# round a transient into a busy core: the average is taken afresh instead, the least of STALE_READINGS readings
STALE_AFTER = 2 * LOAD_EVERY
STALE_READINGS = 4
STALE_SPACING = 0.0005  # seconds between them


class _Load:
    """The cores other processes leave to this one, from readings at most LOAD_EVERY s apart (a running average).

    A reading is the kernel's count of runnable threads at this instant (the 4th field of /proc/loadavg, not the
    1-minute average) less this process's own (its threads in state R): the threads that compete with this process's
    intra-op threads for the cores. Where /proc is not there (not Linux), nothing is counted (every core free).

    After STALE_AFTER s without a reading (the first call, or a step that follows other work: a long prefill,
    another program's turn in a benchmark) the average is replaced by the least of STALE_READINGS readings
    STALE_SPACING s apart, not by one reading: a process that keeps a core busy is runnable in every reading, while a
    transient one (a kernel worker, or one of this process's own threads counted runnable by /proc/loadavg and asleep
    by the time its own state is read) is in few, and one such reading would otherwise run a whole step, seconds of
    prefill, on one thread (on an idle 2-core machine, right after two-thread work: 3 of 200 such single-reading
    decisions gave one thread). The burst costs about 2 ms, at most once every STALE_AFTER s.
    ``pinned`` replaces the result with a fixed count of spare cores (tests, and benchmarks that want one decision
    throughout).
    """

    def __init__(self) -> None:
        self.at = -float("inf")
        self.others = 0.0
        self.spare = float(self.cores())
        self.pinned: float | None = None

    @staticmethod
    def cores() -> int:
        """The machine's cores: the runnable threads read are the whole machine's."""
        return os.cpu_count() or 1

    @staticmethod
    def read() -> float:
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
            mine = 0
            for task in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{task}/stat") as f:
                        mine += f.read().rpartition(")")[2].split()[0] == "R"
                except (OSError, IndexError):  # the thread ended meanwhile
                    continue
        except (OSError, ValueError, IndexError):
            return 0.0
        return float(max(running - mine, 0))

    def spare_cores(self) -> float:
        """Cores less the other processes' runnable threads (the running average), refreshed when due."""
        if self.pinned is not None:
            return self.pinned
        now = time.monotonic()
        if now - self.at >= STALE_AFTER:
            readings = [self.read()]
            for _ in range(STALE_READINGS - 1):
                time.sleep(STALE_SPACING)
                readings.append(self.read())
            self.at = time.monotonic()
            self.others = min(readings)
            self.spare = self.cores() - self.others
        elif now - self.at >= LOAD_EVERY:
            # a reading's weight as if one had been taken every LOAD_EVERY s meanwhile (an old average counts less)
            weight = 1.0 - (1.0 - LOAD_SMOOTHING) ** min((now - self.at) / LOAD_EVERY, 64.0)
            self.at = now
            self.others += weight * (self.read() - self.others)
            self.spare = self.cores() - self.others
        return self.spare


_load = _Load()


def free_threads() -> int:
    """How many of this process's intra-op threads find a core that no other process keeps busy (at least 1).

    ``intra_op_threads()`` capped by the cores less the other processes' runnable threads (:class:`_Load`, a running
    average refreshed at most every LOAD_EVERY s, so a call costs a clock reading). Under torch.compile it is read
    once, when the graph is traced (:data:`free_threads_traced`).
    """
    return max(1, min(intra_op_threads(), int(_load.spare_cores() + 0.5)))


free_threads_traced: Callable[[], int] = torch.compiler.assume_constant_result(free_threads)


def pin_spare_cores(spare: float | None) -> None:
    """Decide as if other processes left ``spare`` cores free (a large number: an idle machine); None: read the load
    again (the default)."""
    _load.pinned = None if spare is None else float(spare)


# the product kind measured fastest, once a process: (out, in, dtype, rows, blocks, threads it runs with) -> kind
PRODUCT_KINDS = ("linear", "mv", "split", "blas", "native")
_measured: dict[tuple[object, ...], str] = {}
_in_graph: dict[tuple[object, ...], str] = {}  # a key decided "blas": the fastest kind measured that a graph can run
_trials: dict[tuple[object, ...], _Trial] = {}
_forced: str | None = None
MEASURE_REPEATS = 7  # timed real calls of each kind before the choice (after one untimed first call each)
DROP_OVER = 1.5  # a kind this much slower than the best after 2 timed calls each stops being tried
KIND_MARGIN = 0.95  # another kind is taken when its median time is under this fraction of F.linear's


class _Trial:
    """The real calls of one key so far: the kinds still in the running (taken in turn), which have had their
    untimed first call, and each kind's timed calls."""

    __slots__ = ("active", "calls", "times", "warm")

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.active = kinds
        self.calls = 0
        self.warm: set[str] = set()
        self.times: dict[str, list[float]] = {kind: [] for kind in kinds}


def force_product(kind: str | None) -> None:
    """Take ``kind`` for every product :func:`split_product` lets choose, without measuring (a kind the call has
    not, e.g. "blas" for float32, gives F.linear); None: measure (the default). For tests of the kinds themselves,
    and benchmarks that want one decision throughout."""
    global _forced
    if kind is not None and kind not in PRODUCT_KINDS:
        raise ValueError(f"unknown product kind {kind!r}: one of {', '.join(PRODUCT_KINDS)}, or None to measure")
    _forced = kind


def forget_measured(key: tuple[object, ...] | None = None) -> None:
    """Measure again from the next use: the choice for ``key``, or every choice (None), e.g. after the load
    changed."""
    if key is None:
        _measured.clear()
        _in_graph.clear()
        _trials.clear()
    else:
        _measured.pop(key, None)
        _in_graph.pop(key, None)
        _trials.pop(key, None)


def product_kind(key: tuple[object, ...], kinds: tuple[str, ...],
                 trial: Callable[[str], Callable[[], object]] | None = None) -> tuple[str, bool]:
    """Which of ``kinds`` (the same product computed differently; "linear" first) to run for this call of ``key``,
    and whether to time it for :func:`record_time`.

    The kinds (:mod:`multihead.linear` runs them): "linear" is ``F.linear``; "mv" (one row) ``torch.mv``, the
    matrix-vector kernel; "split" the batched product over row blocks of the weight; "blas" (bfloat16/float16 only)
    ``F.linear`` with oneDNN switched off for the call, so PyTorch's own vectorised gemv/gemm runs (float32
    accumulation) instead of oneDNN's AMX matmul, whose fixed cost per call (~40 us here) dominates a one-row
    product of a small matrix; "native" (one bfloat16 row) :func:`multihead.native.gemv_bf16`, a C kernel reading
    the weight at the memory's speed (1536 x 576 from memory: 75-88 us against F.linear's 240-278 on the host of
    2026-12-01).

    How a key is decided. With ``trial`` (several rows: prompts, patching runs), up front: ``trial(kind)`` gives
    each kind's product on this call's inputs, run MEASURE_REPEATS times each, alternating, before the call's own
    product, so every call of the key computes the same way. Without it (one row: decoding), on the real calls:
    until the key is decided its calls take the kinds in turn and are timed (the first call of each kind not
    counted), nothing computed twice, and the weights are every layer's, as they come from memory, where a trial's
    weight sits in cache: the first decoding steps of a process (a few, one per 4 x 8 calls of a shape) therefore
    round differently from the later ones (the kinds agree within the dtype's rounding). Either way the fastest
    median is kept for the process if it is under KIND_MARGIN of F.linear's, else F.linear.

    Why measured and not fixed: the same 2-core Xeon type gave opposite answers on two hosts, and warm and cold
    weights rank the kinds differently. The float32 split was written where SmolLM2's 210 matrices at one row took
    63 ms with F.linear and 33 ms split in 2; on the host of 2026-12-01 (idle, one process, alternating, 15 rounds)
    they took 21.8 ms with F.linear and 48.6 ms split (2.23x slower). On that host in bfloat16, one row, a weight in
    cache (the same matrix again and again): 192 x 576 F.linear 53 us, "blas" 18; 1536 x 576 134 / 136, "mv" 74;
    with the weights from memory (400 MB of copies in turn): 1536 x 576 F.linear 137 us, split 103, "mv" 110,
    "blas" 147; 576 x 1536 153 / 215 / 129 / 184; float32 1536 x 576 F.linear 161 us, "mv" 155, split 382.

    Under torch.compile nothing is measured: a choice already made is used ("native" is the operator
    ``torch.ops.multihead.gemv_bf16``; "blas" cannot be, oneDNN's switch being a process setting, not an op, so the
    graph takes the fastest of the other kinds measured for the key, "linear" where none was under KIND_MARGIN of
    F.linear: on the AMD host of 2026-12-02, without AMX, F.linear is oneDNN's slow bfloat16 product, and a compiled
    bfloat16 SmolLM2 step that took it for every "blas" shape ran at transformers' speed), else "linear" (a
    graph traced before any eager call of the shape: the split was the default there until a compiled SmolLM2 step,
    all split, ran at 0.5x transformers in both dtypes on the host of 2026-12-01, against 1.15x eager); decode
    eagerly for a few steps before compiling to trace with the measured kinds. Under a dispatch or function mode
    (FLOP counters, fake tensors) or torch.jit.trace "linear", not timed.
    """
    if _forced is not None:
        return _forced, False
    found = _measured.get(key)
    if found is not None:
        if found == "blas" and torch.compiler.is_compiling():
            return _in_graph.get(key, "linear"), False
        return found, False
    if _unmeasurable():
        return "linear", False
    if trial is not None:
        return _decide(key, _measure_up_front(kinds, trial)), False
    return _next_trial(key, kinds)


def _unmeasurable() -> bool:
    """Whether a call cannot be timed: under torch.compile (a graph, not a run), a dispatch or function mode (FLOP
    counters, fake tensors would see the trials) or torch.jit.trace. Such calls take the plain way, undecided."""
    return (torch.compiler.is_compiling() or is_in_torch_dispatch_mode() or torch._C._is_torch_function_mode_enabled()
            or torch._C._get_tracing_state() is not None)


def _next_trial(key: tuple[object, ...], kinds: tuple[str, ...]) -> tuple[str, bool]:
    """The kind the next real call of an undecided ``key`` takes (round robin), to be timed."""
    state = _trials.get(key)
    if state is None:
        state = _trials[key] = _Trial(kinds)
    kind = state.active[state.calls % len(state.active)]
    state.calls += 1
    return kind, True


def _decide(key: tuple[object, ...], times: dict[str, list[float]]) -> str:
    """Keep the fastest kind for ``key`` (:func:`_fastest`), and where that is "blas", which a graph cannot run, the
    fastest of the others for :func:`product_kind` under torch.compile."""
    kind = _measured[key] = _fastest(times)
    if kind == "blas":
        others = {name: t for name, t in times.items() if name != "blas" and t}
        _in_graph[key] = _fastest(others) if others else "linear"
    return kind


def _measure_up_front(kinds: tuple[str, ...], trial: Callable[[str], Callable[[], object]]
                      ) -> dict[str, list[float]]:
    runs = {kind: trial(kind) for kind in kinds}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.no_grad():
        for run in runs.values():  # first calls (allocation, kernel set-up) not counted
            run()
        for r in range(MEASURE_REPEATS):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]  # no kind always first
            for kind in order:
                began = time.perf_counter()
                runs[kind]()
                times[kind].append(time.perf_counter() - began)
    return times


def _fastest(times: dict[str, list[float]]) -> str:
    """The kind of the fastest median if it is under KIND_MARGIN of F.linear's, else "linear"."""
    medians = {name: statistics.median(t) for name, t in times.items()}
    best = min(medians, key=medians.__getitem__)
    plain = medians.get("linear")
    return best if plain is None or best == "linear" or medians[best] < KIND_MARGIN * plain else "linear"


def record_time(key: tuple[object, ...], kind: str, seconds: float) -> None:
    """One timed call of ``kind`` for ``key`` (after :func:`product_kind` or :func:`fold_gqa_decode` said to time
    it). A kind's first call is not counted (allocation, kernel set-up). Once every kind in the running has 2 timed
    calls, a kind whose median is over DROP_OVER times the best one's leaves the running (a shape called once a
    step, the lm_head, would otherwise run a 3x slower kind for dozens of steps); the key is decided when every
    kind left has MEASURE_REPEATS timed calls."""
    state = _trials.get(key)
    if state is None or kind not in state.active:
        return
    if kind not in state.warm:
        state.warm.add(kind)
        return
    state.times[kind].append(seconds)
    counts = [len(state.times[name]) for name in state.active]
    if min(counts) >= 2 and len(state.active) > 1:
        medians = {name: statistics.median(state.times[name]) for name in state.active}
        best = min(medians.values())
        kept = tuple(name for name in state.active if medians[name] <= DROP_OVER * best)
        if kept != state.active:
            state.active = kept
            state.calls = 0
    if len(state.active) == 1 or min(len(state.times[name]) for name in state.active) >= MEASURE_REPEATS:
        _decide(key, {name: times for name, times in state.times.items() if times})
        del _trials[key]


def measured() -> dict[tuple[object, ...], str]:
    """The choices made so far (a copy): products (out, in, dtype, rows, blocks, threads) -> kind, and GQA decode
    folds ("fold", b, h, g, dtype, bit length of t, threads) -> "folded" or "unfolded"."""
    return dict(_measured)


def split_product(rows: int, weight: Tensor, x: Tensor) -> int:
    """How many row blocks the split kind of ``x @ weight.T`` takes (1: plain ``F.linear``, no kind to choose).

    float32: measured (the 210 matrices of SmolLM2-135M at one row, idle 2-core Xeon): 63 ms with F.linear, whose
    gemv kept to one core here, 33 ms split in 2; 1536 x 576 at 1-64 rows 0.4-0.8x the time of F.linear; from about
    128 rows the two are level. It splits over :func:`free_threads` blocks only: when other processes keep the cores
    busy, a split waits for its descheduled thread while F.linear's one-core gemv does not (1536 x 576, one row,
    load average 7 on the 2 cores: split in 2 748 us against F.linear's 49 us; 15x), so it falls back to F.linear.

    bfloat16 and float16: split in at least 2 blocks, whatever the load. Their F.linear at one row (oneDNN's AMX
    matmul, x as the one-row left operand) is slow for the larger matrices; ``W @ x^T`` (the weight as the left
    operand, as the split runs it) is not. One process, alternating, best of 15 (load average 6.7 on the 2 cores, so
    the figures are loaded ones), bfloat16 F.linear against split in 2, 2 threads: 1536 x 576 478 / 60 us, 576 x 1536
    383 / 56 us, 576 x 576 73 / 68 us, 49152 x 576 (the tied lm_head) 17.5 / 17.8 ms; 1 thread: 260 / 220, 463 / 216,
    61 / 49 us, 28.9 / 14.4 ms. Weights under SPLIT_MIN_WEIGHT elements sit in cache and the split's own dispatch
    costs more than it saves (float32 72 x 64 at one row: 20 us split, 5 us plain).
    """
    if (  # cheapest tests first: this runs for every projection of every step
        not _enabled
        or not 0 < rows <= SPLIT_MAX_ROWS
        or weight.numel() < SPLIT_MIN_WEIGHT
        or x.dtype != weight.dtype
        or weight.dtype not in SPLIT_DTYPES
        or not x.is_cpu
        or type(weight) not in (Tensor, torch.nn.Parameter)  # tensor subclasses (DTensor shards) dispatch their own
        or type(x) is not Tensor
        or weight.ndim != 2
        or weight.shape[1] != x.shape[-1]  # F.linear says what is wrong
        or not weight.is_contiguous()
    ):
        return 1
    n = free_threads_traced()
    if weight.dtype != torch.float32:
        n = max(n, 2)  # the layout gains with one thread too (see above)
    return n if n > 1 and weight.shape[0] % n == 0 else 1


@contextmanager
def step_threads() -> Iterator[int]:
    """Run a model step with only as many intra-op threads as cores are free (:func:`free_threads`), and give the
    count back after; yields the count the step runs with.

    On a loaded machine an op spread over two threads waits for whichever thread the scheduler left off its core:
    measured in SmolLM2's bfloat16 decode with two busy processes on the 2 cores (decode.py --load 2 --profile),
    SDPA's CPU kernel took 70 ms a token and oneDNN's products pushed plain PyTorch and transformers to 0.5 tok/s.
    One thread where one core is free avoids the wait for every op of the step, not only the products. Idle, or
    under torch.compile (a process setting, not an op), or with the speed paths off, nothing changes."""
    if not _enabled or torch.compiler.is_compiling():
        yield intra_op_threads()
        return
    threads = torch.get_num_threads()
    want = free_threads()
    if want >= threads:
        yield threads
        return
    torch.set_num_threads(want)
    try:
        yield want
    finally:
        torch.set_num_threads(threads)


def product_in_one_thread(blocks: int, weight: Tensor) -> bool:
    """Whether a split low-precision product (``blocks`` > 1 from :func:`split_product`) runs with one intra-op thread
    because other processes leave fewer cores free than there are threads (:func:`free_threads`).

    oneDNN's bfloat16 product over 2 threads waits for whichever thread the scheduler left off the core. Measured, the
    211 matrices of SmolLM2-135M in bfloat16 at one row, one process, alternating, 9 rounds, load average 3.9 on the
    2 cores (median ms): F.linear 454, split over 2 threads 324, split in one thread 146 (0.32x F.linear); setting the
    thread count there and back costs 12 us. Not under torch.compile (the count is a process setting, not an op).
    """
    return (_enabled and blocks > 1 and weight.dtype != torch.float32 and not torch.compiler.is_compiling()
            and free_threads() < intra_op_threads())


FOLD_KINDS = ("unfolded", "folded")


def fold_gqa_decode(batch: int, n_heads: int, n_kv_heads: int, s: int, device: torch.device,
                    plain_causal: bool, t: int = 0, dtype: torch.dtype | None = None
                    ) -> tuple[bool, tuple[object, ...] | None]:
    """Whether SDPA runs a GQA decode step with each group's query heads folded into rows, and the key to time the
    call under (:func:`record_time`) while that is being measured (None: decided).

    On the CPU, folded when the folded work items (b * g) share evenly among the threads, or are at least two per
    thread, or each KV head serves at least 4 query heads. Measured with SDPA's CPU flash kernel (float32,
    head_dim 64, time folded / not folded): 32/8 heads, 4096 keys 0.73; 8/1, 2048 keys 0.71; 16/2 0.40, 12/4 0.91,
    9/3 at batch 2 0.88, 15/5 1.00 (1024 keys). Otherwise (SmolLM2's 9/3 at batch 1: 3 items for 2 threads) it
    depends on the host and the length, so it is measured on the real calls, per (b, h, g, dtype) and power-of-two
    range of the key count t (a new range, a new measurement: 2 x 8 calls, a fraction of a step of a 30-layer
    model): on one host folding was 1.07-1.24x slower for 4096-64 keys, on the host of 2026-12-01 (30 layers' caches
    in turn, medians of 5) float32 1k keys 2.5 ms folded / 3.8 unfolded, 4k 17.4 / 19.3, 8k 30.9 / 48.4 (the
    unfolded kernel reads each KV head once per query head); bfloat16 2.0 / 2.1, 13.3 / 12.0, 25.0 / 24.7. Under
    torch.compile or a dispatch mode an undecided case stays unfolded.
    """
    if not _enabled or n_kv_heads == n_heads or s != 1 or device.type != "cpu" or plain_causal:
        return False, None
    items, threads = batch * n_kv_heads, intra_op_threads()
    if n_heads // n_kv_heads >= 4 or items % threads == 0 or items >= 2 * threads:
        return True, None
    key = ("fold", batch, n_heads, n_kv_heads, dtype, t.bit_length(), threads)
    found = _measured.get(key)
    if found is not None:
        return found == "folded", None
    if _unmeasurable():
        return False, None
    kind, _ = _next_trial(key, FOLD_KINDS)
    return kind == "folded", key


NATIVE_ATTENTION_KINDS = ("sdpa", "native")


def native_decode_attention(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, needs_grad: bool, dropout_p: float
                            ) -> tuple[bool, tuple[object, ...] | None]:
    """Whether a decode step (one query a head, every key visible) runs in :func:`multihead.native.attend_dense`
    instead of SDPA's CPU kernel, and the key to time the call under (:func:`record_time`) while that is measured.

    The native kernel reads each KV head once for all the query heads it serves, float32 sums, with software
    prefetch. Measured (SmolLM2's 9/3 heads, head_dim 64, 30 layers' caches in turn, one process, alternating,
    medians of 7, the host of 2026-12-01): 8,192 keys float32 25.8 ms against SDPA's 62.9, bfloat16 15.3 against
    27.1; 2,048 keys float32 8.8 / 12.4, bfloat16 7.4 / 7.7. Measured per (b, h, g, dtype) and power-of-two range
    of the key count on the real calls, as the GQA fold is (after it: the SDPA side runs the fold decided), since
    short contexts are level. Not under torch.compile, a dispatch mode or with gradients, dropout or padded keys."""
    if (not _enabled or not q.is_cpu or q.shape[2] != 1 or needs_grad or dropout_p > 0.0 or spec.padding is not None
            or _unmeasurable() or not spec.every_key_visible()):  # (the mask's values are read last: not in a graph)
        return False, None
    from multihead import native

    if native.library() is None or not native.dense_fits(q, k, v):
        return False, None
    key = ("native attention", q.shape[0], q.shape[1], k.shape[1], k.dtype, k.shape[2].bit_length(),
           intra_op_threads())
    found = _measured.get(key)
    if found is not None:
        return found == "native", None
    kind, _ = _next_trial(key, NATIVE_ATTENTION_KINDS)
    return kind == "native", key


def native_quantized_decode(q: Tensor, bits: int, needs_grad: bool) -> bool:
    """Whether a decode step (one query a head) over a 4- or 8-bit :class:`~multihead.cache.QuantizedKVCache` attends
    in :func:`multihead.native.attend_q4` / :func:`~multihead.native.attend_q8`, reading the codes once inside the
    attention, instead of dequantising the whole prefix into a tensor for SDPA. Measured (SmolLM2's 9/3 heads,
    head_dim 64, 8,192 cached tokens, 30 layers' caches in turn, one process, alternating, medians of 7, the host of
    2026-12-01): 4 bits, float32 38 ms against 176 ms dequantised + SDPA and 68 ms for SDPA over the full float32
    cache; bfloat16 35 / 168 / 38. Not under torch.compile or a dispatch mode (the kernel is opaque to both), nor
    with gradients; 2 bits always dequantise."""
    if not _enabled or bits not in (4, 8) or not q.is_cpu or q.shape[2] != 1 or needs_grad or _unmeasurable():
        return False
    from multihead import native

    return native.library() is not None


def fused_low_precision_norm(x: Tensor) -> bool:
    """Whether a bfloat16/float16 RMSNorm on the CPU runs as PyTorch's ``F.rms_norm`` (one call, normalised in
    float32, composed in C++) instead of transformers' formula (six Python-level ops and two casts). Measured,
    bfloat16 (1, 1, 576), one process, alternating: 17-18 us against 22-37 us; over 1,000 rows of size ~3 the
    largest relative error to the float64 formula 0.0039 against 0.0076."""
    return _enabled and x.is_cpu


def plain_decode_mask(batch: int, at_cache_end: bool) -> bool:
    """Whether a cached step may use plain bottom-right causal alignment instead of a mask by positions: one
    sequence, continuing at its cached length (its queries are the last s of the t cached keys). Not under
    torch.compile, where the cache keeps its full length and positions decide."""
    return _enabled and batch == 1 and at_cache_end and not torch.compiler.is_compiling()


def slice_cache_write(uniform: bool) -> bool:
    """Whether a cache write of sequences that all continue at the same host-known length is one slice copy."""
    return _enabled and uniform and not torch.compiler.is_compiling()
