"""The CPU speed decisions, made as data: rules, and a per-host tuning table read once a process, never a clock.

Each function here answers "take the fast path for this call?" for one trick that gives the same result as the plain
code (within the dtype's rounding) and was measured faster on the 2-core machines of benchmarks/RESULTS.md:

- :func:`split_product`: which few-row projections (decoding) may choose their kind of product, and the row blocks of
  the split one (over the process's intra-op threads);
- :func:`product_kind`: the kind each such product runs (F.linear, torch.mv, the split, low precision with oneDNN
  off, or multihead.kernels.native's bfloat16 kernel), by shape (:mod:`multihead.layers.linear` runs them);
- :func:`fold_gqa_decode`: a GQA decode step with the query heads of each KV head folded into rows, so SDPA's CPU
  kernel reads each KV head once (consulted by :func:`multihead.kernels.resolve_backend`, the one place that decides
  which kernel runs and how);
- :func:`native_decode_attention`: a decode step attends in a native kernel that reads each KV head once;
- :func:`native_quantized_decode`: a decode step over a 4- or 8-bit cache attends over the codes in a native kernel;
- :func:`native_codec`: a quantized cache's write and read-back run in the native codec (the same bits, one pass);
- :func:`fused_low_precision_norm`: a bfloat16/float16 RMSNorm as PyTorch's ``F.rms_norm``;
- :func:`upcast_product`: a many-row bfloat16 product (a prefill's) computed in float32 on an x86 CPU without
  bfloat16 instructions, where PyTorch's bfloat16 matmul runs at a third of float32's speed.

**Decisions are data.** Where the answer depends on the host (which kind of product is fastest for a shape, whether
the fold or the native attention pays at a length), it is a look-up in the host's tuning table: a JSON file under
the user's cache folder (:func:`table_path`), keyed by the host (CPU model and flags, cores, torch version) and, in
it, by decision and shape. :mod:`multihead.kernels.tuning` measures and writes it (``multihead tune``); at run time the
table is read once, when the process first needs it, and never written, so a process computes the same way from its
first step to its last, and two processes on one host agree. A decision the table does not hold takes the rule written
beside it (:data:`DEFAULTS` says which). No decision reads the clock (the load, below, sets only a step's threads).

**The machine's load** can change how many threads a step runs with, never what it computes: each model step runs
with the threads of the cores other processes leave free (:func:`step_threads`; a transformers model switched by
:func:`multihead.hf.enable` too, each forward a step), and a split low-precision product in one thread where cores
are busy. On by default (a /proc reading at most every 0.1 s; nothing where /proc is absent); :func:`follow_load`
(False) or ``MULTIHEAD_FOLLOW_LOAD=0`` keeps the configured threads whatever the load. An op spread over two
threads waits at each barrier for the one the scheduler left off its core (what that costs against transformers'
own decode is in benchmarks/RESULTS.md). Every decision above keys by the process's configured thread count, not
the step's, so the same kernels run, and a float32 product of more than one row (whose sums MKL splits by its thread
count) and a float32 decode step's attention in PyTorch's kernels run with the configured threads
(:func:`configured_threads`): the outputs do not change (tests check it bit for bit, in one process and in two side
by side).

``set_enabled(False)`` (or ``with disabled():``) turns every fast path of the package off (these, and the cache's
slice write and plain decode mask, :meth:`multihead.cache.BaseCache.reserve`), so the plain path can be compared
with the fast one on a whole model (the tests do: same tokens, same logits within float32 rounding). Under
torch.compile the switch is read when the graph is traced.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from multihead.errors import MultiheadError

_enabled = True

# split product: at most this many rows (tokens x batch), weights of at least this many elements
SPLIT_MAX_ROWS = 64
SPLIT_MIN_WEIGHT = 65536
SPLIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# upcast product: more rows than the split takes; at most this many float32 elements of the weight converted at once
UPCAST_BLOCK = 1 << 21


def enabled() -> bool:
    """Whether the CPU fast paths are on (the default)."""
    return _enabled


def in_a_mode() -> bool:
    """Whether a dispatch or function mode (FLOP counters, fake tensors, op counters) or torch.jit.trace is watching
    the calls: there every decision takes PyTorch's plain kernel, which such a mode can see and count (the native
    kernels read raw memory, which a fake tensor does not have, and are invisible to a counter).

    The mode of ``torch.set_default_device`` (or ``with torch.device(...)``) only places new tensors: it watches
    nothing, and a process that sets a default device computes as one that does not."""
    return (is_in_torch_dispatch_mode() or _watching_function_mode() or torch._C._get_tracing_state() is not None)


def _watching_function_mode() -> bool:
    if not torch._C._is_torch_function_mode_enabled():
        return False
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    return any(not isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


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


# ---------------------------------------------------------------------------------------------- threads
_step = threading.local()  # inside step_threads: the count the process is configured with


def _threads() -> int:
    configured: int | None = getattr(_step, "configured", None)
    return torch.get_num_threads() if configured is None else configured


# The process's intra-op thread count, the one its decisions are keyed by: also inside a step that step_threads
# runs with fewer. Under torch.compile it is read once, when the graph is traced (set_num_threads before compiling).
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
    1-minute average) less this process's own (its threads in state R). Where /proc is not there (not Linux),
    nothing is counted (every core free). After STALE_AFTER s without a reading the average is replaced by the least
    of STALE_READINGS readings STALE_SPACING s apart, not by one reading: a process that keeps a core busy is
    runnable in every reading, a transient one in few (on an idle 2-core machine, right after two-thread work, 3 of
    200 single-reading decisions gave one thread). ``pinned`` replaces the result with a fixed count of spare cores
    (tests, and benchmarks that want one decision throughout). Read only when :func:`follow_load` is on.
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
_follow: bool | None = None  # None: read MULTIHEAD_FOLLOW_LOAD once


def follow_load(on: bool | None) -> None:
    """Let the machine's load set how many threads a model step runs with (True), or not (False); None: as
    ``MULTIHEAD_FOLLOW_LOAD`` says (1 or unset: on, the default; 0: off)."""
    global _follow
    _follow = None if on is None else bool(on)


def following_load() -> bool:
    """Whether a step's thread count follows the machine's load (:func:`follow_load`)."""
    global _follow
    if _follow is None:
        said = os.environ.get("MULTIHEAD_FOLLOW_LOAD", "1")
        if said not in ("0", "1"):
            raise MultiheadError(f"MULTIHEAD_FOLLOW_LOAD={said!r}: set 1 (each step's threads follow the machine's "
                                 "load, the default) or 0 (the configured threads whatever the load)")
        _follow = said == "1"
    return _follow


def free_threads() -> int:
    """How many of this process's intra-op threads find a core that no other process keeps busy (at least 1), when
    :func:`following_load`; else every intra-op thread. A clock reading a call, a /proc reading at most every
    LOAD_EVERY s."""
    threads = intra_op_threads()
    if not following_load():
        return threads
    return max(1, min(threads, int(_load.spare_cores() + 0.5)))


def pin_spare_cores(spare: float | None) -> None:
    """Decide as if other processes left ``spare`` cores free (a large number: an idle machine); None: read the load
    again (the default). Only read while :func:`following_load`."""
    _load.pinned = None if spare is None else float(spare)


@contextmanager
def step_threads(follow: bool = True) -> Iterator[int]:
    """Run a model step with only as many intra-op threads as cores are free (:func:`free_threads`) when
    :func:`following_load`, and give the count back after; yields the count the step runs with. Decisions inside
    the step key by the configured count (:func:`intra_op_threads`), so the same kernels run either way.

    On a loaded machine an op spread over two threads waits for whichever thread the scheduler left off its core:
    measured in SmolLM2's bfloat16 decode with two busy processes on the 2 cores (decode.py --load 2 --profile),
    SDPA's CPU kernel took 70 ms a token and oneDNN's products pushed plain PyTorch and transformers to 0.5 tok/s.
    Not following the load, under torch.compile (a process setting, not an op), with the speed paths off, or
    ``follow`` False (a step whose products are not multihead's, where :func:`configured_threads` cannot keep their
    sums), nothing changes."""
    if not follow or not _enabled or not following_load() or torch.compiler.is_compiling():
        yield intra_op_threads()
        return
    threads = torch.get_num_threads()
    want = free_threads()
    if want >= threads or getattr(_step, "configured", None) is not None:
        yield threads
        return
    torch.set_num_threads(want)
    _step.configured = threads
    try:
        yield want
    finally:
        _step.configured = None
        torch.set_num_threads(threads)


def fewer_threads() -> bool:
    """Whether this call runs inside a step that :func:`step_threads` runs with fewer intra-op threads than the
    process is configured with (never under torch.compile)."""
    return not torch.compiler.is_compiling() and getattr(_step, "configured", None) is not None


KEEPS_THREADS = (torch.float32, torch.float64)
"""The dtypes whose PyTorch kernels run with the configured threads inside a step with fewer
(:func:`configured_threads`): their sums depend on the thread count on some CPUs. bfloat16 and float16 follow the
load in every kernel (oneDNN's products and SDPA gave the same bits in one thread and two, on the AMD EPYC and the
Intel Xeon hosts), and so do multihead's native kernels in every dtype (their work is cut into fixed items)."""


