"""Save cadence and retention through a real CheckpointManager (issue 3).

Tables of expected outcomes (the issue's examples exactly, then every option, combinations,
restarts and rollbacks), a hypothesis state machine that checks the manager against a small
reference model of the rules after every operation, and crash tests that kill a child process
in the middle of a retention delete. Time comes from a fake clock: no sleeps.

The tests that take ``where`` run twice: on a local folder and on an ``s3://`` prefix of the
loopback S3 server (tests/_roots.py), where the kept steps are also checked in the store itself
and through a reader with an empty mirror.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from _roots import FOREIGN_OBJECTS, RootUnderTest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from orbit_pt import CheckpointInfo, CheckpointManager, CheckpointManagerOptions
from orbit_pt.policies import (
    AnyOf,
    AnySavePolicy,
    KeepBestN,
    KeepLastN,
    KeepSteps,
    OnSteps,
)

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_retention_worker.py"
MANAGER_LOGGER = "orbit_pt.manager"


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def item(step: int) -> dict[str, Any]:
    """A tiny item whose restored value says which step it came from."""
    return {"x": {"v": step}}


def open_manager(
    root: Path, *, clock: Callable[[], float] | None = None, **options: Any
) -> CheckpointManager:
    kwargs: dict[str, Any] = {"options": CheckpointManagerOptions(**options)}
    if clock is not None:
        kwargs["clock"] = clock
    return CheckpointManager(root, **kwargs)


def save_all(
    mgr: CheckpointManager,
    steps: Iterable[int],
    metrics: Mapping[int, Mapping[str, float]] | None = None,
    *,
    force: bool = False,
    clock: FakeClock | None = None,
    seconds_per_step: float = 1.0,
) -> list[int]:
    """Save each step (through should_save unless forced); the steps that were saved."""
    saved = []
    for step in steps:
        if clock is not None:
            clock.advance(seconds_per_step)
        m = None if metrics is None else metrics.get(step)
        if mgr.save(step, item(step), metrics=m, force=force):
            saved.append(step)
    return saved


def assert_restores(mgr: CheckpointManager) -> None:
    for step in mgr.all_steps():
        assert mgr.restore(step) == {"x": {"v": step}}


def entries(root: Path) -> set[str]:
    # The recorded retention options (for `orbit-pt ls`) are informational, never a step; a
    # deleted step's files are removed on a thread of their own, shortly after the deletion.
    return {
        entry.name
        for entry in root.iterdir()
        if entry.name != ".orbit-retention.json" and not entry.name.endswith(".orbit-deleting")
    }


def step_folders(steps: Iterable[int]) -> set[str]:
    return {f"step_{s:08d}" for s in steps}


# ------------------------------------------------------------------------- the examples


@pytest.mark.parametrize(
    ("options", "steps", "kept"),
    [
        # exactly the three examples of issue 3
        ({"keep_last_n": 2}, range(5), [3, 4]),
        ({"keep_last_n": 2, "keep_every_k_steps": 4}, range(11), [0, 4, 8, 9, 10]),
        ({"keep_every_k_steps": 5}, range(13), [0, 5, 10, 12]),
        # and around them
        ({"keep_last_n": 1}, range(5), [4]),
        ({"keep_last_n": 10}, range(5), [0, 1, 2, 3, 4]),
        ({"keep_every_k_steps": 5}, range(1, 5), [4]),  # no multiple of 5: only the latest
        ({"keep_every_k_steps": 1}, range(6), [0, 1, 2, 3, 4, 5]),
        ({"keep_every_k_steps": 3, "save_interval_steps": 2}, range(13), [0, 6, 12]),
        ({"keep_every_k_steps": 5, "save_interval_steps": 2}, range(13), [0, 10, 12]),
        ({"keep_last_n": 2, "save_interval_steps": 3}, range(13), [9, 12]),
        ({"keep_last_n": 1, "keep_every_k_steps": 10}, range(0, 35, 5), [0, 10, 20, 30]),
        ({"keep_last_n": 2, "retention": KeepSteps([1, 6])}, range(8), [1, 6, 7]),
        ({"retention": KeepSteps([2])}, range(6), [2, 5]),
        ({"save_on_steps": [3, 5, 9], "keep_last_n": 2}, range(10), [5, 9]),
        ({}, range(6), [0, 1, 2, 3, 4, 5]),  # no retention option: keep everything
    ],
)
def test_kept_steps(
    where: RootUnderTest, options: dict[str, Any], steps: range, kept: list[int]
) -> None:
    with where.open(**options) as mgr:
        save_all(mgr, steps)
        assert mgr.all_steps() == kept
        assert mgr.latest_step() == kept[-1]
        assert_restores(mgr)
    assert where.entries() == step_folders(kept) | where.lock_after_close
    with where.reader() as reader:  # on S3: what the store holds, read with an empty mirror
        assert reader.all_steps() == kept
        assert_restores(reader)


def test_keep_last_n_after_every_save(where: RootUnderTest) -> None:
    history = []
    with where.open(keep_last_n=2) as mgr:
        for step in range(5):
            mgr.save(step, item(step))
            history.append(mgr.all_steps())
    assert history == [[0], [0, 1], [1, 2], [2, 3], [3, 4]]


def test_keep_last_n_and_every_k_after_every_save(tmp_path: Path) -> None:
    history = []
    with open_manager(tmp_path, keep_last_n=2, keep_every_k_steps=4) as mgr:
        for step in range(11):
            mgr.save(step, item(step))
            history.append(mgr.all_steps())
    assert history[-4:] == [
        [0, 4, 6, 7],
        [0, 4, 7, 8],
        [0, 4, 8, 9],
        [0, 4, 8, 9, 10],
    ]


# --------------------------------------------------------------------------------- save cadence


@pytest.mark.parametrize(
    ("options", "steps", "saved"),
    [
        ({}, range(4), [0, 1, 2, 3]),  # no save rule: every step
        ({"save_interval_steps": 3}, range(11), [0, 3, 6, 9]),
        # a resumed run: the first step seen is not saved unless a rule says so
        ({"save_interval_steps": 5}, range(1, 12), [5, 10]),
        ({"save_interval_steps": 5}, range(7, 9), []),
        ({"save_on_steps": [2, 7]}, range(10), [2, 7]),
        ({"save_on_steps": []}, range(5), []),
        ({"save_interval_steps": 4, "save_on_steps": {1, 6}}, range(10), [0, 1, 4, 6, 8]),
        ({"save_policy": OnSteps([3])}, range(5), [3]),
        ({"save_policy": AnySavePolicy(OnSteps([1]), OnSteps([4]))}, range(6), [1, 4]),
    ],
)
def test_should_save_and_save(
    tmp_path: Path, options: dict[str, Any], steps: range, saved: list[int]
) -> None:
    with open_manager(tmp_path, **options) as mgr:
        assert [s for s in steps if mgr.should_save(s)] == saved
        assert save_all(mgr, steps) == saved
        assert mgr.all_steps() == saved


def test_no_hidden_initial_save(tmp_path: Path) -> None:
    with open_manager(tmp_path, save_interval_steps=100) as mgr:
        assert not mgr.save(1, item(1))  # the first call of a run is not special
        assert not mgr.save(99, item(99))
        assert mgr.all_steps() == []
        assert mgr.latest_step() is None
        assert mgr.save(100, item(100))
        assert mgr.all_steps() == [100]


def test_force_saves_whatever_the_cadence_and_retention_still_applies(tmp_path: Path) -> None:
    with open_manager(tmp_path, save_interval_steps=10, keep_last_n=2) as mgr:
        assert not mgr.save(3, item(3))
        assert mgr.save(3, item(3), force=True)
        assert mgr.save(7, item(7), force=True)
        assert mgr.save(10, item(10))
        assert mgr.all_steps() == [7, 10]
        assert mgr.save(11, item(11), force=True)
        assert mgr.all_steps() == [10, 11]
        assert_restores(mgr)


def test_custom_save_policy(tmp_path: Path) -> None:
    @dataclass(frozen=True)
    class PowersOfTwo:
        def should_save(self, step: int, *, preempted: bool = False) -> bool:
            return step > 0 and step & (step - 1) == 0

    with open_manager(tmp_path, save_policy=PowersOfTwo(), save_interval_steps=6) as mgr:
        assert save_all(mgr, range(20)) == [0, 1, 2, 4, 6, 8, 12, 16, 18]


# ---------------------------------------------------------------------------------------- best-n

LOSSES = {0: 5.0, 1: 3.0, 2: 4.0, 3: 1.0, 4: 6.0, 5: 2.0}


def loss(step: int) -> dict[str, float]:
    return {"loss": LOSSES[step]}


def test_best_n_survives_a_restart(where: RootUnderTest) -> None:
    options: dict[str, Any] = {"keep_best_n": 2, "best_metric": "loss"}
    with where.open(**options) as mgr:
        for step in range(3):
            mgr.save(step, item(step), metrics=loss(step))
        assert mgr.all_steps() == [1, 2]  # best two: 1 (3.0), 2 (4.0)
        assert mgr.best_step() == 1

    with where.open(**options) as mgr:
        # metrics come back from each step's metadata
        assert mgr.best_step() == 1
        assert mgr.metadata(1).metrics == {"loss": 3.0}
        assert mgr.metadata(2).metrics == {"loss": 4.0}
        history = []
        for step in range(3, 6):
            mgr.save(step, item(step), metrics=loss(step))
            history.append(mgr.all_steps())
        # 3 is the best; 4 is the worst but the latest (kept until 5 replaces it as latest)
        assert history == [[1, 3], [1, 3, 4], [3, 5]]
        assert mgr.best_step() == 3
        assert_restores(mgr)
    with where.reader(**options) as reader:
        assert reader.all_steps() == [3, 5]
        assert reader.best_step() == 3


def test_best_n_max_mode_across_restart(tmp_path: Path) -> None:
    acc = {0: 0.1, 1: 0.9, 2: 0.5, 3: 0.2, 4: 0.9}
    options: dict[str, Any] = {"keep_best_n": 1, "best_metric": "acc", "best_mode": "max"}
    with open_manager(tmp_path, **options) as mgr:
        for step in range(3):
            mgr.save(step, item(step), metrics={"acc": acc[step]})
        assert mgr.all_steps() == [1, 2]
    with open_manager(tmp_path, **options) as mgr:
        for step in range(3, 5):
            mgr.save(step, item(step), metrics={"acc": acc[step]})
        assert mgr.all_steps() == [4]  # ties go to the newer step; 4 is also the latest
        assert mgr.best_step() == 4


def test_best_n_keeps_the_latest_even_when_it_is_the_worst(where: RootUnderTest) -> None:
    # Orbax's best_fn and HF's save_total_limit + best could delete the newest step.
    with where.open(keep_best_n=1, best_metric="loss") as mgr:
        mgr.save(0, item(0), metrics={"loss": 1.0})
        mgr.save(1, item(1), metrics={"loss": 0.5})
        mgr.save(2, item(2), metrics={"loss": 3.0})
        assert mgr.all_steps() == [1, 2]
        mgr.save(3, item(3), metrics={"loss": 4.0})
        assert mgr.all_steps() == [1, 3]
        assert mgr.latest_step() == 3
        assert mgr.best_step() == 1


def _hf_total_limit(limit: int, losses: dict[int, float]) -> list[int]:
    """The checkpoints HF's Trainer keeps with ``save_total_limit=limit`` and
    ``load_best_model_at_end`` (transformers' ``_sorted_checkpoints`` and
    ``_rotate_checkpoints``): the best is moved to the second newest place, and all but the
    last ``limit`` go."""
    order = sorted(losses)
    best = min(order, key=lambda step: (losses[step], step))
    index = order.index(best)
    for i in range(index, len(order) - 2):
        order[i], order[i + 1] = order[i + 1], order[i]
    return sorted(order[-limit:])


@pytest.mark.parametrize(
    ("limit", "losses"),
    [
        (2, {2: 0.1, 4: 0.5, 6: 0.6, 8: 0.7}),  # the case: HF keeps [2, 8]
        (3, {2: 0.9, 4: 0.1, 6: 0.6, 8: 0.7, 10: 0.8}),
        (3, {2: 0.9, 4: 0.8, 6: 0.1, 8: 0.7, 10: 0.8}),  # the best among the newest N-1
        (2, {2: 0.9, 4: 0.8, 6: 0.7, 8: 0.1}),  # the best is the newest
    ],
)
def test_hf_save_total_limit_with_the_best_as_migration_md_maps_it(
    tmp_path: Path, limit: int, losses: dict[int, float]
) -> None:
    with open_manager(tmp_path, keep_last_n=limit - 1, keep_best_n=1, best_metric="loss") as mgr:
        for step, loss in losses.items():
            mgr.save(step, item(step), metrics={"loss": loss})
        kept = mgr.all_steps()
    hf = _hf_total_limit(limit, losses)
    newest = sorted(losses)[-(limit - 1) :]
    best = min(losses, key=losses.__getitem__)
    if best in newest:  # HF keeps one more of the newest (docs/migration.md says so)
        assert kept == newest
        assert hf == sorted(losses)[-limit:]
    else:
        assert kept == hf


@pytest.mark.parametrize(
    ("options", "metrics", "best"),
    [
        ({}, {0: {"loss": 1.0}, 1: {"loss": 2.0}}, 1),  # nothing configured: the latest
        ({"best_metric": "loss"}, {0: {"loss": 1.0}, 1: {"loss": 2.0}}, 0),
        ({"best_metric": "loss", "best_mode": "max"}, {0: {"loss": 1.0}, 1: {"loss": 2.0}}, 1),
        ({"best_metric": "loss"}, {0: {"loss": 1.0}, 1: {"loss": 1.0}, 2: {"loss": 9.0}}, 1),
        ({"best_metric": "loss"}, {0: {"acc": 1.0}, 1: {}}, None),  # nothing can be ranked
        ({"best_metric": "loss"}, {0: {}, 1: {"loss": 7.0}, 2: {}}, 1),
        ({"retention": KeepBestN(5, "acc", "max")}, {0: {"acc": 0.3}, 1: {"acc": 0.1}}, 0),
        (
            {"best_metric": "loss", "retention": KeepBestN(5, "acc", "max")},
            {0: {"acc": 0.3, "loss": 2.0}, 1: {"acc": 0.1, "loss": 1.0}},
            1,
        ),
    ],
)
def test_best_step(
    tmp_path: Path,
    options: dict[str, Any],
    metrics: dict[int, dict[str, float]],
    best: int | None,
) -> None:
    with open_manager(tmp_path, **options) as mgr:
        assert mgr.best_step() is None
        save_all(mgr, sorted(metrics), metrics)
        assert mgr.best_step() == best
    with open_manager(tmp_path, **options) as mgr:
        assert mgr.best_step() == best


def test_best_metric_alone_ranks_but_deletes_nothing(tmp_path: Path) -> None:
    with open_manager(tmp_path, best_metric="loss") as mgr:
        save_all(mgr, range(5), {s: {"loss": float(10 - s)} for s in range(5)})
        assert mgr.all_steps() == [0, 1, 2, 3, 4]
        assert mgr.best_step() == 4


def unranked_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == MANAGER_LOGGER and "cannot rank" in r.getMessage()
    ]


def test_unranked_steps_are_kept_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="orbit_pt")
    with open_manager(tmp_path, keep_best_n=1, best_metric="loss") as mgr:
        mgr.save(0, item(0))
        mgr.save(1, item(1), metrics={"acc": 0.5})
        mgr.save(2, item(2), metrics={"loss": 2.0})
        mgr.save(3, item(3), metrics={"loss": 1.0})
        mgr.save(4, item(4))
        mgr.save(5, item(5), metrics={"loss": 3.0})
        # 0, 1 and 4 have no "loss": kept; 3 is the best; 5 is the latest
        assert mgr.all_steps() == [0, 1, 3, 4, 5]
        assert mgr.best_step() == 3
    records = unranked_records(caplog)
    assert len(records) == 1
    message = records[0].getMessage()
    assert "step 0" in message
    assert "'loss'" in message
    assert str(tmp_path) in message
    assert records[0].levelno == logging.WARNING


def test_unranked_log_is_per_manager_and_only_for_best_n_retention(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="orbit_pt")
    with open_manager(tmp_path / "a", best_metric="loss") as mgr:
        save_all(mgr, range(3))  # ranks for best_step() only: nothing to warn about
    assert unranked_records(caplog) == []
    with open_manager(tmp_path / "b", retention=AnyOf(KeepLastN(1), KeepBestN(1, "acc"))) as mgr:
        save_all(mgr, range(3))
        assert mgr.all_steps() == [0, 1, 2]  # unranked: kept
    with open_manager(tmp_path / "b", retention=AnyOf(KeepLastN(1), KeepBestN(1, "acc"))) as mgr:
        save_all(mgr, range(3, 5))
    assert len(unranked_records(caplog)) == 2  # once per manager
    assert all("'acc'" in r.getMessage() for r in unranked_records(caplog))


# ---------------------------------------------------------------------------------- time-based


def test_keep_time_interval_with_a_fake_clock(tmp_path: Path) -> None:
    clock = FakeClock(start=1000.0)
    with open_manager(tmp_path, clock=clock, keep_time_interval=10.0) as mgr:
        # committed at 1003, 1006, ..., 1033: the first, then each >= 10 s after the last kept
        save_all(mgr, range(11), clock=clock, seconds_per_step=3.0)
        assert [mgr.metadata(s).time for s in mgr.all_steps()] == [1003.0, 1015.0, 1027.0, 1033.0]
        assert mgr.all_steps() == [0, 4, 8, 10]


def test_keep_time_interval_across_restart_and_with_keep_last_n(where: RootUnderTest) -> None:
    clock = FakeClock(start=0.0)
    options: dict[str, Any] = {
        "keep_time_interval": datetime.timedelta(minutes=1),
        "keep_last_n": 2,
    }
    with where.open(clock=clock, **options) as mgr:
        save_all(mgr, range(0, 500, 100), clock=clock, seconds_per_step=25.0)  # t=25..125
        assert mgr.all_steps() == [0, 300, 400]  # 0 at t=25; 300 at t=100 (>= 85)
    clock.advance(3600.0)  # the job was down for an hour
    with where.open(clock=clock, **options) as mgr:
        save_all(mgr, range(500, 800, 100), clock=clock, seconds_per_step=25.0)
        # 500 at t=3750 is >= 60 s after 300: kept by the interval; 600, 700 are the last two
        assert mgr.all_steps() == [0, 300, 500, 600, 700]


# ------------------------------------------------------------------------- latest, rollbacks


def test_latest_is_kept_when_no_policy_wants_it(where: RootUnderTest) -> None:
    with where.open(retention=KeepSteps([0])) as mgr:
        for step in range(4):
            mgr.save(step, item(step))
            assert mgr.all_steps() == sorted({0, step})


def test_rollback_makes_an_old_step_latest_and_it_is_kept(where: RootUnderTest) -> None:
    # torchtitan's keep-latest-k deleted the checkpoint it had just written after a rollback.
    with where.open(keep_every_k_steps=5) as mgr:
        save_all(mgr, range(8))
        assert mgr.all_steps() == [0, 5, 7]
        assert mgr.save(3, item(3))  # resumed from an older step: 5 and 7 are superseded
        assert mgr.all_steps() == [0, 3]
        assert mgr.latest_step() == 3
        assert mgr.restore() == {"x": {"v": 3}}
        superseded = sorted(where.entries("superseded"))
        assert [name.split(".")[0] for name in superseded] == ["step_00000005", "step_00000007"]
        save_all(mgr, range(4, 7))
        assert mgr.all_steps() == [0, 5, 6]
        assert sorted(where.entries("superseded")) == superseded  # untouched
    assert where.entries() == step_folders([0, 5, 6]) | {"superseded"} | where.lock_after_close
    with where.reader() as reader:
        assert reader.all_steps() == [0, 5, 6]
        assert_restores(reader)


def test_rollback_with_keep_last_n(where: RootUnderTest) -> None:
    with where.open(keep_last_n=2) as mgr:
        save_all(mgr, range(6))
        assert mgr.all_steps() == [4, 5]
        mgr.save(2, item(2))
        assert mgr.all_steps() == [2]  # the step just written is kept
        mgr.save(3, item(3))
        assert mgr.all_steps() == [2, 3]
        mgr.save(3, item(3))  # the same step again: the old copy is superseded
        assert mgr.all_steps() == [2, 3]
        assert len(where.entries("superseded")) == 3
        assert_restores(mgr)
    with where.reader() as reader:
        assert reader.all_steps() == [2, 3]
        assert_restores(reader)


def test_user_delete_of_the_latest_then_retention(where: RootUnderTest) -> None:
    with where.open(keep_every_k_steps=4) as mgr:
        save_all(mgr, range(7))
        assert mgr.all_steps() == [0, 4, 6]
        mgr.delete(6)
        assert mgr.latest_step() == 4
        mgr.save(5, item(5))
        assert mgr.all_steps() == [0, 4, 5]
    assert where.entries() == step_folders([0, 4, 5]) | where.lock_after_close


# ------------------------------------------------------------------------------------- general


def test_no_retention_option_keeps_everything(tmp_path: Path) -> None:
    with open_manager(tmp_path) as mgr:
        save_all(mgr, range(25))
        assert mgr.all_steps() == list(range(25))


def test_retention_runs_after_each_save_not_at_open(where: RootUnderTest) -> None:
    with where.open() as mgr:
        save_all(mgr, range(6))
    with where.open(keep_last_n=2) as mgr:
        assert mgr.all_steps() == [0, 1, 2, 3, 4, 5]  # opening deletes nothing
        mgr.save(6, item(6))
        assert mgr.all_steps() == [5, 6]


def test_a_failed_save_deletes_nothing(where: RootUnderTest) -> None:
    with where.open(keep_last_n=1) as mgr:
        save_all(mgr, range(3))
        with pytest.raises(Exception):  # noqa: B017, PT011 -- whichever error the handler raises
            mgr.save(3, {"x": {"v": object()}})
        assert mgr.all_steps() == [2]
        assert_restores(mgr)
    assert where.entries() == {"step_00000002"} | where.lock_after_close


@dataclass
class Spy:
    """A retention policy that records, at each call, whether the newest step was committed
    in the root (on S3: its marker in the store)."""

    root: RootUnderTest
    inner: KeepLastN
    calls: list[tuple[list[int], bool]] = field(default_factory=list)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        newest = max(c.step for c in checkpoints)
        self.calls.append(([c.step for c in checkpoints], self.root.is_committed(newest)))
        return self.inner.keep(checkpoints)


@pytest.mark.parametrize("async_save", [False, True])
def test_retention_runs_only_after_the_commit(where: RootUnderTest, async_save: bool) -> None:
    spy = Spy(where, KeepLastN(2))
    with where.open(retention=spy, async_save=async_save) as mgr:
        for step in range(5):
            mgr.save(step, item(step))
            mgr.wait_until_finished()
            assert spy.calls[-1][0][-1] == step  # the policy saw the new step as committed ...
            assert spy.calls[-1][1]  # ... and it was on disk under its final name
        assert mgr.all_steps() == [3, 4]
        assert_restores(mgr)
    assert len(spy.calls) == 5


def test_custom_retention_objects(where: RootUnderTest) -> None:
    class KeepLowLossOrOdd:
        """Keeps odd steps and any step with loss < 1 (reads metrics, no I/O)."""

        def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
            return {c.step for c in checkpoints if c.step % 2 or c.metrics.get("loss", 9.0) < 1.0}

    metrics = {s: {"loss": 0.5 if s == 4 else 2.0} for s in range(10)}
    options: dict[str, Any] = {"retention": [KeepLowLossOrOdd(), KeepSteps([0])], "keep_last_n": 1}
    with where.open(**options) as mgr:
        save_all(mgr, range(10), metrics)
        assert mgr.all_steps() == [0, 1, 3, 4, 5, 7, 9]
    with where.open(**options) as mgr:
        mgr.save(10, item(10))
        assert mgr.all_steps() == [0, 1, 3, 4, 5, 7, 9, 10]
        mgr.save(12, item(12))
        assert mgr.all_steps() == [0, 1, 3, 4, 5, 7, 9, 12]


# ---------------------------------------------------------------------------- foreign entries


def make_foreign(root: Path, outside: Path) -> None:
    """Things in a root that are not this manager's steps: retention must never touch them."""
    root.mkdir(parents=True)
    (root / "notes.txt").write_text("my notes")
    (root / ".hidden").write_bytes(b"\x00\x01")
    for name in (
        "step_00000099",  # a step name, but not committed (no metadata)
        "step_000000100",  # not the canonical name of step 100
        "step_7",
        "step_00000003.bak",
        "other.orbit-tmp",  # the tmp suffix, but not on a step name
        "eval",
    ):
        (root / name).mkdir()
        (root / name / "weights.bin").write_bytes(name.encode())
    nested = root / "eval" / "step_00000001"
    nested.mkdir()
    (nested / "_CHECKPOINT_METADATA").write_text("{}")
    outside.mkdir(parents=True)
    (outside / "precious.bin").write_bytes(b"precious")
    (root / "step_00000098").symlink_to(outside, target_is_directory=True)


