"""The control plane on one process: threads, lifetimes, the view of the root, preemption's end.

Every test that starts a thread joins it with a timeout, so a hang is a failure.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import orbit_pt.handlers.model as model_module
from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointSaveError,
    PreemptionExit,
)
from orbit_pt._format import sharding as _sharding
from orbit_pt.handlers import StateHandler
from orbit_pt.handlers.base import HandlerContext

README = Path(__file__).resolve().parent.parent / "README.md"


def _join(thread: threading.Thread, timeout: float = 60.0) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), f"{thread.name} did not finish within {timeout} s (a hang)"


class _Gated(StateHandler):
    """A state handler whose background write waits for a gate, and fails on chosen steps."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on: set[int] = set()
        self.active = 0
        self.most_active = 0
        self._lock = threading.Lock()

    def save(self, directory: Path, item: Any, context: HandlerContext) -> dict:
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            assert self.gate.wait(timeout=30)
            if context.step in self.fail_on:
                raise OSError(f"injected failure at step {context.step}")
            return dict(super().save(directory, item, context))
        finally:
            with self._lock:
                self.active -= 1


# ------------------------------------------------------------------------------ threads (soak)


def test_soak_three_waiting_threads_and_200_async_saves(tmp_path: Path) -> None:
    """Defects 2 and 3 under load: 3 threads call wait_until_finished/latest_step in a loop
    while the training thread makes 200 async saves with keep_last_n=2. Steps commit in order,
    one save is in flight at any time, the final steps are exactly the last two, and every
    injected failure reaches the training thread."""
    handler = _Gated()
    handler.fail_on = {20, 77, 150}
    options = CheckpointManagerOptions(async_save=True, keep_last_n=2)
    mgr = CheckpointManager(tmp_path, options=options, handlers={"x": handler})
    committed: list[int] = []
    original_commit = mgr._store.commit

    def recording_commit(step: int, *args: Any, **kwargs: Any) -> None:
        original_commit(step, *args, **kwargs)
        committed.append(step)

    mgr._store.commit = recording_commit  # type: ignore[method-assign]
    stop = threading.Event()
    problems: list[str] = []
    seen_by_monitors: list[int] = []

    def monitor(n: int) -> None:
        last = -1
        while not stop.is_set():
            try:
                if n % 2:
                    mgr.wait_until_finished()
                latest = mgr.latest_step()
            except CheckpointSaveError as exc:
                seen_by_monitors.append(exc.step)
                continue
            except Exception as exc:  # anything else is a defect
                problems.append(f"monitor {n}: {type(exc).__name__}: {exc}")
                return
            if latest is not None:
                if latest < last:
                    problems.append(f"monitor {n}: latest went back from {last} to {latest}")
                last = latest

    monitors = [threading.Thread(target=monitor, args=(n,), name=f"monitor-{n}") for n in range(3)]
    failures_seen: list[int] = []

    def train() -> None:
        for step in range(200):
            try:
                mgr.save(step, {"x": {"w": torch.full((32,), float(step)), "step": step}})
            except CheckpointSaveError as exc:
                failures_seen.append(exc.step)
        try:
            mgr.wait_until_finished()
        except CheckpointSaveError as exc:
            failures_seen.append(exc.step)

    trainer = threading.Thread(target=train, name="trainer")
    for t in monitors:
        t.start()
    trainer.start()
    try:
        _join(trainer, 120)
    finally:
        stop.set()
        for t in monitors:
            _join(t)
    assert not problems, problems
    assert failures_seen == [20, 77, 150]
    assert handler.most_active == 1
    assert committed == sorted(committed)
    assert len(committed) == len(set(committed))
    assert mgr.all_steps() == [198, 199]
    assert mgr.restore(199)["x"]["step"] == 199
    mgr.close()
    assert not list(tmp_path.glob("*.orbit-tmp"))
    assert not (tmp_path / "superseded").exists()


