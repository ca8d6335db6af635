"""Preemption signals: a handler that only sets a flag.

Saving inside a signal handler is how jobs hang (a collective or a lock taken at an arbitrary
point of the training loop); so the handler only records that the job was asked to stop, and the
training loop asks ``reached_preemption(step)`` at a safe point, where every rank agrees.

A second signal of the same kind restores the previous disposition and delivers the signal
again, so a job whose loop never checks the flag can still be stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)


class PreemptionWatcher:
    """Installs handlers for ``signals`` (main thread only) and records their arrival."""

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.signals = tuple(signals)
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "preemption signals %s not watched: signal handlers can only be installed from "
                "the main thread; create the CheckpointManager there",
                [s.name for s in self.signals],
            )
            self.signals = ()
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        """Whether a preemption signal arrived in this process."""
        return self._event.is_set()

    def request(self) -> None:
        """Mark this process as preempted (what the signal handler does; also for tests)."""
        self._event.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        if self._event.is_set():
            # Second signal: the loop is not reacting; fall back to what was there before.
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._event.set()
        logger.warning(
            "received %s: the job will save at the next step where reached_preemption() is "
            "checked; send it again to stop at once",
            signal.Signals(signum).name,
        )
        if callable(previous):
            previous(signum, frame)

    def close(self) -> None:
        """Put back the handlers that were installed before ours."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