def snapshot(path: Path) -> dict[str, bytes | str]:
    """Every file (content) and link (target) under ``path``, without following links."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        # A deleted step's folder is being removed on a thread of its own: never foreign.
        dirnames[:] = [d for d in dirnames if not d.endswith(".orbit-deleting")]
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(path).as_posix()
            if full.is_symlink():
                out[rel] = f"-> {full.readlink()}"
            elif full.is_file():
                out[rel] = full.read_bytes()
            else:
                out[rel] = "dir"
    return out


FOREIGN = {
    "notes.txt",
    ".hidden",
    "step_00000099",
    "step_000000100",
    "step_7",
    "step_00000003.bak",
    "other.orbit-tmp",
    "eval",
    "step_00000098",
}


def foreign_state(root: Path, outside: Path) -> tuple[dict[str, bytes | str], ...]:
    return (
        {k: v for k, v in snapshot(root).items() if k.split("/")[0] in FOREIGN},
        snapshot(outside),
    )


def test_retention_never_touches_foreign_entries(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    make_foreign(root, outside)
    before = foreign_state(root, outside)
    with open_manager(root, keep_last_n=1) as mgr:
        save_all(mgr, range(6))
        mgr.save(2, item(2))  # a rollback: superseded/ appears
        save_all(mgr, range(3, 5))
        assert mgr.all_steps() == [4]
        superseded = snapshot(root / "superseded")
        save_all(mgr, range(5, 8))
        assert snapshot(root / "superseded") == superseded
    assert foreign_state(root, outside) == before
    assert entries(root) == FOREIGN | step_folders([7]) | {"superseded", ".orbit.lock"}


# ------------------------------------------------------------------------ the reference model


@dataclass
class Rules:
    """The configured rules as plain data, for the reference model (not the options object)."""

    save_interval: int | None = None
    save_on: frozenset[int] | None = None
    last_n: int | None = None
    every_k: int | None = None
    best_n: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    interval: float | None = None
    pinned: frozenset[int] | None = None

    def options(self) -> CheckpointManagerOptions:
        return CheckpointManagerOptions(
            save_interval_steps=self.save_interval,
            save_on_steps=self.save_on,
            keep_last_n=self.last_n,
            keep_every_k_steps=self.every_k,
            keep_best_n=self.best_n,
            best_metric=self.best_metric,
            best_mode=self.best_mode,  # type: ignore[arg-type]
            keep_time_interval=self.interval,
            retention=None if self.pinned is None else KeepSteps(self.pinned),
        )


@dataclass(frozen=True)
class Saved:
    time: float
    metrics: dict[str, float]


def model_should_save(rules: Rules, step: int) -> bool:
    if rules.save_interval is None and rules.save_on is None:
        return True
    by_interval = rules.save_interval is not None and step % rules.save_interval == 0
    return by_interval or (rules.save_on is not None and step in rules.save_on)


def model_rank_key(rules: Rules, saved: dict[int, Saved], step: int) -> tuple[float, int]:
    assert rules.best_metric is not None
    value = saved[step].metrics[rules.best_metric]
    return (value if rules.best_mode == "min" else -value, -step)


def model_kept(rules: Rules, saved: dict[int, Saved]) -> set[int]:
    """What retention keeps, written independently of orbit_pt.policies."""
    steps = sorted(saved)
    if not steps:
        return set()
    no_rules = (
        rules.last_n is None
        and rules.every_k is None
        and rules.best_n is None
        and rules.interval is None
        and rules.pinned is None
    )
    if no_rules:
        return set(steps)
    kept = {steps[-1]}
    if rules.last_n is not None:
        kept.update(steps[-rules.last_n :])
    if rules.every_k is not None:
        kept.update(s for s in steps if s % rules.every_k == 0)
    if rules.best_n is not None:
        metric = rules.best_metric
        ranked = [s for s in steps if metric in saved[s].metrics]
        kept.update(s for s in steps if metric not in saved[s].metrics)
        ranked.sort(key=lambda s: model_rank_key(rules, saved, s))
        kept.update(ranked[: rules.best_n])
    if rules.interval is not None:
        anchor: float | None = None
        for s in steps:
            if anchor is None or saved[s].time - anchor >= rules.interval:
                kept.add(s)
                anchor = saved[s].time
    if rules.pinned is not None:
        kept.update(s for s in steps if s in rules.pinned)
    return kept


def model_best(rules: Rules, saved: dict[int, Saved]) -> int | None:
    if rules.best_metric is None:
        return max(saved) if saved else None
    ranked = [s for s in saved if rules.best_metric in saved[s].metrics]
    ranked.sort(key=lambda s: model_rank_key(rules, saved, s))
    return ranked[0] if ranked else None


MAX_STEP = 40


@st.composite
def rules_strategy(draw: st.DrawFn) -> Rules:
    # A few retention rules at a time (often one alone), so that no rule hides another's mistakes.
    kinds = draw(
        st.sets(st.sampled_from(["last_n", "every_k", "best_n", "interval", "pinned"]), max_size=3)
    )
    best_metric = draw(st.sampled_from(["loss", "acc"]))
    return Rules(
        save_interval=draw(st.sampled_from([None, None, 1, 2, 3])),
        save_on=draw(st.none() | st.frozensets(st.integers(0, 20), min_size=1, max_size=8)),
        last_n=draw(st.integers(1, 3)) if "last_n" in kinds else None,
        every_k=draw(st.sampled_from([2, 3, 5])) if "every_k" in kinds else None,
        best_n=draw(st.integers(1, 2)) if "best_n" in kinds else None,
        # best_metric alone (no keep_best_n) ranks for best_step() and deletes nothing
        best_metric=best_metric if "best_n" in kinds or draw(st.booleans()) else None,
        best_mode=draw(st.sampled_from(["min", "max"])),
        interval=draw(st.sampled_from([3.0, 5.0])) if "interval" in kinds else None,
        pinned=(
            draw(st.frozensets(st.integers(0, MAX_STEP), max_size=4)) if "pinned" in kinds else None
        ),
    )


metrics_strategy = st.one_of(
    st.none(),
    st.fixed_dictionaries({"loss": st.integers(0, 3).map(float)}),
    st.fixed_dictionaries({"acc": st.integers(0, 3).map(float)}),
    st.fixed_dictionaries(
        {"loss": st.integers(0, 3).map(float), "acc": st.integers(0, 3).map(float)}
    ),
)


class RetentionMachine(RuleBasedStateMachine):
    """Random saves, rollbacks and restarts against the reference model of the rules, on a
    local root with foreign entries in it."""

    def __init__(self, base: Path, counter: Iterator[int]) -> None:
        super().__init__()
        self.run = base / f"run{next(counter)}"
        self.prepare()
        self.clock = FakeClock(start=0.0)
        self.config = Rules()
        self.mgr: CheckpointManager | None = None
        self.saved: dict[int, Saved] = {}
        self.cursor = -1  # the training step reached; the next save is after it
        self.superseded = 0
        self.superseded_names: set[str] = set()

    def prepare(self) -> None:
        """Make the root, with things in it that are not this manager's."""
        self.root, self.outside = self.run / "ckpt", self.run / "outside"
        make_foreign(self.root, self.outside)
        self.foreign = foreign_state(self.root, self.outside)

    def open_manager(self, options: CheckpointManagerOptions) -> CheckpointManager:
        return CheckpointManager(self.root, options=options, clock=self.clock)

    def entries(self, under: str = "") -> set[str]:
        """The root's entries (or its folder ``under``'s), bookkeeping left out."""
        return entries(self.root / under if under else self.root)

    def foreign_unchanged(self) -> bool:
        return foreign_state(self.root, self.outside) == self.foreign

    FOREIGN_NAMES: ClassVar[set[str]] = FOREIGN
    LOCK: ClassVar[set[str]] = {".orbit.lock"}

    def manager(self) -> CheckpointManager:
        assert self.mgr is not None
        return self.mgr

    @initialize(config=rules_strategy())
    def open(self, config: Rules) -> None:
        self.config = config
        self.mgr = self.open_manager(config.options())

    @precondition(lambda self: self.cursor < MAX_STEP - 3)
    @rule(
        delta=st.integers(0, 3),
        metrics=metrics_strategy,
        force=st.sampled_from([False, False, True]),
        seconds=st.integers(1, 4),
    )
    def save(self, delta: int, metrics: dict[str, float] | None, force: bool, seconds: int) -> None:
        step = max(self.cursor + delta, 0)
        self.cursor = step
        self.clock.advance(seconds)
        expected = force or model_should_save(self.config, step)
        assert self.manager().save(step, item(step), metrics=metrics, force=force) == expected
        if not expected:
            return
        victims = [s for s in self.saved if s >= step]
        self.superseded += len(victims)
        for victim in victims:
            del self.saved[victim]
        self.saved[step] = Saved(self.clock.now, dict(metrics or {}))
        kept = model_kept(self.config, self.saved)
        self.saved = {s: v for s, v in self.saved.items() if s in kept}
        assert step in self.manager().all_steps()  # the latest is never deleted

    @precondition(lambda self: self.cursor > 0)
    @rule(data=st.data())
    def roll_back(self, data: st.DataObject) -> None:
        """Resume from an older step, as after a restore: later saves supersede newer steps."""
        self.cursor = data.draw(st.integers(0, self.cursor - 1), label="resume after")

    @rule()
    def restart(self) -> None:
        self.manager().close()
        self.mgr = self.open_manager(self.config.options())

    @rule(config=rules_strategy())
    def restart_with_other_options(self, config: Rules) -> None:
        self.manager().close()
        self.config = config
        self.mgr = self.open_manager(config.options())

    @invariant()
    def matches_the_model(self) -> None:
        if self.mgr is None:
            return
        mgr = self.manager()
        assert mgr.all_steps() == sorted(self.saved)
        assert mgr.latest_step() == (max(self.saved) if self.saved else None)
        assert mgr.best_step() == model_best(self.config, self.saved)
        for step, saved in self.saved.items():
            meta = mgr.metadata(step)
            assert (meta.time, dict(meta.metrics)) == (saved.time, saved.metrics)

    @invariant()
    def touches_nothing_else(self) -> None:
        if self.mgr is None:
            return
        assert self.foreign_unchanged()
        expected = self.FOREIGN_NAMES | step_folders(self.saved) | self.LOCK
        if self.superseded:
            expected.add("superseded")
            names = self.entries("superseded")
            assert len(names) == self.superseded
            assert self.superseded_names <= names  # superseded/ only grows
            self.superseded_names = names
        assert self.entries() == expected

    def teardown(self) -> None:
        if self.mgr is not None:
            try:
                assert_restores(self.mgr)
            finally:
                self.mgr.close()