@contextmanager
def configured_threads() -> Iterator[None]:
    """Inside a step that :func:`step_threads` runs with fewer intra-op threads: the process's configured count for
    the call, then the step's again; elsewhere (no step, a step at the configured count, torch.compile) nothing.

    For PyTorch's kernels whose sums depend on the thread count (:data:`KEEPS_THREADS`' dtypes):
    - MKL's float32 GEMM of a few to a few hundred rows splits the inner dimension among its threads. Measured with
      torch 2.13 on a 2-core Intel Xeon (AVX-512, 2026-12-07) over 11 of SmolLM2's and Gemma 3's weight shapes at
      1-1,024 rows, 1 and 2 threads gave other bits at 4-256 rows (13 rows of 576 into 576; 64 of 1,536 into 576;
      256 of 2,048 into 640), the same at 1-3 rows and 488-1,024; oneDNN's bfloat16 product the same bits at every
      one.
    - PyTorch's CPU SDPA in float32 gave other bits for a decode step ((1, 9, 1, 64) over 21 keys) in one thread and
      two on the 2-core AMD EPYC host (2026-12-06), though not on the Intel Xeon; a float32 prefill's (20 tokens of
      SmolLM2's heads) the same bits on both, so a prefill's attention keeps following the load.
    So a float32 step on a busy machine computes what it computes idle (multihead's Linear and
    :func:`multihead.kernels.attend` ask for it)."""
    configured: int | None = getattr(_step, "configured", None)
    if configured is None or torch.compiler.is_compiling():
        yield
        return
    step = torch.get_num_threads()
    torch.set_num_threads(configured)
    try:
        yield
    finally:
        torch.set_num_threads(step)


