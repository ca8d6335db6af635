"""Preemption: a real SIGTERM sent to one rank becomes the same saved step on every rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _distributed import gather, run_ranks
from _roots import RootUnderTest

from orbit_pt import CheckpointError, CheckpointManager, CheckpointManagerOptions
from orbit_pt._control.collective import InFlightAny
from orbit_pt._control.preemption import PreemptionWatcher
from orbit_pt._control.preemption_agreement import PreemptionAgreement

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


def test_preemption_save_is_synchronous_even_with_async(where: RootUnderTest) -> None:
    options: dict[str, Any] = {
        "save_interval_steps": 5,
        "async_save": True,
        "preemption_signals": (signal.SIGUSR2,),
    }
    with where.open(**options) as mgr:
        assert mgr.save(5, {"x": {"v": 5}})  # an async save, perhaps still in flight
        os.kill(os.getpid(), signal.SIGUSR2)
        assert mgr.should_save(7)
        mgr.save(7, {"x": {"v": 7}})
        # No wait_until_finished(): the step must already be committed (on S3: its marker in
        # the store, not only in the mirror), after the async save before it.
        assert where.is_committed(7)
        assert where.is_committed(5)
        assert mgr.all_steps() == [5, 7]
        assert mgr.reached_preemption(8)
    with where.reader() as reader:
        assert reader.all_steps() == [5, 7]
        assert reader.restore(7) == {"x": {"v": 7}}


# ------------------------------------------------------------ the per-step check on gloo ranks

SIGNAL_STEP = 9
STEPS = range(0, 60, 3)  # step numbers may jump: the check counts calls, not steps


def _sigterm_to_rank_1(
    rank: int,
    world_size: int,
    root: str,
    where: str,
    acted_on: int,
    storage_options: dict[str, Any] | None = None,
) -> None:
    options = CheckpointManagerOptions(save_interval_steps=1000, async_save=True)  # SIGTERM

    def signal_if(point: str, step: int) -> None:
        if rank == 1 and step == SIGNAL_STEP and point == where:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, to this rank alone

    saved: list[int] = []
    with CheckpointManager(root, options=options, storage_options=storage_options) as mgr:
        for step in STEPS:
            signal_if("before the check", step)
            due = mgr.should_save(step)
            assert mgr.should_save(step) == due  # asked again: the same answer, nothing started
            signal_if("after the check", step)
            if due and mgr.save(step, {"x": {"step": step, "rank": rank}}):
                saved.append(step)
            if mgr.reached_preemption(step):
                break
            signal_if("after the loop's own check", step)
        assert mgr._background.in_flight is None  # the preemption save was synchronous
        views = gather((step, saved, mgr.all_steps()))
    assert views == [(acted_on, [0, acted_on], [0, acted_on])] * world_size, views


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("where", "acted_on"),
    [
        # The check of step 9 sees the flag and starts its all-reduce; step 12's reads it.
        ("before the check", 12),
        # The flag arrives after step 9's check: step 12's carries it, step 15's reads it.
        ("after the check", 15),
        ("after the loop's own check", 15),
    ],
)
def test_sigterm_to_rank_1_only_is_one_save_of_the_same_step_on_every_rank(
    tmp_path: Path, where: str, acted_on: int
) -> None:
    run_ranks(2, _sigterm_to_rank_1, str(tmp_path), where, acted_on, timeout=120)
    with CheckpointManager(tmp_path, options=CheckpointManagerOptions(read_only=True)) as mgr:
        assert mgr.all_steps() == [0, acted_on]
        assert mgr.metadata(acted_on).world_size == 2


@pytest.mark.distributed
def test_sigterm_to_rank_1_on_an_object_store_root(s3_root: Any, tmp_path: Path) -> None:
    """The same agreed preemption save with an s3:// root: step 0 uploads in the background,
    the preemption step is uploaded and committed in the store before save() returns."""
    storage = {**s3_root.storage_options, "cache_dir": str(tmp_path / "mirror")}
    run_ranks(2, _sigterm_to_rank_1, s3_root.url, "before the check", 12, storage, timeout=180)
    other = {**storage, "cache_dir": str(tmp_path / "other-machine")}
    options = CheckpointManagerOptions(read_only=True)
    with CheckpointManager(s3_root.url, options=options, storage_options=other) as reader:
        assert reader.all_steps() == [0, 12]
        assert reader.metadata(12).world_size == 2
        # One process reads what two ranks saved: their per-rank field is left out.
        assert reader.restore(12, ["x"], exclude=("x.rank",))["x"] == {"step": 12}


class _TrainingStepFailedError(Exception):
    pass


def _rank_1_stops_between_check_and_save(rank: int, world_size: int, root: str, how: str) -> None:
    options = CheckpointManagerOptions(save_interval_steps=2)
    outcome = "saved step 2 without its peer"
    started = time.monotonic()
    try:
        with CheckpointManager(root, options=options) as mgr:
            for step in range(4):
                if not mgr.should_save(step):
                    continue  # step 2's check leaves an all-reduce in flight on every rank
                if rank == 1 and step == 2:
                    if how == "dies":
                        os._exit(0)  # no close(), no exception: the process is gone
                    raise _TrainingStepFailedError("the training step failed")
                started = time.monotonic()
                mgr.save(step, {"x": {"v": torch.full((2,), float(step))}})
    except _TrainingStepFailedError:
        outcome = "stopped"  # its manager closed (the with block), settling the check first
    except (CheckpointError, RuntimeError):  # gloo: the peer closed the connection
        outcome = "raised"
    assert outcome == ("raised" if rank == 0 else "stopped"), outcome
    assert time.monotonic() - started < 60, "the save waited for gloo's timeout"
    if how == "dies":
        os._exit(0)  # skip the harness's final barrier: the peer that would meet it is gone


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["raises", "dies"])
def test_a_rank_that_stops_between_check_and_save_does_not_hang_the_others(
    tmp_path: Path, how: str
) -> None:
    run_ranks(2, _rank_1_stops_between_check_and_save, str(tmp_path), how, timeout=120)
    with CheckpointManager(tmp_path, options=CheckpointManagerOptions(read_only=True)) as mgr:
        assert mgr.all_steps() == [0]


def _rank_1_dies_on_a_step_without_save(rank: int, world_size: int, root: str) -> None:
    options = CheckpointManagerOptions(save_interval_steps=1000)
    failed: tuple[int, str] | None = None
    with CheckpointManager(root, options=options) as mgr:
        for step in range(1, 100):
            try:
                mgr.should_save(step)
            except CheckpointError as exc:
                failed = (step, str(exc))
                break
            if rank == 1 and step == 5:
                os._exit(0)
    # Step 6's check reads step 5's all-reduce (complete, or cut off by the death); step 7's at
    # the latest reads one that rank 1 never joined.
    assert failed is not None
    assert failed[0] in (6, 7), failed
    assert "another rank left orbit_pt's gloo group" in failed[1]
    os._exit(0)  # skip the harness's final barrier: the peer that would meet it is gone


@pytest.mark.distributed
def test_a_rank_that_dies_between_checks_is_an_error_at_the_next_checks(tmp_path: Path) -> None:
    run_ranks(2, _rank_1_dies_on_a_step_without_save, str(tmp_path), timeout=120)


# ------------------------------------------------- the pipelined agreement, without processes


class _Work:
    """A gloo work handle that has finished, or failed as when a peer's process died."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def wait(self) -> None:
        if self.error is not None:
            raise self.error