def test_a_failure_taken_by_close_on_another_thread_still_reaches_the_saving_thread(
    tmp_path: Path,
) -> None:
    """Defect 3: if another thread waits first (here: closes), the training thread must still
    get the failure at its next call."""
    handler = _Gated()
    handler.fail_on = {1}
    mgr = CheckpointManager(
        tmp_path, options=CheckpointManagerOptions(async_save=True), handlers={"x": handler}
    )
    mgr.save(0, {"x": {"v": 0}})
    mgr.save(1, {"x": {"v": 1}})
    errors: list[BaseException] = []

    def close() -> None:
        try:
            mgr.close()
        except CheckpointSaveError as exc:
            errors.append(exc)

    closer = threading.Thread(target=close)
    closer.start()
    _join(closer)
    assert [e.step for e in errors] == [1]  # type: ignore[attr-defined]
    with pytest.raises(CheckpointSaveError, match="step 1"):
        mgr.save(2, {"x": {"v": 2}})
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(2, {"x": {"v": 2}})


def test_close_from_another_thread_releases_the_lock_and_the_signal_handler(
    tmp_path: Path,
) -> None:
    """Defect 4: close() from a non-main thread raised ValueError (signal.signal) before the
    root's lock was released."""
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        options = CheckpointManagerOptions(preemption_signals=(signal.SIGUSR1,))
        mgr = CheckpointManager(tmp_path, options=options)
        mgr.save(0, {"x": {"v": 0}})
        closer = threading.Thread(target=mgr.close)
        closer.start()
        _join(closer)
        mgr.close()  # idempotent
        with CheckpointManager(tmp_path) as again:  # the lock is free
            assert again.all_steps() == [0]
        signal.raise_signal(signal.SIGUSR1)
        assert calls == [signal.SIGUSR1]
        assert not mgr._preemption.requested  # a closed manager's flag is not set any more
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_two_managers_closed_in_opening_order_do_not_swallow_the_next_signal(
    tmp_path: Path,
) -> None:
    """Defect 5: closing two managers in the order they were opened reinstalled the first
    one's dead handler, which swallowed the next signal."""
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        options = CheckpointManagerOptions(preemption_signals=(signal.SIGUSR2,))
        first = CheckpointManager(tmp_path / "a", options=options)
        second = CheckpointManager(tmp_path / "b", options=options)
        first.close()
        second.close()
        signal.raise_signal(signal.SIGUSR2)
        assert calls == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR2) is not first._preemption._handle
    finally:
        signal.signal(signal.SIGUSR2, previous)


# ------------------------------------------------------------------------------- the root's view


def test_reload_never_drops_a_step_committed_while_it_scans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 9: reload() raced the background commit: a listing taken before the commit's
    rename overwrote the view after it, dropping the new step."""
    mgr = CheckpointManager(tmp_path, options=CheckpointManagerOptions(async_save=True))
    mgr.save(0, {"x": {"v": 0}})
    mgr.wait_until_finished()
    listed, go = threading.Event(), threading.Event()
    real_scandir = os.scandir

    def slow_scandir(path: Any) -> Any:
        if threading.current_thread().name != "reloader":
            return real_scandir(path)
        entries = list(real_scandir(path))
        listed.set()
        go.wait(timeout=5)
        return iter(entries)

    monkeypatch.setattr(os, "scandir", slow_scandir)
    reloader = threading.Thread(target=mgr.reload, name="reloader")
    reloader.start()
    assert listed.wait(timeout=30)
    mgr.save(1, {"x": {"v": 1}})  # its commit runs while the reload holds a stale listing
    time.sleep(0.5)
    go.set()
    _join(reloader)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [0, 1]
    monkeypatch.undo()
    mgr.close()


def test_a_hole_in_a_piecewise_written_file_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 12 on one process: a handler that leaves bytes of a file unwritten (they would
    read back as zeros with a valid checksum) is caught before the commit."""
    original = _sharding.write_files

    def forgetful(directory: Path, files: Any, pieces: Any, **kwargs: Any) -> None:
        first = files[0].tensors[0].name
        p = pieces[first]
        original(
            directory, files, {**pieces, first: type(p)(p.shape, p.dtype, None, p.row)}, **kwargs
        )

    monkeypatch.setattr(model_module, "write_files", forgetful)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointSaveError, match="written by no rank"):
            mgr.save(0, {"model": model})
        assert mgr.all_steps() == []
        monkeypatch.undo()
        assert mgr.save(0, {"model": model})