def product_in_one_thread(blocks: int, weight: Tensor) -> bool:
    """Whether a split low-precision product (``blocks`` > 1 from :func:`split_product`) runs with one intra-op thread
    because other processes leave fewer cores free than there are threads (only when :func:`following_load`).

    oneDNN's bfloat16 product over 2 threads waits for whichever thread the scheduler left off the core. Measured, the
    211 matrices of SmolLM2-135M in bfloat16 at one row, one process, alternating, 9 rounds, load average 3.9 on the
    2 cores (median ms): F.linear 454, split over 2 threads 324, split in one thread 146 (0.32x F.linear); setting the
    thread count there and back costs 12 us. Not under torch.compile (the count is a process setting, not an op).
    """
    return (_enabled and blocks > 1 and weight.dtype != torch.float32 and following_load()
            and not torch.compiler.is_compiling() and free_threads() < intra_op_threads())


# ---------------------------------------------------------------------------------------------- the tuning table
TABLE_FORMAT = "multihead-tuning"
TABLE_VERSION = 1
PRODUCT_KINDS = ("linear", "mv", "split", "blas", "native", "onednn")
FOLD_KINDS = ("unfolded", "folded")
NATIVE_ATTENTION_KINDS = ("sdpa", "native")
# what a key of each decision may hold, by the key's first word
CHOICES: Mapping[str, tuple[str, ...]] = {"product": PRODUCT_KINDS, "fold": FOLD_KINDS,
                                          "native-attention": NATIVE_ATTENTION_KINDS}
DEFAULTS = {
    "product": ("F.linear (\"linear\"), except one row: multihead.kernels.native's kernel (\"native\") where it built "
                "vectorised for the dtype (bfloat16: AVX512-BF16; float32: AVX-512). Over SmolLM2's and Gemma 3's "
                "one-row products it read the weights 1.9-2.3x (bfloat16) and 2.0-2.8x (float32) as fast as F.linear "
                "on the host of 2026-12-07, level with the fastest of PyTorch's kinds there (benchmarks/products.py), "
                "and its loop is the same on every host, where which BLAS kind is fastest is not; and a float32 "
                "product of 4 rows or more, a prefill's too, in oneDNN (\"onednn\") on AMD CPUs with AVX-512, where "
                "MKL's float32 GEMM ran at half its speed (1.4-2.8x at 4-512 rows, the host of 2026-12-07)"),
    "fold": ("folded where the rule decides it (a KV head serving >= 4 query heads, or the b * g work items sharing "
             "evenly among the threads or at least two a thread); otherwise not folded (SDPA's own GQA)"),
    "native-attention": ("the native kernel wherever it fits from 128 keys, SDPA below (it read a float32 cache "
                         "1.4-2.4x and a bfloat16 one 1.0-1.8x as fast as SDPA from 2,048 to 8,192 keys on the host "
                         "of 2026-12-01, and 130-1,024 keys 1.2-2.7x as fast in both dtypes on the host of "
                         "2026-12-07; under 128 keys not measured)"),
}

_table_lock = threading.Lock()
_table: dict[str, str] | None = None
_forced: str | None = None
_memo: dict[tuple[object, ...], object] = {}  # decisions already looked up, by their shape (cleared with the table)


