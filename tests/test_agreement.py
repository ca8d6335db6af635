"""The agreed save protocol on real gloo ranks: a failure at any phase, on any one rank, raises on
every rank, names that rank, commits nothing and hangs nothing; the job then saves again.

Each body runs under ``run_ranks``'s hard timeout, so a hang fails the test.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

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
from orbit_pt._storage.store import StepStore
from orbit_pt.handlers import StateHandler
from orbit_pt.handlers.base import HandlerContext

pytestmark = pytest.mark.distributed


class _Faulty(StateHandler):
    """A state handler that fails in the phase it is told to, on the rank it is told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_in: str | None = None
        self.error: type[BaseException] = OSError

    def stage(self, item: Any, context: HandlerContext) -> Any:
        if self.fail_in == "stage":
            raise self.error("pinned-memory allocation failed (injected)")
        return super().stage(item, context)

    def save(self, directory: Path, item: Any, context: HandlerContext) -> dict:
        if self.fail_in == "write":
            raise self.error("No space left on device (injected)")
        return dict(super().save(directory, item, context))


def _state(step: int, rank: int) -> dict:
    return {"w": torch.arange(16, dtype=torch.float32) * step + rank, "step": step}


# (phase, failing rank, error type). "finish" fails on rank 0: only rank 0 finishes.
_FAULTS: list[tuple[str, int, type[BaseException]]] = [
    ("plan", 1, TypeError),
    ("metric", 1, ValueError),
    ("stage", 1, OSError),
    ("write", 1, OSError),
    ("write", 0, OSError),
    ("finish", 0, OSError),
    ("commit", 0, OSError),
    ("write", 1, KeyboardInterrupt),
    ("stage", 1, KeyboardInterrupt),
]


def _faults_at_every_phase(rank: int, world_size: int, root: str, async_save: bool) -> None:
    handler = _Faulty()
    options = CheckpointManagerOptions(async_save=async_save, keep_last_n=3)
    with CheckpointManager(root, options=options, handlers={"x": handler}) as mgr:
        assert mgr.save(0, {"x": _state(0, rank)}, metrics={"loss": 1.0})
        mgr.wait_until_finished()
        step, committed = 1, [0]
        for phase, failing, error in _FAULTS:
            if phase == "stage" and not async_save:
                continue  # a synchronous save does not stage
            mine = rank == failing
            handler.fail_in = phase if mine else None
            handler.error = error
            items: Any = {"x": _state(step, rank)}
            metrics = {"loss": 0.5}
            if mine and phase == "plan":
                items = ["x"]  # not a mapping: refused while planning
            if mine and phase == "metric":
                metrics = {"loss": math.nan}
            original = StepStore._finalize
            original_supersede = StepStore._supersede_from
            if mine and phase == "finish":

                def broken(self: StepStore, *args: Any, **kwargs: Any) -> Any:
                    raise OSError("fsync of the metadata failed (injected)")

                StepStore._finalize = broken  # type: ignore[method-assign]
            if mine and phase == "commit":  # after every agreement: rank 0 alone renames

                def no_rename(self: StepStore, *args: Any, **kwargs: Any) -> Any:
                    raise OSError("rename refused (injected)")

                StepStore._supersede_from = no_rename  # type: ignore[method-assign]
            # An interrupt in the training thread stays an interrupt on its rank; in the background
            # thread (where no signal can land) it is that save's failure.
            interrupted = (
                mine and error is KeyboardInterrupt and not (async_save and phase == "write")
            )
            started = time.monotonic()
            try:
                mgr.save(step, items, metrics=metrics)
                mgr.wait_until_finished()  # an async failure surfaces here
            except CheckpointSaveError as exc:
                assert not interrupted, "the interrupt was swallowed"
                text = str(exc)
                assert f"rank(s) [{failing}]" in text, (phase, text)
                cause = {"plan": "must be a mapping", "metric": "is nan"}.get(phase, "(injected)")
                assert cause in text, (phase, text)
            except KeyboardInterrupt:
                assert interrupted
            else:
                raise AssertionError(f"rank {rank}: no error for a failure in {phase}")
            finally:
                StepStore._finalize = original  # type: ignore[method-assign]
                StepStore._supersede_from = original_supersede  # type: ignore[method-assign]
            assert time.monotonic() - started < 60, f"{phase}: took too long to agree"
            handler.fail_in = None
            # Nothing committed, every rank sees the same steps, the earlier step is intact.
            assert _gather(mgr.all_steps()) == [committed[-3:]] * world_size
            latest = committed[-1]
            restored = mgr.restore(latest)["x"]
            assert torch.equal(restored["w"], _state(latest, rank)["w"])
            assert restored["step"] == latest
            # The job goes on: the next save succeeds on every rank.
            assert mgr.save(step + 1, {"x": _state(step + 1, rank)}, metrics={"loss": 0.1})
            mgr.wait_until_finished()
            committed.append(step + 1)
            step += 2
        assert not list(Path(root).glob("*.orbit-tmp"))
        assert mgr.all_steps() == committed[-3:]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failure_at_each_phase_on_one_rank_raises_everywhere(
    tmp_path: Path, async_save: bool
) -> None:
    """Defects 6 and 8: failures before the commit (plan, metric, stage) were not agreed, and a
    KeyboardInterrupt on one rank stranded the others; now every phase is one agreement."""
    run_ranks(2, _faults_at_every_phase, str(tmp_path), async_save)


