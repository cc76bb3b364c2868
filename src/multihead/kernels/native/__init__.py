"""Native CPU kernels: a few C functions (``kernels.c`` beside this file) built by an explicit step (``python -m
multihead.kernels.native build``, ``multihead tune``, the set-up), never inside a forward, one build per instruction-set
variant, the CPU's best variant chosen at run time (as ggml does), and registered as PyTorch
operators (``torch.ops.multihead.*``: schemas and fake kernels, so ``torch.compile`` sees them).

The kernels:

- :func:`gemv_bf16` (``torch.ops.multihead.gemv_bf16``), decoding's one-row bfloat16 product
  ``F.linear(x, W, bias)``, with software prefetch: it reads a bfloat16 weight at about twice the speed of
  PyTorch's one-row kernels on an AVX512-BF16 host (the figures, host and date: benchmarks/RESULTS.md, "The native
  CPU kernels"). The product kind "native" of :func:`multihead.kernels.cpu.product_kind`.
- :func:`attend_dense` (``torch.ops.multihead.attend_dense``), a decode step's attention over a float32 or
  bfloat16 cache, each KV head read once for all its query heads.
- :func:`attend_q4` and :func:`attend_q8` (``torch.ops.multihead.attend_quantized``), a decode step's attention
  over a 4- or 8-bit KIVI cache's codes, read once inside the attention and never dequantised into memory.

Variants (:data:`VARIANTS`): "avx512bf16" (AVX-512 F/BW/DQ/VL and AVX512-BF16: every fast path), "avx512" (the
attention kernels' AVX-512 chunks; the bfloat16 product's portable loop) and "generic" (no -m flag: the compiler's
baseline for the machine, portable loops throughout). :func:`variant` picks the best one this CPU's flags allow, or
``MULTIHEAD_NATIVE_VARIANT`` names one (a lower one, to test the portable paths). Each is built once per machine
and source, ``cc -O3 -fopenmp -shared -fPIC`` and the variant's flags, into ``$MULTIHEAD_NATIVE_DIR`` (default
``$XDG_CACHE_HOME/multihead/native``, else ``~/.cache/multihead/native``), named by the variant and a hash of the
source, the compiler's version and the command, written to a temporary name and renamed into place (processes
building at once do not see half a file). A process loads the built library on first use; before the build step has
run, without a compiler, when the build failed, or with ``MULTIHEAD_NATIVE=0``, :func:`library` is None,
:func:`unavailable` says why (and, except when turned off on purpose, a warning says it once a process, with the
command that builds them), and every caller keeps PyTorch's kernels: nothing is lost but the speed. The operators
then raise, naming the reason.

In the package's own hot paths (:mod:`multihead.layers.linear`, :mod:`multihead.kernels`) eager calls go to the Python
functions with ``check=False`` (their callers hold well-formed tensors, and the dispatcher's round trip and the checks
would cost more than some of the kernels, on every layer of every step); compiled graphs call the operators.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("kernels.c")
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_AVX512 = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
_AVX512_CPU = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl")
# name -> (compiler flags, the CPU flags (/proc/cpuinfo) it needs), best first
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512bf16": ((*_AVX512, "-mavx512bf16"), (*_AVX512_CPU, "avx512_bf16")),
    "avx512": (_AVX512, _AVX512_CPU),
    "generic": ((), ()),
}
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library or None; "why": the reason it is None; "variant"; "isa"
_local = threading.local()  # each thread's scratch buffer (ctypes releases the GIL: threads may call at once)
SCRATCH_KEPT = 1 << 22  # floats (16 MiB) of scratch a thread keeps between calls; a larger call allocates its own


def cache_dir() -> Path:
    """Where built libraries are kept: $MULTIHEAD_NATIVE_DIR, else $XDG_CACHE_HOME/multihead/native, else
    ~/.cache/multihead/native."""
    if os.environ.get("MULTIHEAD_NATIVE_DIR"):
        return Path(os.environ["MULTIHEAD_NATIVE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "multihead" / "native"


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def supported(name: str) -> bool:
    """Whether this CPU runs variant ``name`` (it has every flag the variant is compiled for)."""
    return set(VARIANTS[name][1]) <= cpu_flags()


def variant() -> str:
    """The variant this process loads: ``MULTIHEAD_NATIVE_VARIANT`` if set (checked: a name of :data:`VARIANTS` this
    CPU supports), else the best one the CPU supports."""
    asked = os.environ.get("MULTIHEAD_NATIVE_VARIANT")
    if asked:
        if asked not in VARIANTS:
            raise RuntimeError(f"MULTIHEAD_NATIVE_VARIANT={asked!r} is not a variant: choose one of "
                               f"{', '.join(VARIANTS)}")
        if not supported(asked):
            missing = sorted(set(VARIANTS[asked][1]) - cpu_flags())
            raise RuntimeError(f"MULTIHEAD_NATIVE_VARIANT={asked!r} needs CPU flags this CPU lacks: "
                               f"{', '.join(missing)}")
        return asked
    return next(name for name in VARIANTS if supported(name))


def _compiler() -> str | None:
    for name in (os.environ.get("CC") or "cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _target(name: str, cc: str | None) -> tuple[str, tuple[str, ...], Path]:
    """The compiler, its flags and the library file variant ``name`` of this source is built into (named by a hash of
    the source, the compiler's version and the command); raises RuntimeError without a compiler that runs."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    flags = (*BASE_FLAGS, *VARIANTS[name][0])
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the C compiler {cc} did not run: {e}") from e
    digest = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode()])).hexdigest()[:16]
    return cc, flags, cache_dir() / f"kernels-{name}-{digest}.so"


