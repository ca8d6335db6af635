"""The manager under torch.distributed: collective commit, agreement, failures, async, preemption.

Each test runs its body on real gloo ranks (separate processes on CPU).
"""

from __future__ import annotations

from pathlib import Path

import filelock
import pytest
import torch
from _distributed import gather as _gather
from _distributed import run_ranks

from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointSaveError,
    StateMismatchError,
)

pytestmark = pytest.mark.distributed


def _items(step: int, rank: int) -> dict:
    return {
        "shared": {"step": step, "weights": torch.full((4,), float(step))},
        "per_rank": {"rank": rank, "noise": torch.full((3,), float(step * 10 + rank))},
    }


def _save_and_agree(rank: int, world_size: int, root: str, async_save: bool) -> None:
    options = CheckpointManagerOptions(keep_last_n=2, keep_every_k_steps=4, async_save=async_save)
    with CheckpointManager(root, options=options) as mgr:
        for step in range(7):
            assert mgr.save(step, _items(step, rank))
        mgr.wait_until_finished()
        views = _gather((mgr.all_steps(), mgr.latest_step()))
        assert all(v == ([0, 4, 5, 6], 6) for v in views), views
        assert mgr.metadata(6).world_size == world_size
        restored = mgr.restore(5)
        assert restored["per_rank"]["rank"] == rank
        assert torch.equal(restored["per_rank"]["noise"], torch.full((3,), 50.0 + rank))
        assert torch.equal(restored["shared"]["weights"], torch.full((4,), 5.0))


@pytest.mark.parametrize("async_save", [False, True])
def test_two_ranks_commit_once_and_agree_on_steps(tmp_path: Path, async_save: bool) -> None:
    run_ranks(2, _save_and_agree, str(tmp_path), async_save)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000000",
        "step_00000004",
        "step_00000005",
        "step_00000006",
    ]
    # On one process: state that was the same on every rank restores from rank 0 ...
    with CheckpointManager(tmp_path, options=CheckpointManagerOptions(read_only=True)) as mgr:
        assert mgr.restore(6, ["shared"])["shared"]["step"] == 6
        # ... while per-rank state that differs cannot be guessed.
        with pytest.raises(StateMismatchError, match="differs between the 2 ranks"):
            mgr.restore(6, ["per_rank"])


class _Resharding:
    def __init__(self) -> None:
        self.ranks: list[int] = []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("load_state_dict_from_ranks should be used on another world size")

    def load_state_dict_from_ranks(self, states: list) -> None:
        self.ranks = [s["rank"] for s in states]


def test_per_rank_state_reshards_when_the_object_can(tmp_path: Path) -> None:
    run_ranks(2, _save_and_agree, str(tmp_path), False)
    target = _Resharding()
    with CheckpointManager(tmp_path, options=CheckpointManagerOptions(read_only=True)) as mgr:
        mgr.restore(6, {"per_rank": target})
    assert target.ranks == [0, 1]


class _Exploding:
    def state_dict(self) -> dict:
        raise OSError("disk on fire")

    def load_state_dict(self, state: dict) -> None:
        pass


def _one_rank_fails(rank: int, world_size: int, root: str) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(0, {"x": {"v": torch.ones(2)}})
        item = _Exploding() if rank == 1 else {"v": torch.zeros(2)}
        with pytest.raises(CheckpointSaveError) as info:
            mgr.save(1, {"x": item})
        if rank == 0:
            assert "rank(s) [1]" in str(info.value.__cause__)
            assert "disk on fire" in str(info.value.__cause__)
        else:
            assert "disk on fire" in str(info.value)
        assert mgr.all_steps() == [0]
        assert torch.equal(mgr.restore(0)["x"]["v"], torch.ones(2))
        # The job can go on saving after the failure.
        assert mgr.save(2, {"x": {"v": torch.full((2,), 2.0)}})
        assert _gather(mgr.all_steps()) == [[0, 2], [0, 2]]


def test_a_rank_that_fails_fails_the_save_everywhere(tmp_path: Path) -> None:
    run_ranks(2, _one_rank_fails, str(tmp_path))
    assert not list(tmp_path.glob("*.orbit-tmp"))


def _preempt_one_rank(rank: int, world_size: int, root: str) -> None:
    options = CheckpointManagerOptions(save_interval_steps=100, async_save=True)
    with CheckpointManager(root, options=options) as mgr:
        for step in range(10):
            if step == 3 and rank == 1:
                mgr._preemption.request()  # what the SIGTERM handler does
            if mgr.should_save(step):
                mgr.save(step, {"x": {"step": step}})
            if mgr.reached_preemption(step):
                break
        # Rank 1's check of step 3 started the all-reduce that carried its flag; the next
        # check, step 4's, read it on every rank.
        assert _gather(step) == [4, 4]
        assert mgr.all_steps() == [0, 4]
        # The preemption save was synchronous: it is durable before reached_preemption returns.
        assert mgr._background.in_flight is None


def test_preemption_on_one_rank_is_agreed_by_all(tmp_path: Path) -> None:
    run_ranks(2, _preempt_one_rank, str(tmp_path))


def _lock_error_everywhere(rank: int, world_size: int, root: str) -> None:
    if rank == 0:  # another writer holds the root; only rank 0 takes the lock, and notices
        Path(root).mkdir(exist_ok=True)
        held = filelock.FileLock(Path(root) / ".orbit.lock", timeout=0)
        held.acquire()
    with pytest.raises(CheckpointError, match="another CheckpointManager is writing"):
        CheckpointManager(root)


def test_lock_failure_on_rank_0_is_an_error_on_every_rank(tmp_path: Path) -> None:
    run_ranks(2, _lock_error_everywhere, str(tmp_path))


def _one_rank_stuck(rank: int, world_size: int, root: str) -> None:
    import time

    options = CheckpointManagerOptions(agreement_timeout=2.0)
    with CheckpointManager(root, options=options) as mgr:
        mgr.save(0, {"x": {"v": torch.ones(2)}})
        if rank == 1:
            time.sleep(8)  # alive, but away (a hung data loader, a debugger...)
        started = time.monotonic()
        with pytest.raises(CheckpointSaveError, match="did not answer") as info:
            mgr.save(1, {"x": {"v": torch.zeros(2)}})
        waited = time.monotonic() - started
        assert "agreement_timeout" in str(info.value)
        if rank == 0:  # it gave up after the timeout, not gloo's 30 minutes
            assert 1.5 < waited < 6.0, waited
        assert mgr.all_steps() == [0]


def test_a_rank_stuck_alive_fails_the_others_after_agreement_timeout(tmp_path: Path) -> None:
    run_ranks(2, _one_rank_stuck, str(tmp_path), timeout=120)
    assert not list(tmp_path.glob("*.orbit-tmp"))


def test_agreement_timeout_must_be_positive() -> None:
    from datetime import timedelta

    from orbit_pt import CheckpointValueError

    for bad in (0, -1.0, "5", True, timedelta(0)):
        with pytest.raises(CheckpointValueError, match="agreement_timeout"):
            CheckpointManagerOptions(agreement_timeout=bad)  # type: ignore[arg-type]
    assert CheckpointManagerOptions(agreement_timeout=timedelta(minutes=5)).agreement_timeout