def test_coverage_problems_are_named() -> None:
    """The coverage rule itself, on the ranks' summaries: exact tiling passes; a hole, an
    overlap, both at once (same length: the counts agree) and an overrun are named."""
    from orbit_pt._format.coverage import intervals, segments, summary, summary_problems

    def check(size: int, by_rank: dict[int, list[tuple[int, int]]]) -> list[str]:
        summaries = {
            rank: summary(size, segments([(s, e - s, 0) for s, e in ivs]))
            for rank, ivs in by_rank.items()
        }
        return summary_problems(size, summaries)

    assert intervals([[10, 15], [0, 10], [12, 13]]) == [[0, 15]]
    assert check(20, {0: [(0, 10)], 1: [(10, 20)]}) == []
    assert "written by no rank" in check(20, {0: [(0, 8)], 1: [(10, 20)]})[0]
    assert "more than one rank" in check(20, {0: [(0, 12)], 1: [(10, 20)]})[0]
    # rank 1 rewrites 2 bytes of rank 0's and leaves 2 bytes unwritten: same count, other sums
    assert (
        "more than one rank and others by no rank"
        in check(20, {0: [(0, 10)], 1: [(8, 10), (12, 20)]})[0]
    )
    assert "written by no rank" in check(20, {0: [(0, 10)]})[0]
    assert "more than one rank" in check(5, {0: [(0, 10)]})[0]


# ----------------------------------------------------------------------------- small contracts


def test_should_save_is_false_on_a_read_only_manager(tmp_path: Path) -> None:
    """Defect 15: should_save(step) was True on a read-only manager, whose save then raised."""
    CheckpointManager(tmp_path).close()
    options = CheckpointManagerOptions(read_only=True, save_interval_steps=1)
    with CheckpointManager(tmp_path, options=options) as mgr:
        assert not any(mgr.should_save(step) for step in range(5))