def built(name: str, cc: str | None = None) -> Path | None:
    """The library of variant ``name`` if it was built here (never builds it); raises RuntimeError without a
    compiler (the library's name depends on the compiler's version)."""
    out = _target(name, cc)[2]
    return out if out.exists() else None


def build(name: str, cc: str | None = None) -> Path:
    """The built library of variant ``name`` (built now unless already there); raises RuntimeError naming the
    failure (no compiler, a compiler that does not run, a failed or timed-out build). Only the explicit steps call
    it (:func:`build_now`: ``python -m multihead.kernels.native build``, ``multihead tune``, the set-up), never a
    forward."""
    cc, flags, out = _target(name, cc)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            tail = " ".join(done.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"{cc} {' '.join(flags)} {SOURCE.name} exited with {done.returncode}: {tail}")
        os.replace(tmp, out)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{cc} did not finish building {SOURCE.name} in {BUILD_TIMEOUT_S} s") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class DenseArgs(ctypes.Structure):
    """mh_dense_args of kernels.c, field for field."""

    _fields_ = (("B", _I64), ("G", _I64), ("HPG", _I64), ("D", _I64), ("t", _I64), ("q", _PTR),
                ("k", _PTR), ("k_b", _I64), ("k_g", _I64), ("k_t", _I64),
                ("v", _PTR), ("v_b", _I64), ("v_g", _I64), ("v_t", _I64),
                ("bf16", _I64), ("scale", _F32), ("out", _PTR), ("scratch", _PTR), ("threads", _I64),
                ("keep", _PTR), ("keep_b", _I64))


class QuantArgs(ctypes.Structure):
    """mh_quant_args of kernels.c, field for field."""

    _fields_ = (("bits", _I64), ("B", _I64), ("G", _I64), ("HPG", _I64), ("D", _I64), ("n", _I64),
                ("group", _I64), ("m", _I64), ("q", _PTR),
                ("ck", _PTR), ("ck_b", _I64), ("ck_g", _I64),
                ("sk", _PTR), ("mk", _PTR), ("sk_b", _I64), ("sk_g", _I64),
                ("cv", _PTR), ("cv_b", _I64), ("cv_g", _I64),
                ("sv", _PTR), ("mv", _PTR), ("sv_b", _I64), ("sv_g", _I64),
                ("tk", _PTR), ("tv", _PTR), ("scale", _F32), ("out", _PTR), ("scratch", _PTR), ("threads", _I64),
                ("keep", _PTR), ("keep_b", _I64))


NOT_BUILT = ("not built here yet: run `python -m multihead.kernels.native build` (or `multihead tune`) once; the "
             "set-up (make) does")