class S3RetentionMachine(RetentionMachine):
    """The same machine on an ``s3://`` prefix of the loopback server, with foreign objects
    under it (tests/_roots.py); entries are read from the store itself."""

    server: ClassVar[RootUnderTest]  # the test's prefix; each run gets a prefix under it

    def prepare(self) -> None:
        assert self.server.url is not None
        assert self.server.storage_options is not None
        self.target = RootUnderTest(
            "s3",
            self.run / "mirror",
            self.run,
            url=f"{self.server.url}/{self.run.name}",
            storage_options={**self.server.storage_options, "cache_dir": str(self.run / "mirror")},
        )
        self.target.put_foreign_objects()

    def open_manager(self, options: CheckpointManagerOptions) -> CheckpointManager:
        assert self.target.url is not None
        return CheckpointManager(
            self.target.url,
            options=options,
            clock=self.clock,
            storage_options=self.target.storage_options,
        )

    def entries(self, under: str = "") -> set[str]:
        return self.target.entries(under)

    def foreign_unchanged(self) -> bool:
        return self.target.foreign_objects_unchanged()

    FOREIGN_NAMES: ClassVar[set[str]] = {rel.split("/")[0] for rel in FOREIGN_OBJECTS}
    LOCK: ClassVar[set[str]] = {".orbit-lease"}  # held while the manager is open


