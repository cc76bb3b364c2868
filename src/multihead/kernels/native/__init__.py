"""Native CPU kernels as PyTorch operators: a few C functions (``kernels.c`` beside this file, declared in
``kernels.h``) and their operators (``ops.cpp``: each takes tensors, checks what the kernel's memory reads rely on,
fills the kernel's argument struct from the one header and calls it), linked into one library per instruction-set
variant by an explicit step (``python -m multihead.kernels.native build``, ``multihead tune``, the set-up), never
inside a forward; the CPU's best variant is chosen at run time (as ggml does) and loaded with
``torch.ops.load_library``. The operators' schemas and fake kernels are defined here, so ``torch.compile`` traces
them and, before the library is built, they exist and raise naming why they cannot run.

The operators (``torch.ops.multihead.*``, each also a function here with its checks):

- :func:`gemv_bf16` (``gemv_bf16(x, weight, bias, threads=0)``), decoding's one-row bfloat16 product
  ``F.linear(x, W, bias)``, with software prefetch: it reads a bfloat16 weight at about twice the speed of
  PyTorch's one-row kernels on an AVX512-BF16 host (the figures, host and date: benchmarks/RESULTS.md, "The native
  CPU kernels"). The product kind "native" of :func:`multihead.kernels.cpu.product_kind`.
- :func:`gemv_f32` (``gemv_f32(x, weight, bias, threads=0)``), the same for one float32 row on an AVX-512 host:
  each weight row streamed once, level with the fastest of PyTorch's kinds on the host where MKL's is fast and
  independent of which BLAS PyTorch carries (benchmarks/RESULTS.md). The kind "native" of a float32 row.
- :func:`attend_dense` (``attend_dense(q, k, v, scale, keep=None, threads=0)``), a decode step's attention over a
  float32 or bfloat16 cache, each KV head read once for all its query heads.
- :func:`attend_q4` and :func:`attend_q8` (``attend_quantized(bits, ...)``), a decode step's attention over a 4- or
  8-bit KIVI cache's codes, read once inside the attention and never dequantised into memory.
- :func:`quantize_into` and :func:`dequantize_into`, the KIVI codec of :mod:`multihead.quant` in one pass: a quantized
  cache's write of whole groups into its codes, scales and minimums, and the read of codes back into keys and values
  where a kernel needs them (a prefill's SDPA). The same bits as the PyTorch code of :mod:`multihead.quant`.

Variants (:data:`VARIANTS`): "avx512bf16" (AVX-512 F/BW/DQ/VL and AVX512-BF16: every fast path), "avx512" (the
attention kernels' AVX-512 chunks; the bfloat16 product's portable loop) and "generic" (no -m flag: the compiler's
baseline for the machine, portable loops throughout). :func:`variant` picks the best one this CPU's flags allow, or
``MULTIHEAD_NATIVE_VARIANT`` names one (a lower one, to test the portable paths). Each is built once per machine,
source and PyTorch: ``cc -O3 -fopenmp -fPIC`` and the variant's flags for kernels.c, ``c++ -O2 -std=c++17`` with
PyTorch's headers (``torch.utils.cpp_extension.include_paths``) for ops.cpp, linked against PyTorch's own libraries,
into ``$MULTIHEAD_NATIVE_DIR`` (default ``$XDG_CACHE_HOME/multihead/native``, else ``~/.cache/multihead/native``),
named by the variant and a hash of the sources, the compilers' versions, the commands and PyTorch's version, written
to a temporary name and renamed into place (processes building at once do not see half a file). A process loads the
built library on first use; before the build step has run, without a compiler, when the build failed, or with
``MULTIHEAD_NATIVE=0``, :func:`library` is None, :func:`unavailable` says why (and, except when turned off on
purpose, a warning says it once a process, with the command that builds them), and every caller keeps PyTorch's
kernels: nothing is lost but the speed.

The package's own hot paths (:mod:`multihead.layers.linear`, :mod:`multihead.kernels`) call the operators directly,
eager and compiled alike, once :func:`available` says the library is loaded; the functions here add the checks
that name every way a tensor does not fit, for other callers.
"""

