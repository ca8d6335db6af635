"""BackgroundSaver: one job in flight, submission order, failures that reach the training loop.

Every test that starts threads joins them with a timeout and asserts they finished, so a hang
fails the test instead of stalling the suite.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orbit_pt._control.background import BackgroundSaver
from orbit_pt.errors import CheckpointSaveError

TIMEOUT = 30.0


def _in_thread(target: Callable[[], Any], name: str = "helper") -> tuple[threading.Thread, list]:
    """Run ``target`` on a daemon thread; the list receives its exception, if any."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread, errors


def _join(thread: threading.Thread, timeout: float = TIMEOUT) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), f"{thread.name} still running after {timeout} s (hang)"


def _bounded(body: Callable[[], None], timeout: float = 120.0) -> None:
    """Run a whole test body under a hard timeout; re-raise what it raised."""
    thread, errors = _in_thread(body, name="test-body")
    _join(thread, timeout)
    if errors:
        raise errors[0]


class _Recorder:
    """Jobs that record how many run at once and in which order they commit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.committed: list[int] = []

    def job(self, step: int, duration: float = 0.0) -> Callable[[], None]:
        def run() -> None:
            with self.lock:
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            time.sleep(duration)
            with self.lock:
                self.committed.append(step)
                self.active -= 1

        return run


def _gated(gate: threading.Event) -> Callable[[], None]:
    def run() -> None:
        assert gate.wait(TIMEOUT)

    return run


def _failing(step: int, exc: BaseException | None = None) -> Callable[[], None]:
    def run() -> None:
        raise exc if exc is not None else OSError(f"injected failure at step {step}")

    return run


def test_jobs_run_one_at_a_time_in_submission_order(tmp_path: Path) -> None:
    def body() -> None:
        saver = BackgroundSaver(tmp_path)
        rec = _Recorder()
        for step in range(20):
            saver.submit(step, rec.job(step, 0.001))
        saver.wait()
        assert rec.committed == list(range(20))
        assert rec.max_active == 1
        assert saver.in_flight is None
        assert not saver.is_saving()

    _bounded(body)


def test_in_flight_names_the_step_being_saved(tmp_path: Path) -> None:
    def body() -> None:
        saver = BackgroundSaver(tmp_path)
        gate = threading.Event()
        saver.submit(7, _gated(gate))
        assert saver.in_flight == 7
        assert saver.is_saving()
        gate.set()
        saver.wait()
        assert saver.in_flight is None

    _bounded(body)


def test_waiter_never_joins_a_thread_that_is_not_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 2: "cannot join thread before it is started" when wait() ran on another thread.

    A slow Thread.start widens the window between creating the save thread and starting it; a
    second thread waiting in a loop must never see the thread before it is started.
    """
    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        if self.name.startswith("orbit_pt-save"):
            time.sleep(0.02)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    saver = BackgroundSaver(tmp_path)
    rec = _Recorder()
    stop = threading.Event()

    def waiter() -> None:
        while not stop.is_set():
            saver.wait()

    def body() -> None:
        thread, errors = _in_thread(waiter, name="waiter")
        try:
            for step in range(10):
                saver.submit(step, rec.job(step))
        finally:
            stop.set()
            _join(thread)
        saver.wait()
        assert errors == []
        assert rec.committed == list(range(10))

    _bounded(body)


def test_concurrent_waiters_never_let_two_saves_run_at_once(tmp_path: Path) -> None:
    """Defect 2: wait_until_finished() from other threads while the loop saves asynchronously.

    A waiter that cleared the saver's thread after joining could erase the job a concurrent
    submit had just started; the next submit then did not wait -- two saves in flight at once,
    commits out of order.
    """

    def body() -> None:
        saver = BackgroundSaver(tmp_path)
        rec = _Recorder()
        stop = threading.Event()
        rng = random.Random(0)

        def waiter() -> None:
            while not stop.is_set():
                saver.wait(reason="watchdog")

        waiters = [_in_thread(waiter, name=f"waiter-{i}") for i in range(4)]
        try:
            for step in range(300):
                saver.submit(step, rec.job(step, rng.choice([0.0, 0.0, 0.0005])))
        finally:
            stop.set()
            for thread, _ in waiters:
                _join(thread)
        saver.wait()
        assert rec.max_active == 1
        assert rec.committed == list(range(300))
        assert [e for _, errors in waiters for e in errors] == []

    _bounded(body)


def test_many_waiters_all_return_once_the_job_is_done(tmp_path: Path) -> None:
    def body() -> None:
        saver = BackgroundSaver(tmp_path)
        gate = threading.Event()
        rec = _Recorder()

        def job() -> None:
            gate.wait(TIMEOUT)
            rec.job(1)()

        returned: list[str] = []

        def waiter() -> None:
            saver.wait()
            returned.append(threading.current_thread().name)

        saver.submit(1, job)
        waiters = [_in_thread(waiter, name=f"w{i}") for i in range(8)]
        time.sleep(0.05)
        assert returned == []  # all blocked on the job in flight
        gate.set()
        for thread, errors in waiters:
            _join(thread)
            assert errors == []
        assert rec.committed == [1]
        assert len(returned) == 8

    _bounded(body)


def test_failure_is_raised_as_save_error_naming_the_step(tmp_path: Path) -> None:
    def body() -> None:
        saver = BackgroundSaver(tmp_path)
        saver.submit(3, _failing(3))
        with pytest.raises(CheckpointSaveError, match="step 3") as info:
            saver.wait()
        assert info.value.step == 3
        assert isinstance(info.value.__cause__, OSError)
        assert "injected failure at step 3" in str(info.value)
        saver.wait()  # raised once to the owner: cleared

    _bounded(body)


