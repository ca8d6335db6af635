"""Retention and save policies in isolation, and the options that build them.

Tables of expected outcomes: each row is (checkpoints, expected kept steps). Policies are pure,
so no folder, clock or manager is involved here; tests/test_retention.py runs them through a
real manager.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orbit_pt import CheckpointInfo, CheckpointManagerOptions
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError
from orbit_pt.policies import (
    AnyOf,
    AnySavePolicy,
    EveryNSteps,
    KeepBestN,
    KeepEveryKSteps,
    KeepLastN,
    KeepSteps,
    KeepTimeInterval,
    OnPreemption,
    OnSteps,
    RetentionPolicy,
    SavePolicy,
    flatten_retention,
    flatten_save,
)


def infos(*steps: int) -> list[CheckpointInfo]:
    """Checkpoints at ``steps``, committed one second apart from t=0."""
    return [CheckpointInfo(step=s, time=float(i)) for i, s in enumerate(steps)]


def with_metric(
    rows: Sequence[tuple[int, float | None]], metric: str = "loss"
) -> list[CheckpointInfo]:
    """Checkpoints ``(step, value)``; a value of None means saved without the metric."""
    return [
        CheckpointInfo(step=s, time=float(s), metrics={} if v is None else {metric: v})
        for s, v in rows
    ]


def timed(rows: Sequence[tuple[int, float]]) -> list[CheckpointInfo]:
    """Checkpoints ``(step, commit time)``."""
    return [CheckpointInfo(step=s, time=t) for s, t in rows]


# ------------------------------------------------------------------------------------ KeepLastN


@pytest.mark.parametrize(
    ("n", "steps", "kept"),
    [
        (1, [], set()),
        (1, [0], {0}),
        (1, [0, 1, 2], {2}),
        (2, [0, 1, 2, 3, 4], {3, 4}),
        (3, [0, 1], {0, 1}),
        (2, [10, 200, 3000], {200, 3000}),
        (2, [4, 0, 3, 1], {3, 4}),  # by step, whatever the order given
        (5, [0, 1, 2, 3, 4], {0, 1, 2, 3, 4}),
    ],
)
def test_keep_last_n(n: int, steps: list[int], kept: set[int]) -> None:
    assert KeepLastN(n).keep(infos(*steps)) == kept


def test_keep_last_n_orders_by_step_not_by_time() -> None:
    # HF Trainer's save_total_limit sorted by mtime and deleted the step it had just written.
    checkpoints = timed([(100, 50.0), (200, 10.0), (300, 5.0)])
    assert KeepLastN(2).keep(checkpoints) == {200, 300}


# ------------------------------------------------------------------------------ KeepEveryKSteps


@pytest.mark.parametrize(
    ("k", "steps", "kept"),
    [
        (1, [0, 1, 2], {0, 1, 2}),
        (4, list(range(11)), {0, 4, 8}),
        (5, list(range(13)), {0, 5, 10}),
        (5, [1, 2, 3], set()),
        (1000, [0, 500, 1000, 1500, 2000], {0, 1000, 2000}),
        (3, [], set()),
    ],
)
def test_keep_every_k_steps(k: int, steps: list[int], kept: set[int]) -> None:
    assert KeepEveryKSteps(k).keep(infos(*steps)) == kept


# ------------------------------------------------------------------------------------ KeepBestN


@pytest.mark.parametrize(
    ("n", "mode", "rows", "kept"),
    [
        # min: lower is better
        (1, "min", [(0, 3.0), (1, 1.0), (2, 2.0)], {1}),
        (2, "min", [(0, 3.0), (1, 1.0), (2, 2.0)], {1, 2}),
        (5, "min", [(0, 3.0), (1, 1.0)], {0, 1}),
        # max: higher is better
        (1, "max", [(0, 3.0), (1, 1.0), (2, 2.0)], {0}),
        (2, "max", [(0, 3.0), (1, 1.0), (2, 2.0)], {0, 2}),
        # ties go to the newer step
        (1, "min", [(0, 1.0), (1, 1.0), (2, 1.0)], {2}),
        (2, "min", [(0, 1.0), (1, 1.0), (2, 5.0)], {0, 1}),
        (2, "max", [(0, 2.0), (1, 2.0), (2, 2.0), (3, 1.0)], {1, 2}),
        (1, "max", [(0, 7.0), (5, 7.0), (9, 3.0)], {5}),
        # steps without the metric cannot be ranked: kept
        (1, "min", [(0, None), (1, 2.0), (2, 1.0)], {0, 2}),
        (1, "min", [(0, None), (1, None)], {0, 1}),
        (1, "max", [(0, 1.0), (1, None), (2, 0.5), (3, None)], {0, 1, 3}),
        (2, "min", [(0, -1.0), (1, -3.0), (2, 0.0), (3, -2.0)], {1, 3}),
        (1, "min", [], set()),
    ],
)
def test_keep_best_n(
    n: int, mode: Any, rows: list[tuple[int, float | None]], kept: set[int]
) -> None:
    assert KeepBestN(n, "loss", mode).keep(with_metric(rows)) == kept


def test_keep_best_n_ignores_other_metrics() -> None:
    checkpoints = [
        CheckpointInfo(0, 0.0, {"acc": 0.9}),
        CheckpointInfo(1, 1.0, {"loss": 2.0, "acc": 0.1}),
        CheckpointInfo(2, 2.0, {"loss": 1.0}),
    ]
    # step 0 has no "loss": unranked, kept; among 1 and 2, the lower loss wins.
    assert KeepBestN(1, "loss").keep(checkpoints) == {0, 2}
    assert KeepBestN(1, "acc", "max").keep(checkpoints) == {0, 2}


def test_ranked_is_best_first_with_newer_first_on_ties() -> None:
    policy = KeepBestN(1, "loss", "min")
    rows = [(0, 2.0), (1, 1.0), (2, None), (3, 1.0), (4, 3.0)]
    assert [c.step for c in policy.ranked(with_metric(rows))] == [3, 1, 0, 4]
    assert [c.step for c in KeepBestN(1, "loss", "max").ranked(with_metric(rows))] == [4, 0, 3, 1]


# ----------------------------------------------------------------------------- KeepTimeInterval


@pytest.mark.parametrize(
    ("seconds", "rows", "kept"),
    [
        (10.0, [], set()),
        (10.0, [(0, 0.0)], {0}),
        # the first step, then each step at least 10 s after the last kept one
        (10.0, [(s, float(s)) for s in range(25)], {0, 10, 20}),
        (10.0, [(0, 0.0), (1, 9.0), (2, 18.0), (3, 27.0)], {0, 2}),  # 18 - 0 >= 10; 27 - 18 < 10
        (10.0, [(0, 0.0), (1, 10.0), (2, 20.0)], {0, 1, 2}),  # exactly the interval counts
        (5.0, [(0, 100.0), (1, 101.0), (2, 104.9), (3, 105.0), (4, 200.0)], {0, 3, 4}),
        (1, [(0, 0.0), (1, 0.5), (2, 1.0)], {0, 2}),  # int seconds work
        (3600.0, [(0, 0.0), (1000, 1800.0), (2000, 3599.0), (3000, 3600.0)], {0, 3000}),
    ],
)
def test_keep_time_interval(seconds: float, rows: list[tuple[int, float]], kept: set[int]) -> None:
    assert KeepTimeInterval(seconds).keep(timed(rows)) == kept


def test_keep_time_interval_is_stable_when_unkept_steps_disappear() -> None:
    rows = [(0, 0.0), (1, 4.0), (2, 8.0), (3, 12.0), (4, 16.0), (5, 20.0)]
    policy = KeepTimeInterval(10.0)
    kept = policy.keep(timed(rows))
    assert kept == {0, 3}
    remaining = [r for r in rows if r[0] in kept or r[0] == 5]
    assert policy.keep(timed(remaining)) == {0, 3}


# ------------------------------------------------------------------------------------ KeepSteps


@pytest.mark.parametrize(
    ("listed", "steps", "kept"),
    [
        ([], [0, 1, 2], set()),
        ([1], [0, 1, 2], {1}),
        ([1, 7], [0, 1, 2], {1}),  # 7 does not exist: nothing to keep
        ((s for s in (0, 2)), [0, 1, 2], {0, 2}),  # any iterable
        (range(0, 100, 50), [0, 25, 50, 75], {0, 50}),
    ],
)
def test_keep_steps(listed: Any, steps: list[int], kept: set[int]) -> None:
    assert KeepSteps(listed).keep(infos(*steps)) == kept


# ---------------------------------------------------------------------------------------- AnyOf


@pytest.mark.parametrize(
    ("policy", "steps", "kept"),
    [
        (AnyOf(KeepLastN(2)), range(5), {3, 4}),
        (AnyOf(KeepLastN(2), KeepEveryKSteps(4)), range(11), {0, 4, 8, 9, 10}),
        (AnyOf(KeepLastN(1), KeepSteps([3])), range(6), {3, 5}),
        (
            AnyOf(AnyOf(KeepLastN(1)), AnyOf(KeepEveryKSteps(3), KeepSteps([1]))),
            range(8),
            {0, 1, 3, 6, 7},
        ),
        (AnyOf(AnyOf(AnyOf(KeepSteps([2])))), range(4), {2}),
        (AnyOf(KeepLastN(3), KeepLastN(1)), range(5), {2, 3, 4}),
    ],
)
def test_any_of_is_the_union(policy: AnyOf, steps: range, kept: set[int]) -> None:
    assert policy.keep(infos(*steps)) == kept


def test_any_of_combines_metrics_and_time() -> None:
    checkpoints = [
        CheckpointInfo(0, 0.0, {"loss": 5.0}),
        CheckpointInfo(1, 3.0, {"loss": 1.0}),
        CheckpointInfo(2, 6.0, {"loss": 4.0}),
        CheckpointInfo(3, 9.0, {"loss": 3.0}),
        CheckpointInfo(4, 12.0, {"loss": 2.0}),
    ]
    policy = AnyOf(KeepBestN(1, "loss"), KeepTimeInterval(10.0), KeepLastN(1))
    assert policy.keep(checkpoints) == {0, 1, 4}


def test_any_of_accepts_custom_policies_returning_any_iterable() -> None:
    class OddSteps:
        def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
            return {c.step for c in checkpoints if c.step % 2}

    class AsList:
        def keep(self, checkpoints: Sequence[CheckpointInfo]) -> Any:
            return [checkpoints[0].step] if checkpoints else []

    assert AnyOf(OddSteps(), AsList()).keep(infos(*range(6))) == {0, 1, 3, 5}


def test_flatten() -> None:
    a, b, c = KeepLastN(1), KeepEveryKSteps(2), KeepSteps([1])
    assert flatten_retention(AnyOf(a, AnyOf(b, AnyOf(c)))) == [a, b, c]
    assert flatten_retention(a) == [a]
    e, o, pre = EveryNSteps(2), OnSteps([3]), OnPreemption()
    assert flatten_save(AnySavePolicy(e, AnySavePolicy(o, pre))) == [e, o, pre]
    assert flatten_save(e) == [e]


def test_policies_are_frozen_and_comparable() -> None:
    assert KeepLastN(2) == KeepLastN(2)
    assert KeepSteps([1, 2, 2]) == KeepSteps({2, 1})
    assert AnyOf(KeepLastN(1), KeepSteps([3])) == AnyOf(KeepLastN(1), KeepSteps([3]))
    assert OnSteps([5]) == OnSteps((5,))
    policy = KeepLastN(2)
    with pytest.raises(AttributeError):
        policy.n = 3  # type: ignore[misc]
    for obj in (KeepLastN(1), KeepEveryKSteps(1), KeepBestN(1, "loss"), KeepTimeInterval(1.0)):
        assert isinstance(obj, RetentionPolicy)
    for obj2 in (EveryNSteps(1), OnSteps([1]), OnPreemption(), AnySavePolicy(OnPreemption())):
        assert isinstance(obj2, SavePolicy)


# -------------------------------------------------------------------------------- save policies


@pytest.mark.parametrize(
    ("policy", "preempted", "save_steps"),
    [
        (EveryNSteps(1), False, set(range(20))),
        (EveryNSteps(5), False, {0, 5, 10, 15}),  # step 0 only because 0 % 5 == 0
        (EveryNSteps(7), False, {0, 7, 14}),
        (EveryNSteps(5), True, {0, 5, 10, 15}),  # an interval ignores preemption
        (OnSteps([3, 11, 100]), False, {3, 11}),
        (OnSteps([]), False, set()),
        (OnPreemption(), False, set()),
        (OnPreemption(), True, set(range(20))),
        (AnySavePolicy(EveryNSteps(10), OnSteps([3])), False, {0, 3, 10}),
        (AnySavePolicy(EveryNSteps(10), OnPreemption()), False, {0, 10}),
        (AnySavePolicy(EveryNSteps(10), OnPreemption()), True, set(range(20))),
        (
            AnySavePolicy(AnySavePolicy(OnSteps([1])), AnySavePolicy(EveryNSteps(6))),
            False,
            {0, 1, 6, 12, 18},
        ),
    ],
)
def test_save_policies(policy: SavePolicy, preempted: bool, save_steps: set[int]) -> None:
    got = {s for s in range(20) if policy.should_save(s, preempted=preempted)}
    assert got == save_steps


def test_preempted_defaults_to_false() -> None:
    assert not OnPreemption().should_save(3)
    assert EveryNSteps(3).should_save(3)


# ----------------------------------------------------------------------------- policy validation


@pytest.mark.parametrize(
    ("policy", "args", "error", "words"),
    [
        (KeepLastN, (0,), CheckpointValueError, ["keep_last_n", "0", "None"]),
        (KeepLastN, (-2,), CheckpointValueError, ["keep_last_n", "-2"]),
        (KeepLastN, (True,), CheckpointTypeError, ["keep_last_n", "True", "bool"]),
        (KeepLastN, (2.0,), CheckpointTypeError, ["keep_last_n", "2.0"]),
        (KeepEveryKSteps, (0,), CheckpointValueError, ["keep_every_k_steps", "0"]),
        (KeepEveryKSteps, (False,), CheckpointTypeError, ["keep_every_k_steps", "False"]),
        (KeepBestN, (0, "loss"), CheckpointValueError, ["keep_best_n", "0"]),
        (KeepBestN, (1, ""), CheckpointValueError, ["best_metric"]),
        (KeepBestN, (1, 3), CheckpointTypeError, ["best_metric", "3"]),
        (KeepBestN, (1, "loss", "lowest"), CheckpointValueError, ["best_mode", "lowest"]),
        (KeepTimeInterval, (0,), CheckpointValueError, ["keep_time_interval", "0"]),
        (KeepTimeInterval, (-1.0,), CheckpointValueError, ["keep_time_interval", "-1.0"]),
        (KeepTimeInterval, (float("inf"),), CheckpointValueError, ["keep_time_interval"]),
        (KeepTimeInterval, (float("nan"),), CheckpointValueError, ["keep_time_interval"]),
        (KeepTimeInterval, ("1h",), CheckpointTypeError, ["keep_time_interval", "'1h'"]),
        (KeepTimeInterval, (True,), CheckpointTypeError, ["keep_time_interval"]),
        (KeepSteps, ([1, -1],), CheckpointValueError, ["KeepSteps", "-1"]),
        (KeepSteps, ([1.5],), CheckpointValueError, ["KeepSteps", "1.5"]),
        (KeepSteps, ("12",), CheckpointTypeError, ["KeepSteps", "'12'"]),
        (KeepSteps, (5,), CheckpointTypeError, ["KeepSteps", "5"]),
        (AnyOf, (), CheckpointValueError, ["AnyOf", "retention=None"]),
        (AnyOf, (KeepLastN(1), 3), CheckpointTypeError, ["AnyOf", "3"]),
        (AnyOf, (EveryNSteps(2),), CheckpointTypeError, ["AnyOf", "EveryNSteps"]),
        (EveryNSteps, (0,), CheckpointValueError, ["save_interval_steps", "0"]),
        (EveryNSteps, (True,), CheckpointTypeError, ["save_interval_steps", "True"]),
        (OnSteps, ([True],), CheckpointValueError, ["save_on_steps", "True"]),
        (AnySavePolicy, (), CheckpointValueError, ["AnySavePolicy", "save_policy=None"]),
        (AnySavePolicy, (KeepLastN(1),), CheckpointTypeError, ["AnySavePolicy", "KeepLastN"]),
    ],
)
def test_policy_validation(
    policy: Callable[..., object], args: tuple[Any, ...], error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as info:
        policy(*args)
    for word in words:
        assert word in str(info.value)


# ----------------------------------------------------------------------------------- the options


def _retention(**kwargs: Any) -> RetentionPolicy | None:
    return CheckpointManagerOptions(**kwargs).retention_policy()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, None),
        ({"best_metric": "loss"}, None),  # best_step() ranks, retention keeps everything
        ({"keep_last_n": 2}, KeepLastN(2)),
        ({"keep_every_k_steps": 4}, KeepEveryKSteps(4)),
        ({"keep_best_n": 2, "best_metric": "acc", "best_mode": "max"}, KeepBestN(2, "acc", "max")),
        ({"keep_time_interval": 60.0}, KeepTimeInterval(60.0)),
        ({"keep_time_interval": datetime.timedelta(hours=1)}, KeepTimeInterval(3600.0)),
        ({"keep_last_n": 2, "keep_every_k_steps": 4}, AnyOf(KeepLastN(2), KeepEveryKSteps(4))),
        ({"retention": KeepSteps([5])}, KeepSteps([5])),
        ({"retention": [KeepSteps([5])]}, KeepSteps([5])),
        ({"retention": []}, None),
        (
            {"keep_last_n": 1, "retention": [KeepSteps([5]), KeepBestN(1, "loss")]},
            AnyOf(KeepLastN(1), KeepSteps([5]), KeepBestN(1, "loss")),
        ),
    ],
)
def test_options_build_retention(kwargs: dict[str, Any], expected: object) -> None:
    assert _retention(**kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "save_steps"),
    [
        ({}, set(range(13))),  # no save rule: every step
        ({"save_interval_steps": 5}, {0, 5, 10}),
        ({"save_on_steps": [3, 7]}, {3, 7}),
        ({"save_on_steps": ()}, set()),
        ({"save_interval_steps": 5, "save_on_steps": {3, 7}}, {0, 3, 5, 7, 10}),
        ({"save_policy": OnSteps([2])}, {2}),
        ({"save_policy": OnPreemption()}, set()),
        ({"save_interval_steps": 6, "save_policy": OnSteps([1])}, {0, 1, 6, 12}),
    ],
)
def test_options_build_save_policy(kwargs: dict[str, Any], save_steps: set[int]) -> None:
    policy = CheckpointManagerOptions(**kwargs).save_policy_object()
    assert {s for s in range(13) if policy.should_save(s)} == save_steps
    # a preemption agreed by every rank is always a save step, whatever the rules
    assert all(policy.should_save(s, preempted=True) for s in range(13))


def test_options_best_policy_and_ranking_policies() -> None:
    assert CheckpointManagerOptions().best_policy() is None
    assert CheckpointManagerOptions().ranking_policies() == []
    only_metric = CheckpointManagerOptions(best_metric="acc", best_mode="max")
    assert only_metric.best_policy() == KeepBestN(1, "acc", "max")
    assert only_metric.ranking_policies() == []  # ranks for best_step(), never deletes
    both = CheckpointManagerOptions(keep_best_n=3, best_metric="loss")
    assert both.best_policy() == KeepBestN(3, "loss", "min")
    assert both.ranking_policies() == [KeepBestN(3, "loss", "min")]
    custom = CheckpointManagerOptions(retention=AnyOf(KeepLastN(1), KeepBestN(2, "acc", "max")))
    assert custom.best_policy() == KeepBestN(2, "acc", "max")
    assert custom.ranking_policies() == [KeepBestN(2, "acc", "max")]


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"keep_last_n": 0}, CheckpointValueError, ["keep_last_n", "0"]),
        ({"keep_last_n": -1}, CheckpointValueError, ["keep_last_n", "-1"]),
        ({"keep_last_n": True}, CheckpointTypeError, ["keep_last_n", "True"]),
        ({"keep_every_k_steps": 0}, CheckpointValueError, ["keep_every_k_steps", "0"]),
        ({"keep_every_k_steps": -5}, CheckpointValueError, ["keep_every_k_steps", "-5"]),
        ({"keep_every_k_steps": False}, CheckpointTypeError, ["keep_every_k_steps", "False"]),
        (
            {"keep_best_n": 0, "best_metric": "loss"},
            CheckpointValueError,
            ["keep_best_n", "0"],
        ),
        ({"keep_best_n": True, "best_metric": "loss"}, CheckpointTypeError, ["keep_best_n"]),
        ({"keep_best_n": 2}, CheckpointValueError, ["keep_best_n=2", "best_metric"]),
        ({"best_mode": "median"}, CheckpointValueError, ["best_mode", "'median'"]),
        (
            {"keep_best_n": 1, "best_metric": "loss", "best_mode": "MIN"},
            CheckpointValueError,
            ["best_mode", "'MIN'"],
        ),
        ({"best_metric": 7}, CheckpointTypeError, ["best_metric", "7"]),
        ({"best_metric": ""}, CheckpointValueError, ["best_metric"]),
        ({"keep_time_interval": 0}, CheckpointValueError, ["keep_time_interval"]),
        (
            {"keep_time_interval": datetime.timedelta(0)},
            CheckpointValueError,
            ["keep_time_interval"],
        ),
        ({"save_interval_steps": 0}, CheckpointValueError, ["save_interval_steps", "0"]),
        ({"save_interval_steps": -3}, CheckpointValueError, ["save_interval_steps", "-3"]),
        ({"save_interval_steps": True}, CheckpointTypeError, ["save_interval_steps", "True"]),
        ({"save_on_steps": [1, -2]}, CheckpointValueError, ["save_on_steps", "-2"]),
        ({"save_on_steps": 5}, CheckpointTypeError, ["save_on_steps", "5"]),
        ({"save_on_steps": iter([1, 2])}, CheckpointTypeError, ["save_on_steps", "list"]),
        ({"save_on_steps": "10"}, CheckpointTypeError, ["save_on_steps"]),
        # custom policies that are not policies
        ({"retention": 3}, CheckpointTypeError, ["retention", "3"]),
        ({"retention": [KeepLastN(1), "last"]}, CheckpointTypeError, ["retention", "'last'"]),
        ({"retention": EveryNSteps(2)}, CheckpointTypeError, ["retention", "EveryNSteps"]),
        ({"retention": (p for p in [KeepLastN(1)])}, CheckpointTypeError, ["retention"]),
        ({"save_policy": KeepLastN(1)}, CheckpointTypeError, ["save_policy", "KeepLastN"]),
        ({"save_policy": [EveryNSteps(2)]}, CheckpointTypeError, ["save_policy"]),
        ({"save_policy": lambda step: True}, CheckpointTypeError, ["save_policy"]),
    ],
)
def test_option_validation(
    kwargs: dict[str, Any], error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as info:
        CheckpointManagerOptions(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_option_errors_are_builtin_errors_too() -> None:
    with pytest.raises(ValueError, match="keep_last_n"):
        CheckpointManagerOptions(keep_last_n=0)
    with pytest.raises(TypeError, match="retention"):
        CheckpointManagerOptions(retention=object())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "drop"),
    [
        ({"keep_last_n": 2, "retention": KeepLastN(3)}, ("keep_last_n=", "KeepLastN")),
        (
            {"keep_every_k_steps": 4, "retention": [KeepSteps([1]), KeepEveryKSteps(5)]},
            ("keep_every_k_steps=", "KeepEveryKSteps"),
        ),
        (
            {"keep_best_n": 1, "best_metric": "loss", "retention": AnyOf(KeepBestN(2, "acc"))},
            ("keep_best_n=", "KeepBestN"),
        ),
        (
            {"keep_time_interval": 60, "retention": AnyOf(KeepLastN(1), KeepTimeInterval(5))},
            ("keep_time_interval=", "KeepTimeInterval"),
        ),
        (
            # nested AnyOf: the clash is found at any depth
            {"keep_last_n": 1, "retention": AnyOf(KeepSteps([1]), AnyOf(AnyOf(KeepLastN(4))))},
            ("keep_last_n=", "KeepLastN"),
        ),
        (
            {"save_interval_steps": 10, "save_policy": EveryNSteps(5)},
            ("save_interval_steps=", "EveryNSteps"),
        ),
        (
            {"save_on_steps": [3], "save_policy": AnySavePolicy(OnPreemption(), OnSteps([4]))},
            ("save_on_steps=", "OnSteps"),
        ),
    ],
)
def test_option_and_policy_of_the_same_kind_is_an_error(
    kwargs: dict[str, Any], drop: tuple[str, str]
) -> None:
    option, policy = drop
    with pytest.raises(CheckpointValueError) as info:
        CheckpointManagerOptions(**kwargs)
    message = str(info.value)
    assert f"drop {option}" in message
    assert f"remove the {policy}" in message


def test_options_are_frozen_and_keyword_only() -> None:
    options = CheckpointManagerOptions(keep_last_n=2)
    with pytest.raises(AttributeError):
        options.keep_last_n = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        CheckpointManagerOptions(2)  # type: ignore[call-arg]
    # __post_init__ validates but never rewrites what was given
    steps = [5, 1]
    interval = datetime.timedelta(minutes=1)
    options = CheckpointManagerOptions(save_on_steps=steps, keep_time_interval=interval)
    assert options.save_on_steps is steps
    assert options.keep_time_interval is interval


# ------------------------------------------------------------------------- properties of policies


_checkpoint_lists = st.lists(
    st.tuples(
        st.integers(0, 60),
        st.floats(0, 100, allow_nan=False),
        st.one_of(st.none(), st.integers(0, 4).map(float)),
    ),
    max_size=20,
    unique_by=lambda row: row[0],
).map(
    lambda rows: [
        CheckpointInfo(s, t, {} if m is None else {"loss": m})
        for s, t, m in sorted(rows, key=lambda r: r[0])
    ]
)
_policies = st.one_of(
    st.integers(1, 4).map(KeepLastN),
    st.integers(1, 6).map(KeepEveryKSteps),
    st.builds(KeepBestN, st.integers(1, 3), st.just("loss"), st.sampled_from(["min", "max"])),
    st.floats(0.5, 40, allow_nan=False).map(KeepTimeInterval),
    st.sets(st.integers(0, 60), max_size=5).map(KeepSteps),
)
_combined = st.lists(_policies, min_size=1, max_size=4).map(lambda ps: AnyOf(*ps))


@given(policy=_combined, checkpoints=_checkpoint_lists)
def test_a_second_retention_pass_deletes_nothing(
    policy: AnyOf, checkpoints: list[CheckpointInfo]
) -> None:
    """Retention runs after every save; what one pass keeps, the next pass keeps again.

    Without this, deleting the steps a pass dropped could make the policy drop more (a
    cascade), and the kept set would depend on how often retention ran.
    """
    kept = policy.keep(checkpoints)
    if checkpoints:
        kept |= {checkpoints[-1].step}
    survivors = [c for c in checkpoints if c.step in kept]
    again = policy.keep(survivors)
    if survivors:
        again |= {survivors[-1].step}
    assert again == kept


@given(policy=_combined, checkpoints=_checkpoint_lists)
def test_any_of_keeps_only_existing_steps(policy: AnyOf, checkpoints: list[CheckpointInfo]) -> None:
    kept = policy.keep(checkpoints)
    assert kept <= {c.step for c in checkpoints}
    assert kept == set().union(*(p.keep(checkpoints) for p in policy.policies))
