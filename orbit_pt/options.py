"""``CheckpointManagerOptions``: when to save, what to keep, and how."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from orbit_pt import policies as p
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError


@dataclass(frozen=True, kw_only=True)
class CheckpointManagerOptions:
    """Options of a :class:`~orbit_pt.CheckpointManager`.

    Attributes:
        save_interval_steps: ``should_save(step)`` is True when ``step % save_interval_steps == 0``.
            When no save rule is configured at all (this, ``save_on_steps`` and ``save_policy``
            all None), every step is a save step.
        save_on_steps: extra steps to save on, whatever the interval.
        save_policy: a custom :class:`~orbit_pt.policies.SavePolicy`; combined (any-of) with the
            two options above. A policy of the same kind as an option is an error: drop one.
        keep_last_n: keep the n newest committed steps.
        keep_every_k_steps: keep every committed step divisible by k.
        keep_best_n: keep the n best steps by ``best_metric`` (``best_mode`` "min" or "max").
        best_metric: the metric (a key of ``save(..., metrics=)``) that ranks steps; also what
            ``best_step()`` uses.
        best_mode: "min" (a loss) or "max" (an accuracy).
        keep_time_interval: keep one step per this many seconds of wall time.
        retention: custom :class:`~orbit_pt.policies.RetentionPolicy` objects, combined (any-of)
            with the options above. With no retention rule at all, every step is kept. The latest
            committed step is always kept.
        async_save: ``save()`` returns after staging; writing and commit run in the background.
        read_only: open the root for reading only (an evaluator beside a training job): no lock,
            no clean-up, and ``save``/``delete`` raise.
        preemption_signals: signals that mark the job as preempted (see ``reached_preemption``).
    """

    save_interval_steps: int | None = None
    save_on_steps: Sequence[int] | None = None
    save_policy: p.SavePolicy | None = None
    keep_last_n: int | None = None
    keep_every_k_steps: int | None = None
    keep_best_n: int | None = None
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"
    keep_time_interval: float | None = None
    retention: p.RetentionPolicy | Sequence[p.RetentionPolicy] | None = None
    async_save: bool = False
    read_only: bool = False
    preemption_signals: Sequence[signal.Signals] = ()

    def __post_init__(self) -> None:
        if self.keep_best_n is not None and self.best_metric is None:
            raise CheckpointValueError(
                f"keep_best_n={self.keep_best_n} needs best_metric, the name of the metric to "
                "rank steps by (a key of save(..., metrics=))"
            )
        if self.best_mode not in ("min", "max"):
            raise CheckpointValueError(
                f"best_mode must be 'min' or 'max', got {self.best_mode!r}; use 'min' for a "
                "loss and 'max' for an accuracy"
            )
        for name in ("async_save", "read_only"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointTypeError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        # Building the policies validates every value and catches option/policy clashes early.
        self.retention_policy()
        self.save_policy_object()

    def retention_policy(self) -> p.RetentionPolicy | None:
        """The combined retention policy, or None to keep every step."""
        built: list[tuple[str, p.RetentionPolicy]] = []
        if self.keep_last_n is not None:
            built.append(("keep_last_n", p.KeepLastN(self.keep_last_n)))
        if self.keep_every_k_steps is not None:
            built.append(("keep_every_k_steps", p.KeepEveryKSteps(self.keep_every_k_steps)))
        if self.keep_best_n is not None:
            assert self.best_metric is not None  # checked in __post_init__
            built.append(
                ("keep_best_n", p.KeepBestN(self.keep_best_n, self.best_metric, self.best_mode))
            )
        if self.keep_time_interval is not None:
            built.append(("keep_time_interval", p.KeepTimeInterval(self.keep_time_interval)))
        custom = self._custom_retention()
        leaves = [leaf for c in custom for leaf in p.flatten_retention(c)]
        for option, policy in built:
            for leaf in leaves:
                if type(leaf) is type(policy):
                    raise CheckpointValueError(
                        f"both {option}= and a {type(leaf).__name__} in retention= were given; "
                        f"drop {option}= or remove the {type(leaf).__name__} from retention="
                    )
        policies = [policy for _, policy in built] + custom
        if not policies:
            return None
        return policies[0] if len(policies) == 1 else p.AnyOf(*policies)

    def best_policy(self) -> p.KeepBestN | None:
        """The policy that ranks steps for ``best_step()``: by ``best_metric``, if set."""
        if self.best_metric is None:
            return None
        return p.KeepBestN(self.keep_best_n or 1, self.best_metric, self.best_mode)

    def save_policy_object(self) -> p.SavePolicy:
        """The combined save policy (preemption is added by the manager)."""
        built: list[tuple[str, p.SavePolicy]] = []
        if self.save_interval_steps is not None:
            built.append(("save_interval_steps", p.EveryNSteps(self.save_interval_steps)))
        if self.save_on_steps is not None:
            built.append(("save_on_steps", p.OnSteps(self.save_on_steps)))
        custom: list[p.SavePolicy] = []
        if self.save_policy is not None:
            if not isinstance(self.save_policy, p.SavePolicy):
                raise CheckpointTypeError(
                    "save_policy must be a SavePolicy (an object with should_save(step, *, "
                    f"preempted)), got {self.save_policy!r}"
                )
            custom = [self.save_policy]
            leaves = p.flatten_save(self.save_policy)
            for option, policy in built:
                for leaf in leaves:
                    if type(leaf) is type(policy):
                        raise CheckpointValueError(
                            f"both {option}= and a {type(leaf).__name__} in save_policy= were "
                            f"given; drop {option}= or remove the {type(leaf).__name__}"
                        )
        policies = [policy for _, policy in built] + custom
        if not policies:
            return p.EveryNSteps(1)
        return policies[0] if len(policies) == 1 else p.AnySavePolicy(*policies)

    def _custom_retention(self) -> list[p.RetentionPolicy]:
        if self.retention is None:
            return []
        given = (
            [self.retention]
            if isinstance(self.retention, p.RetentionPolicy)
            else list(self.retention)
        )
        for policy in given:
            if not isinstance(policy, p.RetentionPolicy):
                raise CheckpointTypeError(
                    "retention must be a RetentionPolicy (an object with keep(checkpoints)) or a "
                    f"sequence of them, got {policy!r}"
                )
        return given