def _nan_on_one_rank(rank: int, world_size: int, root: str) -> None:
    options = CheckpointManagerOptions(keep_best_n=1, best_metric="loss")
    with CheckpointManager(root, options=options) as mgr:
        loss = math.nan if rank == 1 else 0.25
        with pytest.raises(CheckpointSaveError, match=r"rank\(s\) \[1\].*'loss'.*nan"):
            mgr.save(0, {"x": {"v": torch.ones(2)}}, metrics={"loss": loss})
        assert mgr.all_steps() == []
        # Metrics that differ but are finite: rank 0's value is recorded.
        mgr.save(1, {"x": {"v": torch.ones(2)}}, metrics={"loss": 0.5 + rank})
        assert mgr.metadata(1).metrics == {"loss": 0.5}
        # Items of different kinds on different ranks: refused in the plan, on every rank.
        item: Any = torch.nn.Linear(2, 2) if rank == 1 else {"v": torch.ones(2)}
        with pytest.raises(CheckpointSaveError, match="names and kinds"):
            mgr.save(2, {"x": item})
        assert mgr.all_steps() == [1]


def test_a_nan_metric_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """Defect 6: metrics were per rank and only rank 0's were checked and recorded."""
    run_ranks(2, _nan_on_one_rank, str(tmp_path))


def _read_only_on_rank_0(rank: int, world_size: int, root: str) -> None:
    from torch.distributed import distributed_c10d as c10d

    groups_before = len(c10d._world.pg_map)
    with CheckpointManager(root) as mgr:  # a writer: collective
        mgr.save(0, {"x": {"v": torch.ones(2)}})
    assert len(c10d._world.pg_map) == groups_before, "the manager's gloo group was not destroyed"
    options = CheckpointManagerOptions(async_save=True)
    with CheckpointManager(root, options=options) as mgr:
        mgr.save(1, {"x": {"v": torch.ones(2)}})
    assert len(c10d._world.pg_map) == groups_before, "the async manager's groups leak"
    if rank == 0:  # an evaluator on rank 0 only: must not wait for rank 1
        read_only = CheckpointManagerOptions(read_only=True)
        with CheckpointManager(root, options=read_only) as reader:
            assert reader.all_steps() == [0, 1]
            assert torch.equal(reader.restore(1)["x"]["v"], torch.ones(2))
            assert not reader.should_save(100)
            assert not reader.reached_preemption(100)
    assert len(c10d._world.pg_map) == groups_before


def test_a_read_only_manager_opens_on_one_rank_and_groups_are_destroyed(tmp_path: Path) -> None:
    """Defect 7: creating any manager was collective (read-only too) and groups leaked."""
    run_ranks(2, _read_only_on_rank_0, str(tmp_path), timeout=120)


def _roots_spelled_differently(rank: int, world_size: int, root: str) -> None:
    import os

    spelled = root
    if rank == 1:  # the same folder, as a path relative to the working directory
        os.chdir(Path(root).parent)
        spelled = Path(root).name
    options = CheckpointManagerOptions(keep_last_n=1, async_save=True)
    with CheckpointManager(spelled, options=options) as mgr:
        for step in range(3):
            mgr.save(step, {"x": {"v": torch.full((2,), float(step))}})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]


