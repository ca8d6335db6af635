"""Progress of large transfers: one line on stderr, on rank 0, in a terminal, for big states.

Writers and readers call :func:`advance` with the bytes they moved; it does nothing unless a
:class:`Progress` is active in the current context (the manager activates one around saves,
restores and verifies). Small transfers (under ``min_bytes``) never print, and nothing prints
when stderr is not a terminal or ``ORBIT_PT_PROGRESS=0`` is set.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

_current: contextvars.ContextVar[Progress | None] = contextvars.ContextVar(
    "orbit_pt_progress", default=None
)


class Progress:
    """A throttled one-line display of bytes moved, with a rate and, when known, a percentage."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        *,
        stream: TextIO | None = None,
        min_bytes: int = 256 << 20,
        interval: float = 0.25,
    ) -> None:
        self.what, self.total = what, total
        self.stream = stream if stream is not None else sys.stderr
        self.min_bytes, self.interval = min_bytes, interval
        self.done = 0
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if self.done >= self.min_bytes and now - self._last_draw >= self.interval:
                self._last_draw = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.done / max(now - self._started, 1e-9) / 1e9
        shown = f"{self.done / 1e9:.2f}"
        if self.total:
            shown += f"/{self.total / 1e9:.2f} GB ({100 * self.done / self.total:3.0f}%)"
        else:
            shown += " GB"
        self.stream.write(f"\r{self.what}: {shown} {rate:.2f} GB/s ")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        with self._lock:
            if self._drawn:
                self._draw(time.monotonic())
                self.stream.write("\n")
                self.stream.flush()


def enabled(*, primary: bool, stream: TextIO | None = None) -> bool:
    """Whether progress lines should be shown by this process."""
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return (
        primary
        and os.environ.get("ORBIT_PT_PROGRESS", "1") != "0"
        and callable(isatty)
        and bool(isatty())
    )


@contextlib.contextmanager
def showing(what: str, total: int | None = None, *, primary: bool) -> Iterator[None]:
    """Show progress for the transfers in this context (when :func:`enabled`)."""
    if not enabled(primary=primary):
        yield
        return
    progress = Progress(what, total)
    token = _current.set(progress)
    try:
        yield
    finally:
        _current.reset(token)
        progress.close()


def advance(nbytes: int) -> None:
    """Count ``nbytes`` moved towards the active progress display, if any."""
    progress = _current.get()
    if progress is not None:
        progress.advance(nbytes)
