"""Retention and save policies: pure objects over plain data.

A retention policy looks at the committed checkpoints and names the steps it wants kept; the
manager keeps the union of what every configured policy wants, plus the latest committed step,
always. A save policy says whether a step is a save step. Policies do no I/O and read no clock:
time arrives in :attr:`CheckpointInfo.time`, so they are easy to test and to reason about.

Write your own by implementing :class:`RetentionPolicy` or :class:`SavePolicy` and passing it
as ``CheckpointManagerOptions(retention=...)`` or ``CheckpointManagerOptions(save_policy=...)``
(see docs/retention.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar, runtime_checkable

from orbit_pt.errors import CheckpointTypeError, CheckpointValueError

T = TypeVar("T")

__all__ = [
    "AnyOf",
    "AnySavePolicy",
    "CheckpointInfo",
    "EveryNSteps",
    "KeepBestN",
    "KeepEveryKSteps",
    "KeepLastN",
    "KeepSteps",
    "KeepTimeInterval",
    "OnPreemption",
    "OnSteps",
    "RetentionPolicy",
    "SavePolicy",
    "flatten_retention",
    "flatten_save",
]


@dataclass(frozen=True)
class CheckpointInfo:
    """What a policy may know about one committed checkpoint.

    Attributes:
        step: the training step.
        time: commit time in seconds since the epoch (from the manager's clock).
        metrics: the metrics given to ``save(..., metrics=)`` for this step, read back from the
            step's metadata (so they survive restarts); empty when none were given.
    """

    step: int
    time: float
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class RetentionPolicy(Protocol):
    """Chooses which committed steps to keep.

    The manager calls :meth:`keep` after every committed save, with every committed step, and
    deletes the steps that no configured policy keeps -- except the latest, which is always kept.
    A policy must be pure: the same checkpoints give the same answer, with no I/O.
    """

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The steps to keep among ``checkpoints`` (sorted by ascending step)."""
        ...


@runtime_checkable
class SavePolicy(Protocol):
    """Decides whether a step is a save step."""

    def should_save(self, step: int, *, preempted: bool = False) -> bool:
        """Whether ``step`` should be saved; ``preempted`` is the agreed preemption flag."""
        ...


def _positive_int(value: object, name: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointTypeError(
            f"{name} must be an int >= 1, got {value!r} ({type(value).__name__}); {fix}"
        )
    if value < 1:
        raise CheckpointValueError(f"{name} must be >= 1, got {value}; {fix}")
    return value


# ---------------------------------------------------------------------------- retention policies


@dataclass(frozen=True)
class KeepLastN:
    """Keep the ``n`` newest steps (by step number, never by file time)."""

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "keep_last_n", "use None to keep every step")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The ``n`` largest steps."""
        return set(sorted(c.step for c in checkpoints)[-self.n :])


@dataclass(frozen=True)
class KeepEveryKSteps:
    """Keep every step divisible by ``k`` (0, k, 2k, ...)."""

    k: int

    def __post_init__(self) -> None:
        _positive_int(self.k, "keep_every_k_steps", "use None to turn this rule off")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The steps divisible by ``k``."""
        return {c.step for c in checkpoints if c.step % self.k == 0}


@dataclass(frozen=True)
class KeepBestN:
    """Keep the ``n`` best steps by ``metric``; steps saved without the metric are kept too.

    A step without the metric cannot be ranked, so deleting it would be a guess; it is kept and
    the manager logs that once. Ties go to the newer step.

    Attributes:
        n: how many ranked steps to keep.
        metric: the key of ``save(..., metrics=)`` to rank by.
        mode: ``"min"`` (lower is better: a loss) or ``"max"`` (higher is better: an accuracy).
    """

    n: int
    metric: str
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        _positive_int(self.n, "keep_best_n", "use None to turn best-n retention off")
        if not isinstance(self.metric, str):
            raise CheckpointTypeError(
                f"best_metric must be a string, the name of a metric passed to "
                f"save(metrics=...), got {self.metric!r} ({type(self.metric).__name__})"
            )
        if not self.metric:
            raise CheckpointValueError(
                "best_metric must be the name of a metric passed to save(metrics=...), got ''"
            )
        if self.mode not in ("min", "max"):
            raise CheckpointValueError(
                f"best_mode must be 'min' or 'max', got {self.mode!r}; use 'min' for a loss "
                "and 'max' for an accuracy"
            )

    def ranked(self, checkpoints: Sequence[CheckpointInfo]) -> list[CheckpointInfo]:
        """Checkpoints that carry the metric, best first (ties: newer step first)."""
        sign = 1.0 if self.mode == "min" else -1.0
        with_metric = [c for c in checkpoints if self.metric in c.metrics]
        return sorted(with_metric, key=lambda c: (sign * c.metrics[self.metric], -c.step))

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The ``n`` best ranked steps, plus every step without the metric."""
        unranked = {c.step for c in checkpoints if self.metric not in c.metrics}
        return unranked | {c.step for c in self.ranked(checkpoints)[: self.n]}


@dataclass(frozen=True)
class KeepTimeInterval:
    """Keep one step per ``seconds`` of wall time.

    Walking the steps in order, the first is kept, and then each step committed at least
    ``seconds`` after the last kept one. Only kept steps are reference points, so the decision
    for a step never changes when steps between them are deleted.
    """

    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)):
            raise CheckpointTypeError(
                f"keep_time_interval must be a number of seconds (or a datetime.timedelta), got "
                f"{self.seconds!r} ({type(self.seconds).__name__})"
            )
        if not math.isfinite(self.seconds) or self.seconds <= 0:
            raise CheckpointValueError(
                f"keep_time_interval must be a positive, finite number of seconds, got "
                f"{self.seconds!r}; use None to turn this rule off"
            )

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The first step, then each step at least ``seconds`` after the last one kept."""
        kept: set[int] = set()
        last: float | None = None
        for c in sorted(checkpoints, key=lambda c: c.step):
            if last is None or c.time >= last + self.seconds:
                kept.add(c.step)
                last = c.time
        return kept


@dataclass(frozen=True, init=False)
class KeepSteps:
    """Keep exactly the listed steps (when they exist), e.g. the end of each curriculum stage."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]) -> None:
        object.__setattr__(self, "steps", frozenset(_steps(steps, "KeepSteps(steps)")))

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """The listed steps that are committed."""
        return {c.step for c in checkpoints if c.step in self.steps}


@dataclass(frozen=True, init=False)
class AnyOf:
    """Keep a step when any of ``policies`` keeps it (the union). Nests freely."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        members = _union(
            policies,
            RetentionPolicy,
            "AnyOf",
            "retention policies (objects with keep(checkpoints))",
            "an empty union would keep only the latest step. Leave retention=None to keep every "
            "step",
        )
        object.__setattr__(self, "policies", members)

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        """Every step that at least one policy keeps."""
        kept: set[int] = set()
        for policy in self.policies:
            kept |= set(policy.keep(checkpoints))
        return kept


