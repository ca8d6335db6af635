"""The one background thread of an async save: write, fsync, commit, retention.

One save is in flight at a time, so saves commit strictly in the order they were submitted.
``submit`` and ``wait`` may be called from any thread: one condition guards the job in flight,
and a thread is published only once it is started, so no waiter joins a thread that never ran.

A failure is kept and raised (chained, naming the step) to every thread that waits while it is
pending -- the next ``save``, ``wait_until_finished`` or ``close`` -- and it stays pending until
the thread that submitted the job (the training loop) has received it itself: another thread
waiting first (a watchdog, ``close`` from elsewhere) must not take it away from the loop.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orbit_pt.errors import CheckpointSaveError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Failure:
    step: int
    error: BaseException
    owner: threading.Thread  # the thread that submitted the job; it must receive the error


class BackgroundSaver:
    """Runs one save job at a time on its own (non-daemon) thread."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._cond = threading.Condition()
        # Jobs are counted rather than tracked by "is a thread set": a waiter waits for the jobs
        # submitted before it was called, so a training loop that keeps submitting never starves
        # it, and no waiter ever has to clear shared state that a concurrent submit just set.
        self._submitted = 0
        self._finished = 0
        self._thread: threading.Thread | None = None  # the latest job's thread, always started
        self._step: int | None = None  # the latest job's step
        self._failure: _Failure | None = None

    @property
    def in_flight(self) -> int | None:
        """The step being saved in the background, or None."""
        with self._cond:
            return self._step if self._finished < self._submitted else None

    def is_saving(self) -> bool:
        """Whether a save is in flight."""
        return self.in_flight is not None

    def submit(self, step: int, job: Callable[[], None]) -> None:
        """Start ``job`` for ``step`` once the previous job finished.

        Raises the pending failure of an earlier job instead of starting this one.
        """
        owner = threading.current_thread()
        with self._cond:
            self._wait_locked(f"save of step {step}")
            # Non-daemon: if the program ends without close(), the interpreter still waits for
            # the commit instead of killing it halfway (which would be safe, but lose the step).
            thread = threading.Thread(
                target=self._run,
                args=(step, job, owner),
                name=f"orbit_pt-save-step-{step}",
                daemon=False,
            )
            # Started before it is published; _run cannot finish (it needs the lock we hold)
            # before the counters say it is in flight.
            thread.start()
            self._thread = thread
            self._step = step
            self._submitted += 1

    def wait(self, *, reason: str | None = None) -> None:
        """Wait for the jobs submitted so far; raise a pending failure as CheckpointSaveError.

        Safe from any thread, any number at once. ``reason`` (what the caller is about to do)
        makes a wait on a live job log a warning: saves are more frequent than a save takes.
        """
        with self._cond:
            self._wait_locked(reason)

    def raise_failure(self) -> None:
        """Raise the failure of a job that has already finished, without waiting for a job in
        flight (a multi-tier save checks the other tier's lane this way)."""
        with self._cond:
            self._raise_pending()

    def _wait_locked(self, reason: str | None) -> None:
        target = self._submitted
        thread, step = self._thread, self._step
        if self._finished < target:
            started = time.perf_counter()
            while self._finished < target:
                self._cond.wait()
            if reason is not None:
                logger.warning(
                    "%s waited %.3f s for the async save of step %s to finish",
                    reason,
                    time.perf_counter() - started,
                    step,
                )
        if thread is not None:
            thread.join()  # started before it was published; it has left _run's critical part
        self._raise_pending()

    def _raise_pending(self) -> None:
        failure = self._failure
        if failure is None:
            return
        # Cleared only once the submitting thread has it (or can never get it: it has ended).
        if threading.current_thread() is failure.owner or not failure.owner.is_alive():
            self._failure = None
        error = failure.error
        # Each waiter raises its own object: a shared exception would gather every raiser's
        # traceback, and concurrent raises would rewrite it under each other.
        if isinstance(error, CheckpointSaveError):
            fresh = copy.copy(error)  # errors reduce to their arguments; no traceback copied
            raise fresh from (error.__cause__ if error.__cause__ is not None else error)
        raise CheckpointSaveError(
            failure.step, self._root, f"async save failed: {type(error).__name__}: {error}"
        ) from error

    def _run(self, step: int, job: Callable[[], None], owner: threading.Thread) -> None:
        failure = None
        try:
            job()
        except BaseException as exc:
            failure = _Failure(step, exc, owner)
            logger.error(
                "async save of step %s to %s failed: %s; it will be raised by the next save(), "
                "wait_until_finished() or close()",
                step,
                self._root,
                exc,
            )
        with self._cond:
            if failure is not None:
                self._failure = failure
            self._finished += 1
            self._cond.notify_all()