def test_waiting_for_the_previous_save_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect 16: "save waited for the previous save" was logged at INFO, though it shows a
    save interval shorter than a save takes."""
    handler = _Gated()
    options = CheckpointManagerOptions(async_save=True)
    with CheckpointManager(tmp_path, options=options, handlers={"x": handler}) as mgr:
        handler.gate.clear()
        mgr.save(0, {"x": {"v": 0}})
        threading.Timer(0.2, handler.gate.set).start()
        with caplog.at_level(logging.WARNING, logger="orbit_pt"):
            mgr.save(1, {"x": {"v": 1}})
    waited = [r for r in caplog.records if "waited" in r.getMessage()]
    assert waited
    assert all(r.levelno == logging.WARNING for r in waited)


def test_is_saving_in_progress(tmp_path: Path) -> None:
    handler = _Gated()
    options = CheckpointManagerOptions(async_save=True)
    with CheckpointManager(tmp_path, options=options, handlers={"x": handler}) as mgr:
        assert not mgr.is_saving_in_progress()
        handler.gate.clear()
        mgr.save(0, {"x": {"v": 0}})
        assert mgr.is_saving_in_progress()
        handler.gate.set()
        mgr.wait_until_finished()
        assert not mgr.is_saving_in_progress()


def test_a_manager_whose_open_fails_releases_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("no signals here (injected)")

    monkeypatch.setattr("orbit_pt.manager.PreemptionWatcher", broken)
    with pytest.raises(OSError, match="injected"):
        CheckpointManager(tmp_path)
    monkeypatch.undo()
    CheckpointManager(tmp_path).close()


# ---------------------------------------------------------------------------------- preemption


def test_a_loop_that_saves_after_its_preemption_step_is_ended(tmp_path: Path) -> None:
    """Defect 14 in-process: after the preemption save, the next save() ends the process with
    PreemptionExit (a SystemExit), so `finally` and `with` blocks run; saving the preemption
    step again is a no-op."""
    options = CheckpointManagerOptions(save_interval_steps=100, preemption_exit_code=143)
    ran_finally = False
    saved: list[int] = []

    def loop() -> None:
        nonlocal ran_finally
        try:
            with CheckpointManager(tmp_path, options=options) as mgr:
                for step in range(1000):
                    if step == 7:
                        mgr._preemption.request()  # what the SIGTERM handler does
                    if mgr.save(step, {"x": {"step": step}}):
                        saved.append(step)
                    if step == 7:  # the preemption step again: nothing to do
                        assert not mgr.save(step, {"x": {"step": step}}, force=True)
        finally:
            ran_finally = True

    with pytest.raises(PreemptionExit) as info:
        loop()
    assert ran_finally
    assert info.value.code == 143
    assert info.value.step == 8
    assert info.value.saved == 7
    assert "reached_preemption" in str(info.value)
    assert saved == [0, 7]
    assert CheckpointManager(tmp_path).all_steps() == [0, 7]  # and the root was unlocked


def test_preemption_exit_code_is_validated() -> None:
    with pytest.raises(ValueError, match="preemption_exit_code"):
        CheckpointManagerOptions(preemption_exit_code=300)


_RUNNER = """
import os, signal, sys
import torch
import orbit_pt

term_at = int(sys.argv[2])
calls = [0]
real_step = torch.optim.AdamW.step

def step(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == term_at:
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's preemption notice
    return real_step(self, *args, **kwargs)

torch.optim.AdamW.step = step
real_restore = orbit_pt.CheckpointManager.restore

def restore(self, step=None, *args, **kwargs):
    print("RESTORED", step, flush=True)
    return real_restore(self, step, *args, **kwargs)

orbit_pt.CheckpointManager.restore = restore
source = open(sys.argv[1]).read()
exec(compile(source, "README quick start", "exec"), {"__name__": "__main__"})
print("FINISHED", calls[0], flush=True)
"""


def _quick_start() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None
    return match.group(1)


@pytest.mark.distributed
def test_the_readme_quick_start_given_one_sigterm_saves_one_step_and_exits(tmp_path: Path) -> None:
    """Defect 14: one SIGTERM and the README loop (which never calls reached_preemption) saved
    every step until the loop ended. Unmodified, it now saves one preemption step, exits inside
    its grace period with the documented status, and the next run resumes from that step."""
    code = tmp_path / "quickstart.py"
    code.write_text(_quick_start())
    runner = tmp_path / "runner.py"
    runner.write_text(_RUNNER)
    env = {**os.environ, "ORBIT_PT_PROGRESS": "0"}

    # optimizer.step() of step 38 is its 39th call: SIGTERM arrives during step 38.
    def run(term_at: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(runner), str(code), str(term_at)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    started = time.monotonic()
    first = run(39)
    elapsed = time.monotonic() - started
    assert first.returncode == 143, first.stderr[-3000:]
    assert "FINISHED" not in first.stdout
    assert "PreemptionExit" not in first.stderr  # a clean exit, not a traceback
    root = tmp_path / "runs" / "exp1" / "checkpoints"
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as mgr:
        assert mgr.all_steps() == [0, 38]
    assert elapsed < 120
    second = run(-1)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "RESTORED 38" in second.stdout
    assert "FINISHED 961" in second.stdout  # steps 39..999: none lost, none repeated
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as mgr:
        assert mgr.all_steps() == [700, 800, 900]