def _load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    if os.environ.get("MULTIHEAD_NATIVE", "1") == "0":
        return None, "turned off by MULTIHEAD_NATIVE=0", None
    try:
        name = variant()
        path = built(name)
        if path is None:
            return None, NOT_BUILT, None
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as e:
        return None, str(e), None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.mh_gemv_bf16.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_int]
    lib.mh_gemv_bf16.restype = None
    lib.mh_isa.argtypes = []
    lib.mh_isa.restype = ctypes.c_int
    lib.mh_attend_quantized_scratch.argtypes = [i64] * 7
    lib.mh_attend_quantized_scratch.restype = i64
    lib.mh_attend_quantized.argtypes = [ctypes.POINTER(QuantArgs)]
    lib.mh_attend_quantized.restype = ctypes.c_int
    lib.mh_attend_dense_scratch.argtypes = [i64] * 5
    lib.mh_attend_dense_scratch.restype = i64
    lib.mh_attend_dense.argtypes = [ctypes.POINTER(DenseArgs)]
    lib.mh_attend_dense.restype = ctypes.c_int
    return lib, None, name


def build_now() -> str | None:
    """Build this CPU's variant now (a no-op when it is built) and load it in this process: None, or why not (no
    compiler, a failed build: the compiler's own words). The explicit step (``python -m multihead.kernels.native
    build``, ``multihead tune``, the set-up); a forward never builds."""
    if os.environ.get("MULTIHEAD_NATIVE", "1") == "0":
        return "turned off by MULTIHEAD_NATIVE=0"
    why: str | None = None
    try:
        build(variant())
    except RuntimeError as e:
        why = str(e)
    with _lock:
        _state.clear()
    if why is not None:
        with _lock:
            _state.update(lib=None, why=why, variant=None, isa=0)
        return why
    return unavailable()


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when they cannot be had (:func:`unavailable` says why; a warning says it once a
    process, unless they were turned off on purpose). Never builds them: until :func:`build_now` has run once on
    this machine (the set-up does), PyTorch's kernels run and the warning says how to build."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, why, name = _load()
                _state["variant"], _state["why"] = name, why
                _state["isa"] = lib.mh_isa() if lib is not None else 0
                _state["lib"] = lib
                if lib is None and why != "turned off by MULTIHEAD_NATIVE=0":
                    warnings.warn(f"multihead's native CPU kernels are not available ({why}): PyTorch's kernels run "
                                  "instead (the same results within rounding, slower decoding)", RuntimeWarning,
                                  stacklevel=2)
    loaded = _state["lib"]
    return loaded if isinstance(loaded, ctypes.CDLL) else None


def unavailable() -> str | None:
    """Why the kernels are not there (None when they are); loads them first if no call has yet."""
    library()
    why = _state.get("why")
    return why if isinstance(why, str) else None


def loaded_variant() -> str | None:
    """The variant loaded (:data:`VARIANTS`), or None without the kernels."""
    library()
    name = _state.get("variant")
    return name if isinstance(name, str) else None


def _isa_now() -> int:
    """What the kernels can do here: -1 without them, else their instruction-set bits (1 AVX-512, 2 AVX512-BF16)."""
    return -1 if library() is None else int(_state.get("isa", 0))  # type: ignore[call-overload]


# A property of the host and the process, so torch.compile takes it as a constant of the graph: a trace that is the
# process's first use of the kernels loads them eagerly instead of breaking the graph at the loader's lock.
_isa: Callable[[], int] = torch.compiler.assume_constant_result(_isa_now)


def available() -> bool:
    """Whether the kernels are loaded (loaded on the process's first call; :func:`unavailable` says why not)."""
    return _isa() >= 0


def vectorised() -> bool:
    """Whether the loaded kernels have this CPU's AVX512-BF16 products (else the product is a portable loop)."""
    isa = _isa()
    return isa > 0 and bool(isa & 2)


def avx512() -> bool:
    """Whether the loaded kernels have the attention kernels' AVX-512 chunks (attend_dense needs them)."""
    isa = _isa()
    return isa > 0 and bool(isa & 1)


def _required() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"multihead's native kernels are not available: {unavailable()}")
    return lib