def test_failing_job_is_logged_once_at_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saver = BackgroundSaver(tmp_path)
    with caplog.at_level(logging.ERROR, logger="orbit_pt"):
        saver.submit(3, _failing(3))
        thread, errors = _in_thread(saver.wait)
        _join(thread)
        assert len(errors) == 1
        with pytest.raises(CheckpointSaveError):
            saver.wait()
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1
    assert failed[0].levelno == logging.ERROR


def test_failure_from_the_commit_keeps_its_type_and_cause(tmp_path: Path) -> None:
    def body() -> None:
        saver = BackgroundSaver(tmp_path)
        cause = OSError("disk full")
        original = CheckpointSaveError(4, tmp_path / "tmp", "OSError: disk full")
        original.__cause__ = cause
        saver.submit(4, _failing(4, original))
        raised = []
        for _ in range(2):  # a non-owner and then the owner
            thread, errors = _in_thread(saver.wait)
            _join(thread)
            raised += errors
        with pytest.raises(CheckpointSaveError) as info:
            saver.wait()
        raised.append(info.value)
        for exc in raised:
            assert type(exc) is CheckpointSaveError
            assert exc.step == 4
            assert "disk full" in str(exc)
            assert exc.__cause__ is cause
        # Each waiter got its own object: tracebacks do not pile up on a shared one.
        assert len({id(e) for e in raised}) == 3
        assert all(e is not original for e in raised)

    _bounded(body)


def test_failure_is_not_lost_when_another_thread_waits_first(tmp_path: Path) -> None:
    """Defect 3: another thread waited first and took the error; the loop then raised nothing."""

    def body() -> None:
        saver = BackgroundSaver(tmp_path)
        saver.submit(5, _failing(5))
        for i in range(2):  # e.g. a watchdog, then close() from a signal-handling thread
            thread, errors = _in_thread(saver.wait, name=f"other-{i}")
            _join(thread)
            assert len(errors) == 1
            assert isinstance(errors[0], CheckpointSaveError)
            assert errors[0].step == 5
        # The training thread (the owner) still gets it, at its next wait...
        with pytest.raises(CheckpointSaveError, match="step 5"):
            saver.wait()
        # ...and then it is cleared, for everyone.
        saver.wait()
        thread, errors = _in_thread(saver.wait)
        _join(thread)
        assert errors == []

    _bounded(body)


def test_pending_failure_is_raised_by_submit_and_the_new_job_does_not_start(
    tmp_path: Path,
) -> None:
    """Defect 3: the pending failure reaches the loop's next save even after another waiter."""

    def body() -> None:
        saver = BackgroundSaver(tmp_path)
        rec = _Recorder()
        saver.submit(1, _failing(1))
        thread, errors = _in_thread(saver.wait, name="other")
        _join(thread)
        assert len(errors) == 1
        with pytest.raises(CheckpointSaveError, match="step 1"):
            saver.submit(2, rec.job(2))
        saver.wait()
        assert rec.committed == []  # step 2 was not started
        saver.submit(3, rec.job(3))
        saver.wait()
        assert rec.committed == [3]

    _bounded(body)


def test_failure_owned_by_a_thread_that_ended_is_cleared_by_its_receiver(tmp_path: Path) -> None:
    def body() -> None:
        saver = BackgroundSaver(tmp_path)
        thread, errors = _in_thread(lambda: saver.submit(1, _failing(1)), name="loop")
        _join(thread)
        assert errors == []
        with pytest.raises(CheckpointSaveError):
            saver.wait()  # nobody else can ever receive it
        saver.wait()

    _bounded(body)


def test_waiting_on_a_live_job_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect 16: "waited N s for the async save" was INFO; saves outrun the interval: WARNING."""
    saver = BackgroundSaver(tmp_path)
    gate = threading.Event()
    saver.submit(0, _gated(gate))
    timer = threading.Timer(0.05, gate.set)
    timer.start()
    with caplog.at_level(logging.DEBUG, logger="orbit_pt"):
        thread, errors = _in_thread(lambda: saver.wait(reason="save of step 1"))
        _join(thread)
        saver.wait(reason="restore")  # nothing in flight any more: nothing to log
        saver.wait()
    timer.join(TIMEOUT)
    assert errors == []
    waited = [r for r in caplog.records if "waited" in r.getMessage()]
    assert len(waited) == 1
    assert waited[0].levelno == logging.WARNING
    assert "save of step 1" in waited[0].getMessage()
    assert "step 0" in waited[0].getMessage()


def test_waiting_without_a_reason_logs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saver = BackgroundSaver(tmp_path)
    gate = threading.Event()
    saver.submit(0, _gated(gate))
    timer = threading.Timer(0.02, gate.set)
    timer.start()
    with caplog.at_level(logging.DEBUG, logger="orbit_pt"):
        thread, errors = _in_thread(saver.wait)
        _join(thread)
    timer.join(TIMEOUT)
    assert errors == []
    assert not [r for r in caplog.records if "waited" in r.getMessage()]


def test_save_thread_is_not_a_daemon(tmp_path: Path) -> None:
    saver = BackgroundSaver(tmp_path)
    gate = threading.Event()
    seen: list[threading.Thread] = []

    def job() -> None:
        seen.append(threading.current_thread())
        gate.wait(TIMEOUT)

    saver.submit(0, job)
    gate.set()
    thread, errors = _in_thread(saver.wait)
    _join(thread)
    assert errors == []
    assert len(seen) == 1
    assert not seen[0].daemon
    assert not seen[0].is_alive()  # wait() returns once the thread is gone