def run_machine(
    base: Path,
    monkeypatch: pytest.MonkeyPatch,
    machine: type[RetentionMachine] = RetentionMachine,
    **overrides: Any,
) -> None:
    # fsync changes nothing a process can observe; durability is what the crash tests check.
    # Skipping it keeps hundreds of saves per example fast on a shared disk.
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    counter = itertools.count()

    class Machine(machine):  # type: ignore[valid-type,misc]
        def __init__(self) -> None:
            super().__init__(base, counter)

    run_state_machine_as_test(Machine, settings=settings(settings.default, **overrides))


def test_manager_matches_the_reference_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_machine(tmp_path, monkeypatch, max_examples=60, stateful_step_count=25)


def test_manager_matches_the_reference_model_on_s3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_root: Any
) -> None:
    """Fewer and shorter runs than on a local root: every save is a few requests to moto."""
    S3RetentionMachine.server = RootUnderTest(
        "s3", tmp_path, tmp_path, url=s3_root.url, storage_options=s3_root.storage_options
    )
    run_machine(tmp_path, monkeypatch, S3RetentionMachine, max_examples=8, stateful_step_count=15)


@pytest.mark.slow
def test_manager_matches_the_reference_model_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_machine(tmp_path, monkeypatch, max_examples=400, stateful_step_count=60)