def scratch(floats: int) -> Tensor:
    """Working memory (float32) of at least ``floats`` for one kernel call of this thread: the thread's buffer, kept
    between calls and grown to the largest asked for, up to SCRATCH_KEPT floats; a new tensor beyond that. A decode
    step's attention needs ~0.4-0.7 MB a layer at 8,192 keys (SmolLM2's heads), and a fresh allocation of that size is
    a new mapping whose pages fault in on every call. On the 2-core host of 2026-12-02, 30 layers' 4-bit attention at
    8,192 keys took 9.4 ms through the wrapper as it was (a fresh scratch, the checks, the tails converted a call) and
    6.1 ms as bare kernel calls with every buffer prepared."""
    if floats > SCRATCH_KEPT:
        return torch.empty(floats, dtype=torch.float32)
    buf: Tensor | None = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < floats:
        buf = _local.scratch = torch.empty(floats, dtype=torch.float32)
    return buf


# ---------------------------------------------------------------------------------------------- gemv_bf16
def gemv_bf16(x: Tensor, weight: Tensor, bias: Tensor | None = None, threads: int | None = None, *,
              check: bool = True) -> Tensor:
    """``F.linear(x, weight, bias)`` for one bfloat16 row ``x`` (any leading shape of one element) on the CPU, by the
    native kernel: float32 sums rounded once to bfloat16. ``threads``: OpenMP threads (default: PyTorch's
    intra-op count). No autograd: for inference (the caller checks). Raises RuntimeError when the kernels are not
    there (:func:`unavailable`) and ValueError naming what does not fit; ``check=False`` skips the checks, for a
    caller that made them (:func:`multihead.layers.linear.linear`: a wrong layout there reads the wrong memory)."""
    lib = _required()
    in_features = weight.shape[-1] if weight.ndim == 2 else -1
    if check:
        _check_gemv(x, weight, bias, in_features)
    out = weight.shape[0]
    y = torch.empty((*x.shape[:-1], out), dtype=torch.bfloat16)
    lib.mh_gemv_bf16(weight.data_ptr(), weight.stride(0), x.data_ptr(), None if bias is None else bias.data_ptr(),
                     y.data_ptr(), out, in_features, torch.get_num_threads() if threads is None else threads)
    return y