# --------------------------------------------------------------------------------- save policies


@dataclass(frozen=True)
class EveryNSteps:
    """Save when ``step % n == 0`` (step 0 included; there is no other "initial save" rule)."""

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "save_interval_steps", "use 1 to save every step")

    def should_save(self, step: int, *, preempted: bool = False) -> bool:
        """Whether ``step`` is a multiple of ``n``."""
        return step % self.n == 0


@dataclass(frozen=True, init=False)
class OnSteps:
    """Save on exactly the listed steps."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]) -> None:
        object.__setattr__(self, "steps", frozenset(_steps(steps, "save_on_steps")))

    def should_save(self, step: int, *, preempted: bool = False) -> bool:
        """Whether ``step`` is listed."""
        return step in self.steps


@dataclass(frozen=True)
class OnPreemption:
    """Save on the step at which every rank has agreed that the job is being preempted."""

    def should_save(self, step: int, *, preempted: bool = False) -> bool:
        """Whether the job is being preempted."""
        return preempted


@dataclass(frozen=True, init=False)
class AnySavePolicy:
    """Save when any of ``policies`` says so. Nests freely."""

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy) -> None:
        members = _union(
            policies,
            SavePolicy,
            "AnySavePolicy",
            "save policies (objects with should_save(step, *, preempted))",
            "an empty one would never save. Leave save_policy=None to save every step",
        )
        object.__setattr__(self, "policies", members)

    def should_save(self, step: int, *, preempted: bool = False) -> bool:
        """Whether at least one policy says so."""
        return any(p.should_save(step, preempted=preempted) for p in self.policies)


# ---------------------------------------------------------------------------------------- helpers


def _union(policies: tuple[T, ...], kind: type, name: str, what: str, empty: str) -> tuple[T, ...]:
    """The members of a union policy, checked: at least one, each of the right protocol."""
    if not policies:
        raise CheckpointValueError(f"{name}() needs at least one of its {what}; {empty}")
    for policy in policies:
        if not isinstance(policy, kind):
            raise CheckpointTypeError(
                f"{name} takes {what}, got {policy!r} ({type(policy).__name__})"
            )
    return policies


def _steps(steps: Iterable[int], name: str) -> list[int]:
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise CheckpointTypeError(
            f"{name} must be an iterable of steps, e.g. [1000, 5000], got {steps!r}"
        )
    out = list(steps)
    bad = [s for s in out if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad:
        raise CheckpointValueError(
            f"{name} must hold non-negative int steps, got {bad[:5]}; pass e.g. [1000, 5000]"
        )
    return out


def flatten_retention(policy: RetentionPolicy) -> list[RetentionPolicy]:
    """The leaf policies of a (possibly nested) :class:`AnyOf`."""
    if isinstance(policy, AnyOf):
        return [leaf for p in policy.policies for leaf in flatten_retention(p)]
    return [policy]


def flatten_save(policy: SavePolicy) -> list[SavePolicy]:
    """The leaf policies of a (possibly nested) :class:`AnySavePolicy`."""
    if isinstance(policy, AnySavePolicy):
        return [leaf for p in policy.policies for leaf in flatten_save(p)]
    return [policy]