# ------------------------------------------------------------------- a crash during retention


@pytest.mark.parametrize(
    ("point", "nth"),
    [
        ("before-rename", 2),
        ("after-rename", 2),
        ("mid-rmtree", 2),
        ("mid-rmtree", 4),
    ],
)
def test_crash_during_retention(tmp_path: Path, point: str, nth: int) -> None:
    root = tmp_path / "ckpt"
    child = subprocess.run(
        [sys.executable, str(WORKER), str(root), point, str(nth)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 86, child.stderr  # it died at the crash point
    # Retention was deleting 0, 1, 2, 3 in that order (keep_last_n=1 after saving 4) and died
    # at deletion number nth, i.e. of step nth - 1.
    crashed = nth - 1
    half_deleted = point != "before-rename"
    expected = [s for s in range(crashed, 4) if not (half_deleted and s == crashed)] + [4]
    leftover = root / f"step_{crashed:08d}.orbit-deleting"
    assert leftover.is_dir() == half_deleted

    # A reader that cleans nothing already never lists the half-deleted step. (The files of
    # deleted steps are removed on a thread of their own: by the time that thread died in
    # step nth - 1's files, retention may have taken later steps out too -- a suffix remains.)
    with open_manager(root, read_only=True) as reader:
        listed = reader.all_steps()
        if point == "mid-rmtree":
            assert listed == expected[len(expected) - len(listed) :], (listed, expected)
            assert listed[-1] == 4
        else:
            assert listed == expected
        assert_restores(reader)
    assert leftover.is_dir() == half_deleted

    # A writer cleans the leftover when it opens; every listed step restores.
    with open_manager(root, keep_last_n=1) as mgr:
        assert not leftover.exists()
        assert mgr.all_steps() == listed
        assert mgr.latest_step() == 4
        assert_restores(mgr)
        mgr.save(5, item(5))  # retention carries on where it stopped
        assert mgr.all_steps() == [5]
    assert entries(root) == {"step_00000005", ".orbit.lock"}


def test_a_failed_retention_delete_does_not_fail_the_committed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import os

    from orbit_pt._storage import store as _commit

    mgr = CheckpointManager(tmp_path, options=CheckpointManagerOptions(keep_last_n=1))
    mgr.save(0, {"x": {"v": 0}})
    real_replace = os.replace

    def refuse_deletion(src: object, dst: object) -> None:
        if str(dst).endswith(".orbit-deleting"):
            raise PermissionError(f"cannot rename {src}")
        real_replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(_commit.os, "replace", refuse_deletion)  # type: ignore[attr-defined]
    with caplog.at_level(logging.ERROR):
        assert mgr.save(1, {"x": {"v": 1}})  # committed, even though step 0 stays
    assert mgr.all_steps() == [0, 1]
    assert any("retry after the next save" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(_commit.os, "replace", real_replace)  # type: ignore[attr-defined]
    mgr.save(2, {"x": {"v": 2}})
    assert mgr.all_steps() == [2]  # retried and done
    mgr.close()