def _memoised(key: tuple[object, ...], look_up: Callable[[], object]) -> object:
    """``look_up()``, kept in the memo under ``key`` so that a process looks each shape's decision up once. Under
    torch.compile the memo is neither read nor written: the graph holds the decision, and a memo written while
    tracing is a changed global that fails the graph's guard on the next call (a second compile of every step)."""
    if torch.compiler.is_compiling():
        return look_up()
    if key not in _memo:
        _memo[key] = look_up()
    return _memo[key]


def tuning_dir() -> Path:
    """Where tuning tables are kept: $MULTIHEAD_TUNING_DIR, else $XDG_CACHE_HOME/multihead/tuning, else
    ~/.cache/multihead/tuning."""
    if os.environ.get("MULTIHEAD_TUNING_DIR"):
        return Path(os.environ["MULTIHEAD_TUNING_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "multihead" / "tuning"


def _cpu_info() -> tuple[str, str]:
    """The CPU's model name and its flags line, as /proc/cpuinfo gives them ("" where there is none)."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if not model and name in ("model name", "Model", "Hardware"):
                model = value.strip()
            elif not flags and name in ("flags", "Features"):
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def host() -> dict[str, Any]:
    """What a tuning table is valid for: the CPU (model, flags, cores), the machine type and torch's version."""
    model, flags = _cpu_info()
    return {"cpu": model, "cores": os.cpu_count() or 1, "machine": platform.machine(), "torch": torch.__version__,
            "flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def table_path() -> Path:
    """This host's tuning table: ``tuning-<hash of host()>.json`` in :func:`tuning_dir`."""
    digest = hashlib.sha256(json.dumps(host(), sort_keys=True).encode()).hexdigest()[:16]
    return tuning_dir() / f"tuning-{digest}.json"


def check_entries(entries: object, where: str) -> dict[str, str]:
    """A table's entries checked: a JSON object of key -> one of that decision's kinds; a MultiheadError naming
    ``where`` and the first bad entry otherwise."""
    if not isinstance(entries, dict):
        raise MultiheadError(f"{where}: 'entries' must be an object of decision -> kind, got "
                             f"{type(entries).__name__}")
    for key, kind in entries.items():
        word = str(key).split(" ", 1)[0]
        choices = CHOICES.get(word)
        if choices is None:
            raise MultiheadError(f"{where}: entry {key!r} names no decision: keys start with one of "
                                 f"{', '.join(CHOICES)}")
        if kind not in choices:
            raise MultiheadError(f"{where}: entry {key!r} holds {kind!r}: it must be one of {', '.join(choices)}")
    return dict(entries)


def read_table(path: Path) -> dict[str, Any]:
    """A tuning table file as a dict (format, version, host, entries, measured), checked; a MultiheadError naming
    the file and what is wrong with it otherwise."""
    from multihead.hf.config import read_json_object

    data = read_json_object(path, "tuning table")
    if data.get("format") != TABLE_FORMAT or data.get("version") != TABLE_VERSION:
        raise MultiheadError(f"{path}: not a multihead tuning table of version {TABLE_VERSION} (format "
                             f"{data.get('format')!r}, version {data.get('version')!r}): run `multihead tune` again")
    data["entries"] = check_entries(data.get("entries"), str(path))
    return data


def _load_table() -> dict[str, str]:
    path = table_path()
    if not path.exists():
        return {}
    try:
        return dict(read_table(path)["entries"])
    except MultiheadError as e:  # a bad cache file must not stop a forward pass: say so once, decide by the rules
        warnings.warn(f"multihead: the tuning table is not used ({e}); the default rules decide", stacklevel=3)
        return {}


def table() -> dict[str, str]:
    """The decisions of this host's tuning table, read once a process (a copy; {} where there is none)."""
    return dict(_entries())


def _entries() -> dict[str, str]:
    global _table
    if _table is None:
        with _table_lock:
            if _table is None:
                _table = _load_table()
    return _table


def reload_table() -> None:
    """Read the tuning table again at the next decision (after :mod:`multihead.kernels.tuning` wrote it, or the
    directory changed). A process that decodes keeps one table: call this between runs, not within one."""
    global _table
    with _table_lock:
        _table = None
        _memo.clear()


def force_product(kind: str | None) -> None:
    """Take ``kind`` for every product :func:`split_product` lets choose, whatever the table says (a kind the call
    has not, e.g. "blas" for float32, gives F.linear); None: the table and the rules (the default). For tests of the
    kinds themselves, and for measuring them (:mod:`multihead.kernels.tuning`)."""
    global _forced
    if kind is not None and kind not in PRODUCT_KINDS:
        raise MultiheadError(f"unknown product kind {kind!r}: one of {', '.join(PRODUCT_KINDS)}, or None")
    _forced = kind


def forced_product() -> str | None:
    return _forced


def product_key(out_features: int, in_features: int, dtype: torch.dtype, rows: int, blocks: int, threads: int
                ) -> str:
    """The table's key of a product: its weight's shape and dtype, rows, the split's blocks and the threads. Rows
    past :data:`SPLIT_MAX_ROWS` (a prefill's) share one key, ``rows=65+``."""
    count = f"{SPLIT_MAX_ROWS + 1}+" if rows > SPLIT_MAX_ROWS else str(rows)
    return (f"product {out_features}x{in_features} {str(dtype).removeprefix('torch.')} rows={count} blocks={blocks} "
            f"threads={threads}")


def _key_range(t: int) -> str:
    """The power-of-two range of key counts a decision covers: 2^(n-1) .. 2^n - 1 for t of bit length n."""
    n = t.bit_length()
    return f"t={1 << max(n - 1, 0)}-{(1 << n) - 1}"


def attention_key(decision: str, batch: int, n_heads: int, n_kv_heads: int, dtype: torch.dtype, t: int,
                  threads: int) -> str:
    """The table's key of an attention decision ("fold" or "native-attention") at ``t`` keys (its power-of-two
    range)."""
    return (f"{decision} b={batch} h={n_heads} g={n_kv_heads} {str(dtype).removeprefix('torch.')} {_key_range(t)} "
            f"threads={threads}")


ProductShape = tuple[int, int, torch.dtype, int, int, int]  # (out, in, dtype, rows, blocks, threads)


def product_kind(shape: ProductShape, kinds: tuple[str, ...], *, native_default: bool) -> str:
    """Which of ``kinds`` (the same product computed differently; "linear" first) runs for the product of ``shape``
    (out, in, dtype, rows, blocks, threads; the table's key is :func:`product_key` of it): the forced kind
    (:func:`force_product`), else the table's, else the rule (``native_default``: one bfloat16 or float32 row where
    the native kernel is built vectorised for it, "native"; else "linear"). A kind the call cannot take falls back
    to "linear" in :mod:`multihead.layers.linear`. Looked up once a shape (a dict look-up a call after that).

    The rule's other kind: "onednn" for a float32 product of at least :data:`ONEDNN_MIN_ROWS` rows where
    :func:`onednn_host` says oneDNN's float32 matmul is the faster (F.linear is MKL's there).

    The kinds: "linear" is ``F.linear``; "mv" (one row) ``torch.mv``, the matrix-vector kernel; "split" the batched
    product over row blocks of the weight; "blas" (bfloat16/float16 only) ``F.linear`` with oneDNN switched off for
    the call (PyTorch's own vectorised gemv/gemm instead of oneDNN's matmul, whose fixed cost per call, ~40 us on the
    Xeon of 2026-12-01, dominates a one-row product of a small matrix); "native" (one bfloat16 or float32 row)
    :func:`multihead.kernels.native.gemv_bf16` / ``gemv_f32``, C kernels reading the weight at the memory's speed
    (bfloat16 1536 x 576 from memory: 75-88 us against F.linear's 240-278 there); "onednn" (float32, more than one
    row) oneDNN's matmul, ``torch.ops.mkldnn._linear_pointwise`` (:func:`onednn_fits`). Why the table and not one rule:
    the same 2-core Xeon type gave opposite answers on two hosts for float32 (SmolLM2's 210 one-row products 63 ms
    F.linear / 33 split on one, 21.8 / 48.6 on the other), and a weight in cache and one from memory rank the kinds
    differently. The native kernels are the untuned rule because their loop is ours on every host, not a BLAS's.

    Under torch.compile "blas" cannot run (oneDNN's switch is a process setting, not an op): the table's
    ``compiled`` choice for the key (the fastest other kind measured) or "linear" runs instead; "native" is the
    operator ``torch.ops.multihead.gemv_bf16``.
    """
    if _forced is not None:
        return _forced
    compiling = torch.compiler.is_compiling()
    if not compiling and in_a_mode():
        return "linear"

    def look_up() -> str:
        key = product_key(*shape)
        found = _entries().get(key)
        if found is None or found not in kinds:
            if native_default and "native" in kinds:
                return "native"
            _out, _in, dtype, rows, _blocks, _threads = shape
            onednn = "onednn" in kinds and dtype == torch.float32 and rows >= ONEDNN_MIN_ROWS and onednn_host()
            return "onednn" if onednn else "linear"
        if found == "blas" and compiling:
            compiled = _entries().get(key + " compiled")
            return compiled if compiled is not None and compiled in kinds and compiled != "blas" else "linear"
        return found

    return _memoised((shape, kinds, native_default), look_up)  # type: ignore[return-value]


def split_product(rows: int, weight: Tensor, x: Tensor) -> int:
    """How many row blocks the split kind of ``x @ weight.T`` takes (1: plain ``F.linear``, no kind to choose).

    float32: split over the process's intra-op threads (:func:`intra_op_threads`; whether the split runs at all is
    the table's decision, :func:`product_kind`). Measured (the 210 matrices of SmolLM2-135M at one row, idle 2-core
    Xeon): 63 ms with F.linear, whose gemv kept to one core there, 33 ms split in 2; 1536 x 576 at 1-64 rows 0.4-0.8x
    the time of F.linear; from about 128 rows the two are level.

    bfloat16 and float16: split in at least 2 blocks. Their F.linear at one row (oneDNN's AMX matmul, x as the
    one-row left operand) is slow for the larger matrices; ``W @ x^T`` (the weight as the left operand, as the split
    runs it) is not. One process, alternating, best of 15 (load average 6.7 on the 2 cores), bfloat16 F.linear
    against split in 2, 2 threads: 1536 x 576 478 / 60 us, 576 x 1536 383 / 56 us, 576 x 576 73 / 68 us. Weights
    under SPLIT_MIN_WEIGHT elements sit in cache and the split's own dispatch costs more than it saves (float32
    72 x 64 at one row: 20 us split, 5 us plain).
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
    n = intra_op_threads()
    if weight.dtype != torch.float32:
        n = max(n, 2)  # the layout gains with one thread too (see above)
    return n if n > 1 and weight.shape[0] % n == 0 else 1


def fold_gqa_decode(batch: int, n_heads: int, n_kv_heads: int, s: int, device: torch.device,
                    plain_causal: bool, t: int = 0, dtype: torch.dtype | None = None) -> bool:
    """Whether SDPA runs a GQA decode step with each group's query heads folded into rows (so its CPU kernel reads
    each KV head once instead of once per query head).

    On the CPU, folded when the folded work items (b * g) share evenly among the threads, or are at least two per
    thread, or each KV head serves at least 4 query heads. Measured with SDPA's CPU flash kernel (float32,
    head_dim 64, time folded / not folded): 32/8 heads, 4096 keys 0.73; 8/1, 2048 keys 0.71; 16/2 0.40, 12/4 0.91,
    9/3 at batch 2 0.88, 15/5 1.00 (1024 keys). Otherwise (SmolLM2's 9/3 at batch 1: 3 items for 2 threads) it
    depends on the host and the length: on one host folding was 1.07-1.24x slower for 4096-64 keys, on the host of
    2026-12-01 (30 layers' caches in turn) float32 1k keys 2.5 ms folded / 3.8 unfolded, 8k 30.9 / 48.4; bfloat16
    level. There the table decides, per (b, h, g, dtype, power-of-two range of t, threads); without an entry, not
    folded.
    """
    if not _enabled or n_kv_heads == n_heads or s != 1 or device.type != "cpu" or plain_causal:
        return False
    threads = intra_op_threads()
    items = batch * n_kv_heads
    if n_heads // n_kv_heads >= 4 or items % threads == 0 or items >= 2 * threads:
        return True
    assert dtype is not None
    return bool(_memoised(("fold", batch, n_heads, n_kv_heads, dtype, t.bit_length(), threads),
                          lambda: _entries().get(attention_key("fold", batch, n_heads, n_kv_heads, dtype, t,
                                                               threads)) == "folded"))


NATIVE_DECODE_KEYS = {torch.float32: 128, torch.bfloat16: 128}  # untuned: native decode from this many keys


def native_decode_attention(batch: int, n_heads: int, n_kv_heads: int, dtype: torch.dtype, t: int) -> str | None:
    """Whether a decode step that :func:`multihead.kernels.native.attend_dense` takes (one query a head, every key
    visible, no gradient: the dispatcher checks) runs there instead of SDPA's CPU kernel: the reason it does, or None.

    The native kernel reads each KV head once for all the query heads it serves, float32 sums, with software
    prefetch. Measured (SmolLM2's 9/3 heads, head_dim 64, 30 layers' caches in turn, one process, alternating,
    medians of 7, the host of 2026-12-01): 8,192 keys float32 25.8 ms against SDPA's 62.9, bfloat16 15.3 against
    27.1; 2,048 keys float32 8.8 / 12.4, bfloat16 7.4 / 7.7. Below that SDPA's kernel wins (its call costs less
    than the native kernel's, whose advantage is reading the keys once): SmolLM2 in transformers, whole decode steps
    with the two kernels alternating, the 2-core Intel Xeon host of 2026-12-06: a 260-key sinks + window ring in
    either dtype and 1,024 bfloat16 keys ran 1-4% faster through SDPA, 1,024 float32 keys 2% faster natively (the
    kernel then called through ctypes). On the 2-core AMD EPYC host of 2026-12-07 (the kernel a PyTorch operator),
    SDPA's unfolded bfloat16 decode took 1.0 ms a layer at 1,024 keys against the kernel's 0.07: whole steps 69.2 ms
    against 46.4 with the kernel, and a 260-key ring 5% faster natively. A 1-4% loss on one host against a 1.5x gain
    on another: native from 1,024 keys in both dtypes. Then, the same AMD host, the kernel an operator
    (:func:`multihead.kernels.tuning.tune_attention`, 8 layers' caches in turn, medians of 15, two rounds):
    SmolLM2's 9/3 heads at 130, 511 and 1,024 keys 1.3-2.6x as fast natively in float32, 1.6-2.3x in bfloat16; Gemma
    3's 4/1 heads of 256 at the same lengths 1.7-2.7x and 1.2-1.8x (511 keys: Gemma's sliding window; a sinks +
    window ring holds 260). The Intel figures above were whole steps through ctypes, within their noise: native from
    128 keys in both dtypes. The table decides per (b, h, g, dtype, power-of-two range of t, threads; ``multihead
    tune`` measures the ranges from 256 keys); without an entry, native from NATIVE_DECODE_KEYS keys (by dtype),
    SDPA below (a call's fixed cost, not measured under 128 keys)."""
    if not _enabled or (not torch.compiler.is_compiling() and in_a_mode()):
        return None
    threads = intra_op_threads()

    def look_up() -> str | None:
        found = _entries().get(attention_key("native-attention", batch, n_heads, n_kv_heads, dtype, t, threads))
        if found is None:
            least = NATIVE_DECODE_KEYS.get(dtype, NATIVE_DECODE_KEYS[torch.float32])
            return f"the default from {least:,} keys where no tuning says otherwise" if t >= least else None
        return None if found == "sdpa" else "the host's tuning table"

    return _memoised(("native-attention", batch, n_heads, n_kv_heads, dtype, t.bit_length(), threads),
                     look_up)  # type: ignore[return-value]


def native_quantized_decode(bits: int) -> bool:
    """Whether a decode step over a 4- or 8-bit :class:`~multihead.cache.QuantizedKVCache` (one query a head, every
    key visible: the dispatcher checks) attends in :func:`multihead.kernels.native.attend_q4` / ``attend_q8``, reading
    the codes once inside the attention, instead of dequantising the whole prefix into a tensor for SDPA: wherever the
    kernels are built. Measured (SmolLM2's 9/3 heads, head_dim 64, 8,192 cached tokens, 30 layers' caches in turn,
    the hosts of 2026-12-01 and 12-02): 4 bits float32 38 ms against 176 ms dequantised + SDPA, 8 bits 9.3 against
    103; 2 bits always dequantise."""
    if not _enabled or bits not in (4, 8) or (not torch.compiler.is_compiling() and in_a_mode()):
        return False
    from multihead.kernels import native

    return native.available()


def native_codec(x: Tensor) -> bool:
    """Whether a :class:`~multihead.cache.QuantizedKVCache`'s write of whole groups and a kernel's read of its codes
    back into keys and values run in :func:`multihead.kernels.native.quantize_into` /
    :func:`~multihead.kernels.native.dequantize_into` (one pass, the same bits as :mod:`multihead.quant`'s PyTorch
    code; the caller checks the layouts with :func:`~multihead.kernels.native.codec_fits`): on the CPU wherever the
    kernels are built. Measured (benchmarks/codec.py: SmolLM2's and Gemma 3's caches, a 4,096-token prefill in chunks
    of 512, 4 and 8 bits, both dtypes, the AMD host of 2026-12-07): writes 2.7-3.5x and reads 2.0-4.5x as fast as
    PyTorch's ops (SmolLM2 bfloat16 4 bits: 126 + 264 ms of a ~9 s prefill down to 41 + 82)."""
    if not _enabled or not x.is_cpu or (not torch.compiler.is_compiling() and in_a_mode()):
        return False
    from multihead.kernels import native

    return native.available()


def fused_low_precision_norm(x: Tensor) -> bool:
    """Whether a bfloat16/float16 RMSNorm on the CPU runs as PyTorch's ``F.rms_norm`` (one call, normalised in
    float32, composed in C++) instead of transformers' formula (six Python-level ops and two casts). Measured,
    bfloat16 (1, 1, 576), one process, alternating: 17-18 us against 22-37 us; over 1,000 rows of size ~3 the
    largest relative error to the float64 formula 0.0039 against 0.0076."""
    return _enabled and x.is_cpu


_no_bf16: list[bool] = []  # the answer, once /proc/cpuinfo has been read


def _no_bf16_matmul() -> bool:
    if not _no_bf16:  # read /proc/cpuinfo once a process, not once a product
        from multihead.kernels import native

        flags = native.cpu_flags()
        _no_bf16.append("sse2" in flags and not {"avx512_bf16", "amx_bf16"} & flags)  # an x86 CPU it describes
    return _no_bf16[0]


# Whether this CPU is an x86 one without bfloat16 instructions (AVX512-BF16, AMX): read once a process, a constant
# under torch.compile.
no_bf16_matmul: Callable[[], bool] = torch.compiler.assume_constant_result(_no_bf16_matmul)


def upcast_product(rows: int, weight: Tensor, x: Tensor) -> bool:
    """Whether ``x @ weight.T`` in bfloat16 runs in float32 (the weight converted block by block, the output rounded
    to bfloat16 once; :func:`multihead.layers.linear.upcast`): more rows than :data:`SPLIT_MAX_ROWS` (a prefill, not a
    decode step), inference, on an x86 CPU without AVX512-BF16 or AMX. There PyTorch's bfloat16 matmul (oneDNN)
    has no bfloat16 instruction to use. Measured on such a 2-core Xeon (AVX-512, 2 threads, 2026-12-04), 1536 x 576:
    64 rows 2.15 ms bfloat16 / 1.26 upcast, 512 rows 17.4 / 5.4, 4,096 rows 121.7 / 33.8. oneDNN's bfloat16 product
    also sums in float32 and rounds once, so the two differ only in the order of the sums."""
    if (
        not _enabled
        or rows <= SPLIT_MAX_ROWS
        or weight.dtype != torch.bfloat16
        or x.dtype != torch.bfloat16
        or not x.is_cpu
        or not weight.is_cpu
        or type(weight) not in (Tensor, torch.nn.Parameter)
        or type(x) is not Tensor
        or weight.ndim != 2
        or weight.shape[1] != x.shape[-1]
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        or (not torch.compiler.is_compiling() and in_a_mode())
    ):
        return False
    return no_bf16_matmul()


ONEDNN_MIN_ROWS = 4  # the rule's "onednn" from this many rows
_onednn_float32: list[bool] = []  # the answer, once /proc/cpuinfo has been read


def _onednn_host() -> bool:
    if not _onednn_float32:  # /proc/cpuinfo read once a process, not once a product
        from multihead.kernels import native

        _onednn_float32.append(_cpu_vendor() == "AuthenticAMD" and "avx512f" in native.cpu_flags()
                               and onednn_available())
    return _onednn_float32[0]


def _cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"; "" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "vendor_id":
                return value.strip()
    except OSError:
        pass
    return ""


# Whether the untuned rule runs a float32 product of ONEDNN_MIN_ROWS rows or more in oneDNN: an x86 CPU of AMD's with
# AVX-512. There MKL's float32 GEMM (F.linear) does not run at the AVX-512 speed that oneDNN's does: measured on a
# 2-core AMD EPYC (family 26, AVX-512, torch 2.13, 2026-12-07), F.linear's time over oneDNN's at 4 / 13 / 64 / 256 /
# 512 rows: 2048 x 640 1.42 / 1.58 / 2.80 / 2.66 / 2.29, 640 x 2048 1.62 / 2.16 / 2.42 / 2.58 / 2.28, 576 x 576
# 1.37 / 1.33 / 1.36 / 2.15 / 2.21 (2 threads; in one thread 1.0-2.3), 140-180 GFLOP/s against 320-400 at 512 rows.
# On a 2-core Intel Xeon the same day oneDNN's float32 linear was not faster than F.linear. Other AMD CPUs are not
# measured; a host's tuning table decides over the rule (multihead tune measures a prefill's rows too). A constant
# under torch.compile.
onednn_host: Callable[[], bool] = torch.compiler.assume_constant_result(_onednn_host)


def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's linear operator (``torch.ops.mkldnn._linear_pointwise``)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_fits(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``F.linear(x, weight, bias)`` may run as oneDNN's float32 matmul (the kind "onednn"): float32 CPU
    tensors of the plain tensor types, a (out, in) weight matching x's last dimension, a float32 bias of out
    elements or none, no gradient wanted (the operator has no backward), eager with no mode watching (a FLOP
    counter counts F.linear) and the operator built into this PyTorch. The same sums as MKL's in another order:
    measured over 8 weight shapes at 1-1,024 rows, the largest error to float64 was level with F.linear's
    (1e-6 to 9e-6), and oneDNN gave the same bits in one thread and two at every one."""
    return (
        _enabled
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.is_cpu
        and weight.is_cpu
        and type(weight) in (Tensor, torch.nn.Parameter)
        and type(x) is Tensor
        and weight.ndim == 2
        and x.ndim >= 1
        and weight.shape[1] == x.shape[-1]
        and (bias is None or (bias.dtype == torch.float32 and bias.shape == weight.shape[:1] and bias.is_cpu))
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad)))
        and not torch.compiler.is_compiling()
        and not in_a_mode()
        and onednn_available()
    )