from __future__ import annotations

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
HEADER = SOURCE.with_name("kernels.h")
OPS_SOURCE = SOURCE.with_name("ops.cpp")
NAMESPACE = "multihead"  # the operators' namespace: torch.ops.multihead.*
C_FLAGS = ("-O3", "-fopenmp", "-fPIC")  # kernels.c, with the variant's flags
CXX_FLAGS = ("-O2", "-fPIC", "-std=c++17")  # ops.cpp (it only fills structs and calls kernels.c)
_AVX512 = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
_AVX512_CPU = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl")
# name -> (compiler flags, the CPU flags (/proc/cpuinfo) it needs), best first
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512bf16": ((*_AVX512, "-mavx512bf16"), (*_AVX512_CPU, "avx512_bf16")),
    "avx512": (_AVX512, _AVX512_CPU),
    "generic": ((), ()),
}
BUILD_TIMEOUT_S = 300

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library's path or None; "why": the reason it is None; "variant"
_loaded: dict[str, Path] = {}  # library file name -> the path this process loaded it from (loaded once a process)


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


def _which(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def _compiler() -> str | None:
    return _which(os.environ.get("CC") or "cc", "gcc", "clang")


def _cxx() -> str | None:
    return _which(os.environ.get("CXX") or "c++", "g++", "clang++")


def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the compiler {compiler} did not run: {e}") from e


def _torch_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """PyTorch's headers and ABI for compiling ops.cpp, and its libraries for linking the library against."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = (*(f"-I{p}" for p in cpp_extension.include_paths()), f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                     f"-DMH_NAMESPACE={NAMESPACE}")
    lib = cpp_extension.library_paths()[0]
    return compile_flags, (f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}")


def _target(name: str, cc: str | None) -> tuple[list[list[str]], Path]:
    """The three commands that build variant ``name`` (kernels.c, ops.cpp, the link; the outputs named KERNELS_O,
    OPS_O and LIBRARY) and the library file they make (named by a hash of the sources, the compilers' versions, the
    commands and PyTorch's version); raises RuntimeError without compilers that run."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    cxx = _cxx()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (c++, g++ or clang++ on PATH, or $CXX)")
    torch_compile, torch_link = _torch_flags()
    commands = [[cc, *C_FLAGS, *VARIANTS[name][0], "-c", str(SOURCE), "-o", "KERNELS_O"],
                [cxx, *CXX_FLAGS, *torch_compile, "-c", str(OPS_SOURCE), "-o", "OPS_O"],
                [cxx, "-shared", "-fopenmp", "KERNELS_O", "OPS_O", *torch_link, "-o", "LIBRARY"]]
    parts = [SOURCE.read_bytes(), HEADER.read_bytes(), OPS_SOURCE.read_bytes(), _version(cc).encode(),
             _version(cxx).encode(), torch.__version__.encode(),
             "\n".join(" ".join(c[1:]) for c in commands).replace(str(SOURCE.parent), "").encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return commands, cache_dir() / f"kernels-{name}-{digest}.so"


def built(name: str, cc: str | None = None) -> Path | None:
    """The library of variant ``name`` if it was built here (never builds it); raises RuntimeError without the
    compilers (the library's name depends on their versions)."""
    out = _target(name, cc)[1]
    return out if out.exists() else None


def build(name: str, cc: str | None = None) -> Path:
    """The built library of variant ``name`` (built now unless already there); raises RuntimeError naming the
    failure (no compiler, a compiler that does not run, a failed or timed-out step, with the compiler's last words).
    Only the explicit steps call it (:func:`build_now`: ``python -m multihead.kernels.native build``, ``multihead
    tune``, the set-up), never a forward."""
    commands, out = _target(name, cc)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as work:
        names = {"KERNELS_O": str(Path(work) / "kernels.o"), "OPS_O": str(Path(work) / "ops.o"),
                 "LIBRARY": str(Path(work) / out.name)}
        for command in commands:
            command = [names.get(part, part) for part in command]
            step = Path(next(part for part in command if part.endswith((".c", ".cpp")))).name if "-c" in command \
                else "the link"
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                raise RuntimeError(f"{command[0]} did not finish {step} in {BUILD_TIMEOUT_S} s") from e
            if done.returncode != 0:
                tail = " ".join(done.stderr.strip().splitlines()[-3:])
                raise RuntimeError(f"{Path(command[0]).name} on {step} exited with {done.returncode}: {tail}")
        os.replace(names["LIBRARY"], out)
    return out


NOT_BUILT = ("not built here yet: run `python -m multihead.kernels.native build` (or `multihead tune`) once; the "
             "set-up (make) does")


def _load() -> tuple[Path | None, str | None, str | None]:
    if os.environ.get("MULTIHEAD_NATIVE", "1") == "0":
        return None, "turned off by MULTIHEAD_NATIVE=0", None
    try:
        name = variant()
        path = built(name)
        if path is None:
            return None, NOT_BUILT, None
        if path.name not in _loaded:  # the same library (by its hash) registers its operators once a process
            torch.ops.load_library(str(path))
            _loaded[path.name] = path
    except (RuntimeError, OSError) as e:
        return None, str(e), None
    return path, None, name


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


def library() -> Path | None:
    """The loaded kernels' library, or None when they cannot be had (:func:`unavailable` says why; a warning says it
    once a process, unless they were turned off on purpose). Never builds them: until :func:`build_now` has run once
    on this machine (the set-up does), PyTorch's kernels run and the warning says how to build."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, why, name = _load()
                _state["variant"], _state["why"] = name, why
                _state["isa"] = int(torch.ops.multihead.isa()) if lib is not None else 0
                _state["lib"] = lib
                if lib is None and why != "turned off by MULTIHEAD_NATIVE=0":
                    warnings.warn(f"multihead's native CPU kernels are not available ({why}): PyTorch's kernels run "
                                  "instead (the same results within rounding, slower decoding)", RuntimeWarning,
                                  stacklevel=2)
    loaded = _state["lib"]
    return loaded if isinstance(loaded, Path) else None


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


def _required() -> None:
    if library() is None:
        raise RuntimeError(f"multihead's native kernels are not available: {unavailable()}")


# ---------------------------------------------------------------------------------------------- gemv_bf16 / f32
def gemv_bf16(x: Tensor, weight: Tensor, bias: Tensor | None = None, threads: int | None = None, *,
              check: bool = True) -> Tensor:
    """``F.linear(x, weight, bias)`` for one bfloat16 row ``x`` (any leading shape of one element) on the CPU, by the
    native kernel: float32 sums rounded once to bfloat16. ``threads``: OpenMP threads (default: PyTorch's
    intra-op count). No autograd: for inference (the caller checks). Raises RuntimeError when the kernels are not
    there (:func:`unavailable`) and ValueError naming what does not fit; ``check=False`` skips the checks, for a
    caller that made them (:func:`multihead.layers.linear.linear`: a wrong layout there reads the wrong memory)."""
    _required()
    if check:
        _check_gemv("gemv_bf16", torch.bfloat16, x, weight, bias)
    out: Tensor = torch.ops.multihead.gemv_bf16(x, weight, bias, 0 if threads is None else threads)
    return out


def gemv_f32(x: Tensor, weight: Tensor, bias: Tensor | None = None, threads: int | None = None, *,
             check: bool = True) -> Tensor:
    """``F.linear(x, weight, bias)`` for one float32 row ``x`` on the CPU, by the native kernel: each row of the
    weight streamed once (AVX-512 FMA, software prefetch), the rows spread over ``threads`` OpenMP threads (default:
    PyTorch's intra-op count). The same sums as PyTorch's in another order. Like :func:`gemv_bf16` otherwise: no
    autograd, RuntimeError without the kernels, ValueError naming what does not fit, ``check=False`` for a caller
    that checked. Only the AVX-512 variants vectorise it (:func:`avx512`); the generic one is a portable loop."""
    _required()
    if check:
        _check_gemv("gemv_f32", torch.float32, x, weight, bias)
    out: Tensor = torch.ops.multihead.gemv_f32(x, weight, bias, 0 if threads is None else threads)
    return out


def _check_gemv(name: str, dtype: torch.dtype, x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    in_features = weight.shape[-1] if weight.ndim == 2 else -1
    what = str(dtype).removeprefix("torch.")
    problems = []
    if x.dtype != dtype or weight.dtype != dtype:
        problems.append(f"dtypes {x.dtype} and {weight.dtype} ({what} both)")
    if not (x.is_cpu and weight.is_cpu):
        problems.append(f"devices {x.device} and {weight.device} (cpu both)")
    if weight.ndim != 2 or weight.stride(-1) != 1:
        problems.append(f"weight of shape {tuple(weight.shape)} and strides {weight.stride()} "
                        "(2-D, rows of unit stride)")
    if x.numel() != in_features or not x.is_contiguous():
        problems.append(f"x of shape {tuple(x.shape)} (one contiguous row of {in_features})")
    if bias is not None and (bias.dtype != dtype or bias.shape != (weight.shape[0],)
                             or not bias.is_contiguous() or not bias.is_cpu):
        problems.append(f"bias of shape {tuple(bias.shape)} and dtype {bias.dtype} "
                        f"(contiguous {what} of {weight.shape[0]})")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))


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
    _required()
    if check:
        name = f"attend_q{bits}"
        _check_codes(name, bits, q, codes_k, scale_k, min_k, codes_v, scale_v, min_v, n, group, tail_k, tail_v)
        _check_keep(name, keep, q.shape[0], n + tail_k.shape[2])
    out: Tensor = torch.ops.multihead.attend_quantized(bits, q, codes_k, scale_k, min_k, codes_v, scale_v, min_v, n,
                                                       group, tail_k, tail_v, scale, keep,
                                                       0 if threads is None else threads)
    return out


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
DENSE_HEAD_DIMS = (64, 128, 256)
DENSE_MAX_GROUP = 8  # query heads a KV head serves, at most


def dense_fits(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`attend_dense` takes these tensors: the kernels built with AVX-512, one query a head, head_dim
    64, 128 or 256 for keys and values, at most DENSE_MAX_GROUP query heads a KV head, float32 or bfloat16 keys and
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
    _required()
    if check and not dense_fits(q, k, v):
        raise ValueError(f"attend_dense: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype} strides "
                         f"{k.stride()}, v {tuple(v.shape)} {v.dtype} strides {v.stride()} do not fit (one query a "
                         f"head, head_dim in {DENSE_HEAD_DIMS}, at most {DENSE_MAX_GROUP} query heads a KV head, "
                         "float32 or bfloat16 k and v alike with contiguous rows, AVX-512)")
    if check:
        _check_keep("attend_dense", keep, q.shape[0], k.shape[2])
    out: Tensor = torch.ops.multihead.attend_dense(q, k, v, scale, keep, 0 if threads is None else threads)
    return out


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


# ---------------------------------------------------------------------------------------------- the codec
CODEC_MAX_HEAD_DIM = 1024  # the codec kernels' row buffers (MH_CODEC_MAX_D)
_CODEC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _codec_problems(x: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor, bits: int, group: int, axis: int
                    ) -> list[str]:
    """What does not fit the codec kernels: x (b, g, n, d); codes (b, g, n, d * bits / 8) uint8; scale and minimum
    float16, (b, g, n / group, d) for keys (axis 0), (b, g, n, d / group) for values (axis 1)."""
    if x.ndim != 4:
        return [f"x of shape {tuple(x.shape)} ((b, g, n, d))"]
    b, g, n, d = x.shape
    problems = []
    if bits not in (2, 4, 8) or axis not in (0, 1) or group < 1:
        problems.append(f"bits {bits}, group {group}, axis {axis} (2, 4 or 8 bits; a group of 1 or more; axis 0 keys, "
                        "1 values)")
        return problems
    if (d * bits) % 8 or d > CODEC_MAX_HEAD_DIM or (n % group if axis == 0 else d % group):
        what = f"n ({n})" if axis == 0 else f"head_dim ({d})"
        problems.append(f"head_dim {d}, {n} tokens, group {group} (head_dim * bits whole bytes, head_dim at most "
                        f"{CODEC_MAX_HEAD_DIM}, group dividing {what})")
    if x.dtype not in _CODEC_DTYPES or x.stride(3) != 1:
        problems.append(f"x as {x.dtype} with strides {x.stride()} (float32, bfloat16 or float16, channels of unit "
                        "stride)")
    rows = n // group if axis == 0 else n
    cols = d if axis == 0 else d // group
    for label, t, shape, dtype in (("codes", codes, (b, g, n, d * bits // 8), torch.uint8),
                                   ("scale", scale, (b, g, rows, cols), torch.float16),
                                   ("minimum", minimum, (b, g, rows, cols), torch.float16)):
        if t.dtype != dtype or tuple(t.shape) != shape or t.stride(-1) != 1:
            problems.append(f"{label} of shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype} ({shape} {dtype}, "
                            "unit-stride rows)")
    if scale.stride() != minimum.stride():
        problems.append("scale and minimum laid out differently")
    if not all(t.is_cpu for t in (x, codes, scale, minimum)):
        problems.append("tensors off the CPU")
    return problems


def codec_fits(x: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor, *, bits: int, group: int, axis: int) -> bool:
    """Whether :func:`quantize_into` / :func:`dequantize_into` take these tensors and the kernels are loaded."""
    return available() and not _codec_problems(x, codes, scale, minimum, bits, group, axis)


def quantize_into(x: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor, *, bits: int, group: int, axis: int,
                  threads: int | None = None, check: bool = True) -> None:
    """Quantize ``x`` (b, g, n, d) into ``codes``, ``scale`` and ``minimum`` in place, as a
    :class:`~multihead.cache.QuantizedKVCache` stores keys (``axis`` 0: per channel over groups of ``group`` tokens,
    n a multiple of group) or values (``axis`` 1: per token over groups of ``group`` channels): the codes, scales and
    minimums :func:`multihead.quant.quantize` and :func:`multihead.quant.pack` give, bit for bit, in one pass.

    x float32, bfloat16 or float16, any strides with channels of unit stride; codes (b, g, n, d * bits / 8) uint8;
    scale and minimum float16, (b, g, n / group, d) for keys, (b, g, n, d / group) for values, laid out alike: each
    may be a view of a larger store (a slice of its rows), written where it lies. ``threads``: OpenMP threads
    (default PyTorch's intra-op count). No autograd (codes are rounded values). Raises RuntimeError without the
    kernels (:func:`unavailable`) and ValueError naming what does not fit (``check=False``: a caller that checked,
    :func:`codec_fits`)."""
    _required()
    if check and (problems := _codec_problems(x, codes, scale, minimum, bits, group, axis)):
        raise ValueError("quantize_into: " + "; ".join(problems))
    torch.ops.multihead.quantize_into(bits, group, axis, x, codes, scale, minimum, 0 if threads is None else threads)


def dequantize_into(out: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor, *, bits: int, group: int, axis: int,
                    threads: int | None = None, check: bool = True) -> None:
    """Write the keys (``axis`` 0) or values (``axis`` 1) a store's codes hold into ``out`` (b, g, n, d), float32,
    bfloat16 or float16, channels of unit stride: codes * scale + minimum in float32, rounded once to out's dtype,
    the values of :func:`multihead.quant.read_keys` / :func:`~multihead.quant.read_values` bit for bit. The layouts
    are :func:`quantize_into`'s (the first n rows of a store: a view of them). Raises as :func:`quantize_into`."""
    _required()
    if check and (problems := _codec_problems(out, codes, scale, minimum, bits, group, axis)):
        raise ValueError("dequantize_into: " + "; ".join(problems))
    torch.ops.multihead.dequantize_into(bits, group, axis, codes, scale, minimum, out,
                                        0 if threads is None else threads)


# ---------------------------------------------------------------------------------------------- the operators
# The schemas (ops.cpp registers the CPU kernels against them: a kernel whose signature differs fails to load, naming
# the operator), a fallback that says why when the library is not loaded (a CPU kernel, once loaded, takes
# precedence over it), and the fake kernels torch.compile traces with.
_ops = torch.library.Library(NAMESPACE, "DEF")
_ops.define("isa() -> int")
_ops.define("gemv_bf16(Tensor x, Tensor weight, Tensor? bias, int threads=0) -> Tensor")
_ops.define("gemv_f32(Tensor x, Tensor weight, Tensor? bias, int threads=0) -> Tensor")
_ops.define("attend_dense(Tensor q, Tensor k, Tensor v, float scale, Tensor? keep=None, int threads=0) -> Tensor")
_ops.define("attend_quantized(int bits, Tensor q, Tensor codes_k, Tensor scale_k, Tensor min_k, Tensor codes_v, "
            "Tensor scale_v, Tensor min_v, int n, int group, Tensor tail_k, Tensor tail_v, float scale, "
            "Tensor? keep=None, int threads=0) -> Tensor")
_ops.define("quantize_into(int bits, int group, int axis, Tensor x, Tensor(a!) codes, Tensor(b!) scale, "
            "Tensor(c!) minimum, int threads=0) -> ()")
_ops.define("dequantize_into(int bits, int group, int axis, Tensor codes, Tensor scale, Tensor minimum, "
            "Tensor(a!) out, int threads=0) -> ()")


def _fallback(name: str) -> Callable[..., Tensor | None]:
    """The operator ``name`` before its CPU kernel is registered: the library is loaded here when it is built (a
    first call straight to the operator), and the call goes to its kernel; otherwise it raises naming why."""

    def first_use(*args: object, **kwargs: object) -> Tensor | None:
        if (library() is not None and all(not isinstance(a, Tensor) or a.is_cpu for a in args)
                and torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "CPU")):
            out: Tensor | None = getattr(getattr(torch.ops, NAMESPACE), name)(*args, **kwargs)
            return out
        why = unavailable() or "they run on CPU tensors"
        raise RuntimeError(f"multihead's native kernels are not available: {why}")

    return first_use


for _name in ("gemv_bf16", "gemv_f32", "attend_dense", "attend_quantized", "quantize_into", "dequantize_into"):
    _ops.impl(_name, _fallback(_name), "CompositeExplicitAutograd")


def _gemv_fake(x: Tensor, weight: Tensor, bias: Tensor | None, threads: int = 0) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _dense_fake(q: Tensor, k: Tensor, v: Tensor, scale: float, keep: Tensor | None = None, threads: int = 0
                ) -> Tensor:
    return q.new_empty(q.shape)


def _quantized_fake(bits: int, q: Tensor, codes_k: Tensor, scale_k: Tensor, min_k: Tensor, codes_v: Tensor,
                    scale_v: Tensor, min_v: Tensor, n: int, group: int, tail_k: Tensor, tail_v: Tensor, scale: float,
                    keep: Tensor | None = None, threads: int = 0) -> Tensor:
    return q.new_empty(q.shape)


torch.library.register_fake(f"{NAMESPACE}::gemv_bf16", _gemv_fake, lib=_ops)
torch.library.register_fake(f"{NAMESPACE}::gemv_f32", _gemv_fake, lib=_ops)
torch.library.register_fake(f"{NAMESPACE}::attend_dense", _dense_fake, lib=_ops)
torch.library.register_fake(f"{NAMESPACE}::attend_quantized", _quantized_fake, lib=_ops)


def _codec_fake(bits: int, group: int, axis: int, a: Tensor, b: Tensor, c: Tensor, d: Tensor, threads: int = 0
                ) -> None:
    return None  # writes its (a!) arguments in place: nothing new to describe


torch.library.register_fake(f"{NAMESPACE}::quantize_into", _codec_fake, lib=_ops)
torch.library.register_fake(f"{NAMESPACE}::dequantize_into", _codec_fake, lib=_ops)
