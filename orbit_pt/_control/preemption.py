"""Preemption signals: a handler that only sets a flag.

Saving inside a signal handler is how jobs hang (a collective or a lock taken at an arbitrary
point of the training loop); so the handler only records that the job was asked to stop, and the
training loop asks ``reached_preemption(step)`` at a safe point, where every rank agrees.

A repeated signal is the same preemption: under torchrun (SLURM, Kubernetes) a worker gets
the scheduler's SIGTERM directly and again through the agent that forwards it, and neither
may cost the save. Only a second SIGINT (Ctrl-C twice, at a terminal) stops at once; a job
that never checks the flag is stopped by the scheduler's SIGKILL at the end of its grace period.

Handlers form a chain (each one remembers what was installed before it), and managers are not
always closed in the reverse order they were opened, nor on the main thread -- the only thread
that may call ``signal.signal``. So ``close()`` puts the previous disposition back only when it
can (main thread, our handler on top); otherwise our handler stays installed as a pass-through
that forwards every signal to what was there before it. Handlers above a closed watcher skip it
when they chain or restore, so the chain heals as the watchers above it close.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import types
from collections.abc import Iterable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)


class PreemptionWatcher:
    """Installs handlers for ``signals`` (main thread only) and records their arrival."""

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self._closed = False
        self._close_lock = threading.Lock()  # never taken by the handler (it may interrupt us)
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
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except BaseException:
            self.close()  # an invalid signal (SIGKILL...): undo the ones already installed
            raise

    @property
    def requested(self) -> bool:
        """Whether a preemption signal arrived in this process."""
        return self._event.is_set()

    def request(self) -> None:
        """Mark this process as preempted (what the signal handler does; also for tests)."""
        self._event.set()

    def _before(self, signum: int) -> Any:
        """What was installed before us, skipping closed watchers (pass-throughs)."""
        previous = self._previous.get(signum)
        while (
            isinstance(previous, types.MethodType)
            and isinstance(previous.__self__, PreemptionWatcher)
            and previous.__self__._closed
        ):
            previous = previous.__self__._previous.get(signum)
        # None: installed from outside Python; the default is all we can put back.
        return signal.SIG_DFL if previous is None else previous

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._before(signum)
        if self._closed:
            _forward(signum, frame, previous, ours=self._handle)
            return
        if self._event.is_set():
            if signum == signal.SIGINT:
                # Ctrl-C twice: a person at a terminal wants it to stop now.
                signal.signal(signum, previous)
                os.kill(os.getpid(), signum)
                return
            logger.info(
                "received %s again: the preemption save is already requested (a repeated "
                "signal is the same preemption; SIGKILL stops at once)",
                signal.Signals(signum).name,
            )
        else:
            self._event.set()
            logger.warning(
                "received %s: the job will save at the next step where reached_preemption() "
                "is checked; %s",
                signal.Signals(signum).name,
                "press Ctrl-C again to stop at once"
                if signum == signal.SIGINT
                else "a repeated signal is the same preemption",
            )
        if callable(previous):
            previous(signum, frame)

    def close(self) -> None:
        """Stop watching: put back the previous handlers, or become a pass-through.

        Safe from any thread, idempotent, and never raises (the manager releases its lock after).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True  # from here on, our handler only forwards; it sets no flag
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal is main-thread only: stay installed as a pass-through
        for sig in self._previous:
            try:
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, self._before(sig))
                # else: a handler above ours chains to us; we stay in the chain, forwarding.
            except Exception as exc:  # close() must not fail the manager's close
                logger.warning(
                    "could not restore the handler of %s: %s", signal.Signals(sig).name, exc
                )


def _forward(signum: int, frame: FrameType | None, previous: Any, *, ours: Any) -> None:
    """Deliver a signal to ``previous`` as if our (closed) handler were not there."""
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    # SIG_DFL: the default action can only happen with the default disposition installed.
    top = signal.getsignal(signum)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    # Still alive (a default that ignores or stops): if a handler above chained to us, it stays;
    # if ours was on top, the default it forwarded to is what close() would have left.
    if top is not None and top != ours:
        signal.signal(signum, top)