def test_ranks_may_spell_the_root_differently(tmp_path: Path) -> None:
    """Defect 8: the agreement key contained paths, so ranks spelling the root differently
    failed to agree."""
    run_ranks(2, _roots_spelled_differently, str(tmp_path))


def _restore_fails_on_one_rank(rank: int, world_size: int, root: str) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(0, {"x": {"v": torch.ones(4)}})
        target = {"v": torch.zeros(4 if rank == 0 else 5)}
        if rank == 1:
            with pytest.raises(StateMismatchError):
                mgr.restore(0, {"x": target})
        else:
            with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\]"):
                mgr.restore(0, {"x": target})
        # Different steps on different ranks are refused everywhere.
        mgr.save(1, {"x": {"v": torch.ones(4)}})
        with pytest.raises(CheckpointError, match="different steps"):
            mgr.restore(rank, {"x": {"v": torch.zeros(4)}})
        # A good restore after the failures works on both ranks.
        good = {"v": torch.zeros(4)}
        mgr.restore(0, {"x": good})
        assert torch.equal(good["v"], torch.ones(4))


def test_a_restore_that_fails_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    """Defect 10: restore was not agreed; the other ranks carried on training."""
    run_ranks(2, _restore_fails_on_one_rank, str(tmp_path))


def _holes_and_overlaps(rank: int, world_size: int, root: str) -> None:
    import orbit_pt.handlers.model as model_module
    from orbit_pt._format import sharding as _sharding

    original = _sharding.write_files
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    mode = {"value": "ok"}

    def buggy(directory: Path, files: Any, pieces: Any, **kwargs: Any) -> None:
        # A handler bug: rank 0 forgets one tensor (a hole), or rank 1 also writes rank 0's
        # tensors (an overlap).
        if mode["value"] == "hole" and rank == 0:
            first = files[0].tensors[0].name
            p = pieces[first]
            pieces = {**pieces, first: type(p)(p.shape, p.dtype, None, p.row)}
        if mode["value"] == "overlap" and rank == 1:
            state = model.state_dict()
            pieces = {n: type(p)(p.shape, p.dtype, state[n], p.row) for n, p in pieces.items()}
        original(directory, files, pieces, **kwargs)

    setattr(model_module, "write_files", buggy)  # noqa: B010 -- a private name, patched
    with CheckpointManager(root) as mgr:
        mode["value"] = "hole"
        with pytest.raises(CheckpointSaveError, match="written by no rank"):
            mgr.save(0, {"model": model})
        mode["value"] = "overlap"
        with pytest.raises(CheckpointSaveError, match="written by more than one rank"):
            mgr.save(1, {"model": model})
        mode["value"] = "ok"
        assert mgr.save(2, {"model": model})
        assert mgr.all_steps() == [2]


def test_the_ranks_byte_ranges_must_cover_each_file_exactly(tmp_path: Path) -> None:
    """Defect 12: nothing checked that the ranks' byte ranges cover each file exactly; a hole
    read back as zeros with a valid checksum."""
    run_ranks(2, _holes_and_overlaps, str(tmp_path))


def _shared_to_rank_0(rank: int, world_size: int, root: str) -> None:
    from orbit_pt._control.collective import AgreedError, Collective

    collective = Collective().new_group()
    try:
        result, shared = collective.agree(
            "test.to_primary", lambda: rank * 10, share=lambda r: {"rank": r}, to_primary=True
        )
        assert result == rank * 10
        assert shared == ([{"rank": 0}, {"rank": 10}] if rank == 0 else [])

        def fails_on_1() -> int:
            if rank == 1:
                raise OSError("rank 1 cannot")
            return rank

        # A failure is agreed before anything is gathered: every rank raises, none waits.
        with pytest.raises(AgreedError, match="rank 1 cannot"):
            collective.agree("test.to_primary.fail", fails_on_1, share=str, to_primary=True)
        # ... and the group is still in step afterwards.
        assert collective.all_gather(rank) == [0, 1]
    finally:
        collective.close()


def test_shared_values_can_go_to_rank_0_only(tmp_path: Path) -> None:
    """The write reports of a save go to rank 0 only (W values moved, not W squared)."""
    run_ranks(2, _shared_to_rank_0, str(tmp_path), timeout=120)
