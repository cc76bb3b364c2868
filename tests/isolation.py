"""Run one fuzz case in a forked child with a time and an address-space limit, and say how it ended.

The parent (pytest, with torch and multihead imported) forks; the child sets RLIMIT_AS to what it already maps plus
``memory`` bytes, arms an alarm, runs the case and writes its outcome (JSON) to a pipe. Outcomes:

- ``ok``: the case returned (its return value, made a string, is ``detail``)
- ``error``: it raised MultiheadError (the message is ``detail``)
- ``crash``: it raised anything else (the traceback is ``detail``), including MemoryError and RecursionError
- ``timeout``: it ran past ``seconds`` and was killed
- ``died``: the child ended without a word (a signal, an abort inside a C library)
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


def isolated(case: Callable[[], Any], *, seconds: float = 20.0, memory: int = 1 << 30) -> Outcome:
    """Run ``case()`` in a forked child under the limits; see the module docstring for the outcomes."""
    from multihead.errors import MultiheadError

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_end)
        try:
            import torch

            torch.set_num_threads(1)
            limit = _mapped_bytes() + memory
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            signal.alarm(int(seconds) + 5)  # a backstop: the parent kills at `seconds`
            try:
                result = {"kind": "ok", "detail": str(case())[:4000]}
            except MultiheadError as err:
                result = {"kind": "error", "detail": str(err)}
            except BaseException:
                result = {"kind": "crash", "detail": traceback.format_exc()[-4000:]}
            os.write(write_end, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + seconds
    chunks: list[bytes] = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return Outcome("timeout", f"still running after {seconds} s")
            ready, _, _ = select.select([read_end], [], [], left)
            if ready:
                chunk = os.read(read_end, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return Outcome("died", f"wait status {status}")
    data = json.loads(b"".join(chunks))
    return Outcome(data["kind"], data["detail"])