def _check_gemv(x: Tensor, weight: Tensor, bias: Tensor | None, in_features: int) -> None:
    problems = []
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        problems.append(f"dtypes {x.dtype} and {weight.dtype} (bfloat16 both)")
    if not (x.is_cpu and weight.is_cpu):
        problems.append(f"devices {x.device} and {weight.device} (cpu both)")
    if weight.ndim != 2 or weight.stride(-1) != 1:
        problems.append(f"weight of shape {tuple(weight.shape)} and strides {weight.stride()} "
                        "(2-D, rows of unit stride)")
    if x.numel() != in_features or not x.is_contiguous():
        problems.append(f"x of shape {tuple(x.shape)} (one contiguous row of {in_features})")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (weight.shape[0],)
                             or not bias.is_contiguous() or not bias.is_cpu):
        problems.append(f"bias of shape {tuple(bias.shape)} and dtype {bias.dtype} "
                        f"(contiguous bfloat16 of {weight.shape[0]})")
    if problems:
        raise ValueError("gemv_bf16: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------- attend_q4 / q8
def attend_q4(q: Tensor, codes_k: Tensor, scale_k: Tensor, min_k: Tensor, codes_v: Tensor, scale_v: Tensor,
              min_v: Tensor, n: int, group: int, tail_k: Tensor, tail_v: Tensor, scale: float,
              threads: int | None = None, *, keep: Tensor | None = None, check: bool = True) -> Tensor:
    """One decode step's attention over a 4-bit KIVI store read as codes (never dequantised into memory), with its
    full-precision tail: softmax(q K^T * scale) V over the ``n`` quantized tokens then ``tail_k``/``tail_v``.

    q (b, h, 1, d), query head i reading KV head i // (h / g); codes_k, codes_v (b, g, >= n, d / 2) uint8 (two codes a
    byte, the even channel low); scale_k, min_k (b, g, >= n / group, d) float16 (keys per channel over groups of
    ``group`` tokens); scale_v, min_v (b, g, >= n, d / group) float16 (values per token over groups of ``group``
    channels); tail_k, tail_v (b, g, m, d) in any float dtype (read as float32). Returns (b, h, 1, d) in q's dtype;
    sums in float32 (the reference, dequantise then SDPA, rounds the keys to the cache's dtype first: the two agree
    within that rounding). ``keep`` (b, n + m) bool, where given, hides the keys it marks False (a sliding layer's
    ring: slots out of the window or not yet written); every row must keep at least one key. Inference only, CPU only;
    raises ValueError naming what does not fit. ``check=False``
    skips the checks of the tensors' shapes, dtypes and layouts, for a caller that holds them well formed
    (:func:`multihead.kernels.attend` with a :class:`~multihead.cache.QuantizedKV` of the cache's own buffers: a
    wrong layout there reads the wrong memory)."""
    return _attend_codes(4, q, codes_k, scale_k, min_k, codes_v, scale_v, min_v, n, group, tail_k, tail_v, scale,
                         threads, check, keep)


def attend_q8(q: Tensor, codes_k: Tensor, scale_k: Tensor, min_k: Tensor, codes_v: Tensor, scale_v: Tensor,
              min_v: Tensor, n: int, group: int, tail_k: Tensor, tail_v: Tensor, scale: float,
              threads: int | None = None, *, keep: Tensor | None = None, check: bool = True) -> Tensor:
    """:func:`attend_q4` for an 8-bit store: codes_k, codes_v (b, g, >= n, d) uint8, one code a byte; the rest as
    there (any group dividing d and n)."""
    return _attend_codes(8, q, codes_k, scale_k, min_k, codes_v, scale_v, min_v, n, group, tail_k, tail_v, scale,
                         threads, check, keep)


def _attend_codes(bits: int, q: Tensor, codes_k: Tensor, scale_k: Tensor, min_k: Tensor, codes_v: Tensor,
                  scale_v: Tensor, min_v: Tensor, n: int, group: int, tail_k: Tensor, tail_v: Tensor, scale: float,
                  threads: int | None, check: bool, keep: Tensor | None = None) -> Tensor:
    """attend_q4 / attend_q8: the checks, then the kernel (mh_attend_quantized) for ``bits`` 4 or 8."""
    name = f"attend_q{bits}"
    lib = _required()
    b, h, _, d = q.shape
    g = codes_k.shape[1]
    m = tail_k.shape[2]
    if check:
        _check_codes(name, bits, q, codes_k, scale_k, min_k, codes_v, scale_v, min_v, n, group, tail_k, tail_v)
        _check_keep(name, keep, b, n + m)
    kept = _keep_bytes(keep)
    f32 = torch.float32
    qg = q.reshape(b, g, h // g, d).to(f32).contiguous()
    tk, tv = tail_k.to(f32).contiguous(), tail_v.to(f32).contiguous()
    out = torch.empty(b, g, h // g, d, dtype=f32)
    work = scratch(lib.mh_attend_quantized_scratch(b, g, h // g, d, n, group, m))
    args = QuantArgs(bits, b, g, h // g, d, n, group, m, qg.data_ptr(),
                     codes_k.data_ptr(), codes_k.stride(0), codes_k.stride(1),
                     scale_k.data_ptr(), min_k.data_ptr(), scale_k.stride(0), scale_k.stride(1),
                     codes_v.data_ptr(), codes_v.stride(0), codes_v.stride(1),
                     scale_v.data_ptr(), min_v.data_ptr(), scale_v.stride(0), scale_v.stride(1),
                     tk.data_ptr(), tv.data_ptr(), scale, out.data_ptr(), work.data_ptr(),
                     torch.get_num_threads() if threads is None else threads,
                     None if kept is None else kept.data_ptr(), 0 if kept is None else kept.stride(0))
    if lib.mh_attend_quantized(ctypes.byref(args)):
        raise ValueError(f"{name}: the kernel refused head_dim {d}, group {group}, n {n}, m {m}")
    return out.view(b, h, 1, d).to(q.dtype)


def _check_codes(name: str, bits: int, q: Tensor, codes_k: Tensor, scale_k: Tensor, min_k: Tensor, codes_v: Tensor,
                 scale_v: Tensor, min_v: Tensor, n: int, group: int, tail_k: Tensor, tail_v: Tensor) -> None:
    """A ValueError naming every way these tensors do not fit the ``bits``-bit kernel, if any does not."""
    b, h, s, d = q.shape
    g = codes_k.shape[1]
    m = tail_k.shape[2]
    row = d * bits // 8  # bytes of codes a token
    problems = []
    if s != 1:
        problems.append(f"q of shape {tuple(q.shape)} (one query a head)")
    if g < 1 or h % g:
        problems.append(f"{h} query heads over {g} KV heads (g must divide h)")
    even = bits == 4
    if (even and (d % 2 or group % 2)) or group < 1 or d % group or n % group or n < 0 or n + m < 1:
        problems.append(f"head_dim {d}, group {group}, {n} quantized and {m} full tokens ("
                        + ("d and group even, " if even else "") + "group dividing d and n, at least one token)")
    for label, t, shape, dtype in (("codes_k", codes_k, (b, g, None, row), torch.uint8),
                                   ("codes_v", codes_v, (b, g, None, row), torch.uint8),
                                   ("scale_k", scale_k, (b, g, None, d), torch.float16),
                                   ("min_k", min_k, (b, g, None, d), torch.float16),
                                   ("scale_v", scale_v, (b, g, None, d // max(group, 1)), torch.float16),
                                   ("min_v", min_v, (b, g, None, d // max(group, 1)), torch.float16)):
        rows = n // max(group, 1) if label in ("scale_k", "min_k") else n
        if (t.dtype != dtype or t.ndim != 4 or t.shape[:2] != shape[:2] or t.shape[3] != shape[3]
                or t.shape[2] < rows or t.stride(3) != 1 or t.stride(2) != t.shape[3] or not t.is_cpu):
            problems.append(f"{label} of shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype} "
                            f"((b, g, >= {rows}, {shape[3]}) {dtype}, rows contiguous)")
    if tail_k.shape != (b, g, m, d) or tail_v.shape != (b, g, m, d):
        problems.append(f"tails of shapes {tuple(tail_k.shape)} and {tuple(tail_v.shape)} ({(b, g, m, d)})")
    if not (q.is_cpu and tail_k.is_cpu and tail_v.is_cpu and q.is_floating_point() and tail_k.is_floating_point()
            and tail_v.is_floating_point()):
        problems.append(f"q and the tails on {q.device} / {tail_k.device} as {q.dtype} / {tail_k.dtype} "
                        "(floating point on the CPU)")
    if scale_k.stride() != min_k.stride() or scale_v.stride() != min_v.stride():
        problems.append("scales and minimums laid out differently")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------- attend_dense
DENSE_HEAD_DIMS = (64, 128)
DENSE_MAX_GROUP = 8  # query heads a KV head serves, at most


def dense_fits(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`attend_dense` takes these tensors: the kernels built with AVX-512, one query a head, head_dim
    64 or 128 for keys and values, at most DENSE_MAX_GROUP query heads a KV head, float32 or bfloat16 keys and
    values of one dtype on the CPU, each key and value row contiguous and k, v laid out alike."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    h, s, d = q.shape[1:]
    g = k.shape[1]
    return (s == 1 and d in DENSE_HEAD_DIMS and k.shape[-1] == d and v.shape[-1] == d and k.dtype == v.dtype
            and k.dtype in (torch.float32, torch.bfloat16) and g > 0 and h % g == 0 and h // g <= DENSE_MAX_GROUP
            and k.shape[2] > 0 and k.shape[:3] == v.shape[:3] and q.shape[0] == k.shape[0] and k.stride(-1) == 1
            and v.stride(-1) == 1 and k.stride(2) == v.stride(2) and q.is_cpu and k.is_cpu and v.is_cpu
            and q.is_floating_point() and avx512())


def attend_dense(q: Tensor, k: Tensor, v: Tensor, scale: float, threads: int | None = None, *,
                 keep: Tensor | None = None, check: bool = True) -> Tensor:
    """One decode step's attention: softmax(q k^T * scale) v for q (b, h, 1, d) over every key of k, v (b, g, t, d)
    (query head i reads KV head i // (h / g)), each KV head read once for all its query heads; float32 sums, the
    result (b, h, 1, d) in q's dtype. Where SDPA's CPU kernel reads a bfloat16 cache at ~6 GB/s (8,192 keys, SmolLM2's
    heads) this reads it once, near the memory's speed. ``keep`` (b, t) bool, where given, hides the keys it marks
    False (every row keeping at least one). Raises ValueError when :func:`dense_fits` says no
    (``check=False``: not asked, for a caller that asked it already, :func:`multihead.kernels.attend`)."""
    lib = _required()
    if check and not dense_fits(q, k, v):
        raise ValueError(f"attend_dense: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype} strides "
                         f"{k.stride()}, v {tuple(v.shape)} {v.dtype} strides {v.stride()} do not fit (one query a "
                         f"head, head_dim in {DENSE_HEAD_DIMS}, at most {DENSE_MAX_GROUP} query heads a KV head, "
                         "float32 or bfloat16 k and v alike with contiguous rows, AVX-512)")
    b, h, _, d = q.shape
    g, t = k.shape[1], k.shape[2]
    if check:
        _check_keep("attend_dense", keep, b, t)
    kept = _keep_bytes(keep)
    qg = q.reshape(b, g, h // g, d).to(torch.float32).contiguous()
    out = torch.empty(b, g, h // g, d, dtype=torch.float32)
    work = scratch(lib.mh_attend_dense_scratch(b, g, h // g, d, t))
    args = DenseArgs(b, g, h // g, d, t, qg.data_ptr(), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                     v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), int(k.dtype == torch.bfloat16), scale,
                     out.data_ptr(), work.data_ptr(), torch.get_num_threads() if threads is None else threads,
                     None if kept is None else kept.data_ptr(), 0 if kept is None else kept.stride(0))
    if lib.mh_attend_dense(ctypes.byref(args)):
        raise ValueError(f"attend_dense: the kernel refused head_dim {d}, {h // g} query heads a KV head, {t} keys")
    return out.view(b, h, 1, d).to(q.dtype)


def _check_keep(name: str, keep: Tensor | None, b: int, t: int) -> None:
    """A ValueError unless ``keep`` is None or a (b, t) bool mask on the CPU keeping a key in every row."""
    if keep is None:
        return
    if keep.dtype != torch.bool or tuple(keep.shape) != (b, t) or not keep.is_cpu:
        raise ValueError(f"{name}: keep of shape {tuple(keep.shape)}, {keep.dtype} on {keep.device} (expected ({b}, "
                         f"{t}) bool on the CPU: True = a key the query sees)")
    empty = (~keep.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{name}: keep hides every key of batch row(s) {empty}: each row must see at least one")


def _keep_bytes(keep: Tensor | None) -> Tensor | None:
    """The mask as the kernels read it: one byte a key, rows contiguous (a bool tensor already is)."""
    if keep is None:
        return None
    return keep.contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------------------------- the operators
_ops = torch.library.Library("multihead", "DEF")
_ops.define("gemv_bf16(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_ops.define("attend_dense(Tensor q, Tensor k, Tensor v, float scale) -> Tensor")
_ops.define("attend_quantized(int bits, Tensor q, Tensor codes_k, Tensor scale_k, Tensor min_k, Tensor codes_v, "
            "Tensor scale_v, Tensor min_v, int n, int group, Tensor tail_k, Tensor tail_v, float scale) -> Tensor")


def _gemv_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return gemv_bf16(x.contiguous(), weight, bias)


def _dense_op(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return attend_dense(q, k, v, scale)


def _quantized_op(bits: int, q: Tensor, codes_k: Tensor, scale_k: Tensor, min_k: Tensor, codes_v: Tensor,
                  scale_v: Tensor, min_v: Tensor, n: int, group: int, tail_k: Tensor, tail_v: Tensor, scale: float
                  ) -> Tensor:
    if bits not in (4, 8):
        raise ValueError(f"attend_quantized: bits {bits} (4 or 8)")
    return _attend_codes(bits, q, codes_k, scale_k, min_k, codes_v, scale_v, min_v, n, group, tail_k, tail_v, scale,
                         None, True)


_ops.impl("gemv_bf16", _gemv_op, "CPU")
_ops.impl("attend_dense", _dense_op, "CPU")
_ops.impl("attend_quantized", _quantized_op, "CPU")


def _gemv_fake(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _dense_fake(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape)


def _quantized_fake(bits: int, q: Tensor, codes_k: Tensor, scale_k: Tensor, min_k: Tensor, codes_v: Tensor,
                    scale_v: Tensor, min_v: Tensor, n: int, group: int, tail_k: Tensor, tail_v: Tensor, scale: float
                    ) -> Tensor:
    return q.new_empty(q.shape)


torch.library.register_fake("multihead::gemv_bf16", _gemv_fake)
torch.library.register_fake("multihead::attend_dense", _dense_fake)
torch.library.register_fake("multihead::attend_quantized", _quantized_fake)