class _Ranks:
    """A collective of two ranks whose all-reduce takes the MAX with the other rank's flags."""

    enabled, rank, world_size = True, 0, 2

    def __init__(self, peer_flags: dict[int, bool], fail_at: int | None = None) -> None:
        self.peer_flags = peer_flags  # the other rank's flag at its n-th all-reduce
        self.fail_at = fail_at
        self.started: list[bool] = []

    def start_any(self, flag: bool) -> InFlightAny:
        n = len(self.started)
        self.started.append(flag)
        agreed = flag or self.peer_flags.get(n, False)
        work = _Work(OSError("Connection reset by peer") if n == self.fail_at else None)
        return InFlightAny(torch.tensor([int(agreed)], dtype=torch.int32), work)


def test_each_check_answers_with_the_all_reduce_that_the_previous_check_started() -> None:
    watcher = PreemptionWatcher(())
    ranks = _Ranks(peer_flags={2: True})  # the peer saw a signal at its third check
    agreement = PreemptionAgreement(watcher, ranks, watched=True)  # type: ignore[arg-type]
    assert [agreement.check(s) for s in (0, 5, 9)] == [False, False, False]
    assert agreement.check(9) is False  # the same step again: answered, nothing started
    assert len(ranks.started) == 3
    assert agreement.check(12) is True  # reads the all-reduce that step 9's check started
    assert agreement.agreed
    assert agreement.check(13) is True
    assert len(ranks.started) == 3  # once agreed, nothing is left to ask


def test_a_local_signal_is_acted_on_at_the_next_check() -> None:
    watcher = PreemptionWatcher(())
    ranks = _Ranks(peer_flags={})
    agreement = PreemptionAgreement(watcher, ranks, watched=True)  # type: ignore[arg-type]
    assert not agreement.check(0)
    watcher.request()
    assert not agreement.check(1)  # this check carries the flag ...
    assert agreement.check(2)  # ... and the next one reads it
    assert ranks.started == [False, True]


def test_a_failed_all_reduce_is_a_checkpoint_error_at_the_next_check() -> None:
    ranks = _Ranks(peer_flags={}, fail_at=1)
    agreement = PreemptionAgreement(
        PreemptionWatcher(()),
        ranks,  # type: ignore[arg-type]
        watched=True,
    )
    assert not agreement.check(0)
    assert not agreement.check(1)
    with pytest.raises(CheckpointError, match="check of step 2 failed: another rank left") as info:
        agreement.check(2)
    assert isinstance(info.value.__cause__, OSError)


def test_an_unwatched_or_single_rank_check_answers_at_once_and_starts_nothing() -> None:
    watcher = PreemptionWatcher(())
    watcher.request()
    ranks = _Ranks(peer_flags={})
    assert PreemptionAgreement(watcher, ranks, watched=False).check(0)  # type: ignore[arg-type]
    ranks.world_size = 1
    assert PreemptionAgreement(watcher, ranks, watched=True).check(0)  # type: ignore[arg-type]
    assert ranks.started == []
