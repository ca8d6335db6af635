"""The one background thread of an async save: write, fsync, commit, retention.

One save is in flight at a time. A failure is kept and raised (chained, naming the step) by the
next call that waits -- the next ``save``, ``wait_until_finished`` or ``close`` -- so it is never
lost and never raised from a thread nobody joins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from orbit_pt.errors import CheckpointSaveError

logger = logging.getLogger(__name__)


class BackgroundSaver:
    """Runs one save job at a time on its own (non-daemon) thread."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> int | None:
        """The step being saved in the background, or None."""
        thread = self._thread
        return self._step if thread is not None and thread.is_alive() else None

    def submit(self, step: int, job: Callable[[], None]) -> None:
        """Start ``job`` for ``step`` in the background (after the previous job finished)."""
        self.wait(reason=f"step {step}")
        self._step = step
        # Non-daemon: if the program ends without close(), the interpreter still waits for
        # the commit instead of killing it halfway (which would be safe, but lose the step).
        self._thread = threading.Thread(
            target=self._run, args=(job,), name=f"orbit_pt-save-step-{step}", daemon=False
        )
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:
            self._error = exc
            logger.error(
                "async save of step %s to %s failed: %s; it will be raised by the next save(), "
                "wait_until_finished() or close()",
                self._step,
                self._root,
                exc,
            )

    def wait(self, *, reason: str | None = None) -> None:
        """Wait for the job in flight; raise its failure as a :class:`CheckpointSaveError`."""
        thread = self._thread
        if thread is not None:
            if thread.is_alive() and reason is not None:
                started = time.perf_counter()
                thread.join()
                logger.info(
                    "%s waited %.3f s for the async save of step %s to finish",
                    reason,
                    time.perf_counter() - started,
                    self._step,
                )
            else:
                thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, CheckpointSaveError):
                raise error
            step = self._step if self._step is not None else -1
            raise CheckpointSaveError(
                step, self._root, f"async save failed: {type(error).__name__}: {error}"
            ) from error
