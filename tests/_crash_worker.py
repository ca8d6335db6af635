"""A child process for tests/test_crash.py: saves steps in a loop until it is killed, or dies on
purpose at an exact ``os.replace``/``os.unlink`` call.

It is a small fork server, so that a test can crash hundreds of savers without paying for
``import torch`` each time: started with ``python tests/_crash_worker.py``, it imports orbit_pt,
prints ``{"event": "ready"}``, then for every job (a JSON line on stdin) forks a saver, prints
``{"event": "pid", ...}``, and once the saver is gone ``{"event": "exit", "code": ...}`` (negative:
killed by that signal). The saver prints its progress on the same stdout, one JSON line per event:
``saving``/``saved`` around each save and ``replace``/``unlink`` for each such call, so the test
knows exactly what had happened when the process died.

Job fields: ``root``, ``steps`` (saved in this order, with ``force=True``), ``tag`` (part of
each state, to tell timelines apart), ``keep_last_n``, ``exit_at`` (``["replace" or "unlink",
n, "before" or "after"]``: ``os._exit(3)`` around the n-th such call; a fourth element
``"kill"`` makes it SIGKILL itself instead), ``trap`` (the ``os`` functions reported and
counted, default ``["replace", "unlink"]``; tests/test_fault_injection.py adds ``fsync``,
``mkdir``, ...), ``pause_at_end`` (block until killed instead of exiting once every step is
saved).

The state of a step is :func:`make_state` ``(step, tag)``, so the test recomputes what each
committed step must hold.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions

BIG = 256 * 1024  # float32 elements: 1 MiB per big tensor, a few MiB per step
EXIT_CODE = 3


def make_state(step: int, tag: str) -> dict[str, Any]:
    """The state saved as ``step`` by a saver with ``tag``: a few MiB, different every step."""
    g = torch.Generator().manual_seed(step * 1_000_003 + zlib.crc32(tag.encode()))
    return {
        "big": [torch.randn(BIG, generator=g) for _ in range(3)],
        "bf16": torch.randn(128, 128, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-(2**62), 2**62, (1000,), generator=g),
        "step": step,
        "tag": tag,
        "history": [step / 3, -0.0, float("inf")],
        "blob": bytes(range(step % 256)),
        "pair": (step, str(step)),
    }


def _emit(event: str, **fields: Any) -> None:
    # os.write, not print: the saver is a fork of the server, and must never flush a copy of the
    # server's buffer; one write per line keeps lines whole.
    os.write(1, (json.dumps({"event": event, **fields}) + "\n").encode())


def _trap(name: str, exit_at: list[Any] | None) -> None:
    """Wrap ``os.<name>`` so that every call is reported, and the chosen one ends the process."""
    real: Callable[..., Any] = getattr(os, name)
    calls = 0

    def die() -> None:
        if exit_at is not None and exit_at[3:] == ["kill"]:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(EXIT_CODE)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        target = exit_at is not None and exit_at[0] == name and exit_at[1] == calls
        if target and exit_at is not None and exit_at[2] == "before":
            _emit("exiting", call=name, n=calls, when="before")
            die()
        result = real(*args, **kwargs)
        _emit(name, n=calls, args=[os.fsdecode(a) for a in args if isinstance(a, (str, Path))])
        if target:
            _emit("exiting", call=name, n=calls, when="after")
            die()
        return result

    setattr(os, name, wrapper)


def _save_loop(job: dict[str, Any]) -> None:
    exit_at = job.get("exit_at")
    for name in job.get("trap", ["replace", "unlink"]):
        _trap(name, exit_at)
    options = CheckpointManagerOptions(keep_last_n=job.get("keep_last_n"))
    mgr = CheckpointManager(job["root"], options=options)
    for step in job["steps"]:
        state = make_state(step, job["tag"])
        _emit("saving", step=step)
        mgr.save(step, {"state": state}, force=True)
        _emit("saved", step=step)
    _emit("done")
    if job.get("pause_at_end"):
        while True:
            signal.pause()
    mgr.close()


def _run_saver(job: dict[str, Any], go: int) -> None:
    os.read(go, 1)  # wait until the server has announced our pid
    try:
        _save_loop(job)
    except BaseException:
        _emit("error", message=traceback.format_exc())
        os._exit(1)
    os._exit(0)


def main() -> None:
    _emit("ready")
    for line in sys.stdin:
        job = json.loads(line)
        go_read, go_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(go_write)
            _run_saver(job, go_read)
        os.close(go_read)
        _emit("pid", pid=pid)
        os.write(go_write, b"x")
        os.close(go_write)
        _, status = os.waitpid(pid, 0)
        _emit("exit", code=os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
