"""Run one fuzz case in a child process with a time and an address-space limit, and say how it ended.

Children are forked from a lean fork server (multiprocessing's "forkserver", with torch, multihead and the fuzz
test modules preloaded), not from pytest: forking the test process, which holds real models by then, cost more
system time than the cases themselves. So a case is a module-level function and picklable arguments.

The child sets RLIMIT_AS to what it already maps plus ``memory`` bytes, arms an alarm, runs the case and sends its
outcome back. Outcomes:

- ``ok``: the case returned (its return value, made a string, is ``detail``)
- ``error``: it raised MultiheadError (the message is ``detail``)
- ``crash``: it raised anything else (the traceback is ``detail``), including MemoryError and RecursionError
- ``timeout``: it ran past ``seconds`` and was killed
- ``died``: the child ended without a word (a signal, an abort inside a C library)
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRELOAD = ["torch", "multihead", "multihead.cli", "multihead.models.loaders", "multihead.models.bert", "tokenizers",
           "safetensors.torch", "hypothesis", "isolation", "tiny_checkpoints", "test_hostile_files",
           "test_hostile_cli", "test_hostile_tensors", "test_interrupt", "fuzz_warmup"]
_context: Any = None


@dataclass(frozen=True)
class Outcome:
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail[-2000:]}"


def _mapped_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], seconds: float,
           memory: int) -> None:
    import torch

    from multihead.errors import MultiheadError

    torch.set_num_threads(1)
    limit = _mapped_bytes() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.alarm(int(seconds) + 5)  # a backstop: the parent kills at `seconds`
    try:
        result = ("ok", str(fn(*args, **kwargs))[:4000])
    except MultiheadError as err:
        result = ("error", str(err))
    except BaseException:  # everything else is what the fuzz tests look for
        result = ("crash", traceback.format_exc()[-4000:])
    conn.send(result)
    conn.close()


def _start_server() -> Any:
    """The fork server, started now with the preloads importable: Python 3.11's fork server ignores the sys.path
    it is given, so this folder goes to it through PYTHONPATH (restored afterwards)."""
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    here = str(Path(__file__).resolve().parent)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = here if not before else here + os.pathsep + before
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return context


def isolated(fn: Callable[..., Any], *args: Any, seconds: float = 20.0, memory: int = 1 << 30,
             **kwargs: Any) -> Outcome:
    """Run ``fn(*args, **kwargs)`` (a module-level function) in a child under the limits."""
    global _context
    if _context is None:
        _context = _start_server()
    receive, send = _context.Pipe(duplex=False)
    child = _context.Process(target=_child, args=(send, fn, args, kwargs, seconds, memory), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(seconds):
            child.kill()
            child.join()
            return Outcome("timeout", f"still running after {seconds} s")
        try:
            kind, detail = receive.recv()
        except EOFError:
            child.join()
            return Outcome("died", f"exit code {child.exitcode}")
    finally:
        receive.close()
    child.join(10)
    return Outcome(kind, detail)


def isolated_map(fn: Callable[..., Any], calls: list[tuple[Any, ...]], *, workers: int = 2, seconds: float = 20.0,
                 memory: int = 1 << 30) -> list[Outcome]:
    """:func:`isolated` for each argument tuple in ``calls``, ``workers`` children at a time (the cores of the machine:
    a case's child is single-threaded work, mostly), the outcomes in the order of ``calls``. The cases must not
    share what they write."""
    from concurrent.futures import ThreadPoolExecutor

    global _context
    if _context is None:
        _context = _start_server()  # before the threads: one server
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda args: isolated(fn, *args, seconds=seconds, memory=memory), calls))
