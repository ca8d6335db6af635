"""Preemption: a real SIGTERM sent to one rank becomes the same saved step on every rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orbit_pt import CheckpointManager, CheckpointManagerOptions

WORKER = Path(__file__).parent / "_preempt_worker.py"


def _wait_for(path: Path, predicate: object = None, timeout: float = 120.0) -> str:
    """Poll for a file the worker writes (the child's progress, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            text = path.read_text()
            if text and (predicate is None or predicate(text)):  # type: ignore[operator]
                return text
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {path}")


@pytest.mark.distributed
def test_sigterm_to_one_rank_saves_the_same_step_everywhere_and_resumes(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    job = subprocess.Popen([sys.executable, str(WORKER), str(root), str(out), "10000000"])
    try:
        pid = int(_wait_for(out / "rank1.pid"))
        _wait_for(out / "progress1", lambda t: int(t) >= 20)
        os.kill(pid, signal.SIGTERM)
        assert job.wait(timeout=120) == 0
    finally:
        job.kill()
    results = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    stopped = results[0]["stopped_at"]
    assert results[1]["stopped_at"] == stopped > 0
    with CheckpointManager(root, options=CheckpointManagerOptions(read_only=True)) as mgr:
        # Step 0 (interval) and the preemption step, committed by both ranks at once.
        assert mgr.all_steps() == [0, stopped]
        assert mgr.metadata(stopped).world_size == 2

    # The requeued job resumes from the preemption step and finishes.
    total = stopped + 5
    subprocess.run([sys.executable, str(WORKER), str(root), str(out), str(total)], check=True)
    results = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["resumed_from"] == stopped
        assert r["stopped_at"] == total - 1
        assert r["weights"] == float(total)  # no step lost, none repeated


def test_preemption_flag_and_handler_chaining(tmp_path: Path) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        options = CheckpointManagerOptions(
            save_interval_steps=100, preemption_signals=(signal.SIGUSR1,)
        )
        mgr = CheckpointManager(tmp_path, options=options)
        assert not mgr.reached_preemption(1)
        assert not mgr.should_save(1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the handler that was there before still runs
        assert mgr.reached_preemption(2)
        assert mgr.should_save(2)  # the preemption step is a save step
        assert mgr.reached_preemption(3)  # and it stays set
        mgr.close()
        # close() put the previous handler back.
        assert signal.getsignal(signal.SIGUSR1) is not None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1, signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_preemption_save_is_synchronous_even_with_async(tmp_path: Path) -> None:
    options = CheckpointManagerOptions(
        save_interval_steps=100, async_save=True, preemption_signals=(signal.SIGUSR2,)
    )
    with CheckpointManager(tmp_path, options=options) as mgr:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert mgr.should_save(7)
        mgr.save(7, {"x": {"v": 7}})
        # No wait_until_finished(): the step must already be committed.
        assert mgr.all_steps() == [7]
        assert (tmp_path / "step_00000007" / "_CHECKPOINT_METADATA").exists()
