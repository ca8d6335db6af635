"""``CheckpointManagerOptions``: when to save, what to keep, and how."""

from __future__ import annotations

import datetime
import os
import signal
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from orbit_pt import policies as p
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError


@dataclass(frozen=True, kw_only=True)
class LocalTierOptions:
    """The node-local tier of a multi-tier manager: frequent saves to a fast node-local folder,
    each rank's shard copied to ``replicas`` other nodes (docs/multi-tier.md).

    Attributes:
        root: a folder on node-local storage (NVMe); the same path on every node is fine.
            Ranks that see the same folder (same host, device and inode) are one node.
        save_interval_steps: a local save every this many steps (``step % n == 0``).
        keep_last_n: the newest local steps each node keeps (the newest recoverable one is
            never deleted; local steps older than the newest persistent step go).
        replicas: how many other nodes keep a copy of each rank's shard (capped, with a
            warning, at the number of other nodes).
        preemption_tier: where the preemption save goes: ``"persistent"`` (the default: it
            survives the loss of every node) or ``"local"`` (faster, for jobs requeued on the
            same nodes).
    """

    root: str | os.PathLike[str]
    save_interval_steps: int
    keep_last_n: int = 1
    replicas: int = 1
    preemption_tier: Literal["persistent", "local"] = "persistent"

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)) or not os.fspath(self.root):
            raise CheckpointTypeError(
                f"LocalTierOptions.root must be a folder path on node-local storage, got "
                f"{self.root!r}"
            )
        if "://" in os.fspath(self.root):
            raise CheckpointValueError(
                f"LocalTierOptions.root must be a node-local folder, not a URL ({self.root!r}); "
                "the object store is the persistent tier: CheckpointManager('s3://...')"
            )
        for name, least in (("save_interval_steps", 1), ("keep_last_n", 1), ("replicas", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CheckpointValueError(
                    f"LocalTierOptions.{name} must be an int >= {least}, got {value!r}"
                )
        if self.preemption_tier not in ("persistent", "local"):
            raise CheckpointValueError(
                "LocalTierOptions.preemption_tier must be 'persistent' or 'local', got "
                f"{self.preemption_tier!r}"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointManagerOptions:
    """Options of a :class:`~orbit_pt.CheckpointManager`.

    Save cadence: ``should_save(step)`` is True when any configured save rule says so (or the
    job is being preempted). There is no hidden "initial save" rule: step 0 is a save step only
    because ``0 % n == 0``. ``save(..., force=True)`` saves whatever the rules say.

    Retention: after each committed save the manager keeps the union of what every configured
    retention rule keeps, plus the latest committed step, always, and deletes the other
    committed steps of this root (nothing else). With no retention rule, every step is kept.
    See docs/retention.md for worked examples.

    Attributes:
        save_interval_steps: ``should_save(step)`` is True when ``step % save_interval_steps == 0``.
            When no save rule is configured at all (this, ``save_on_steps`` and ``save_policy``
            all None), every step is a save step.
        save_on_steps: extra steps to save on, whatever the interval (a list, tuple or set).
        save_policy: a custom :class:`~orbit_pt.policies.SavePolicy`; combined (any-of) with the
            two options above. A policy of the same kind as an option (``EveryNSteps`` with
            ``save_interval_steps``, ``OnSteps`` with ``save_on_steps``) is a ValueError: drop one.
        keep_last_n: keep the n newest committed steps (by step number).
        keep_every_k_steps: keep every committed step divisible by k (0, k, 2k, ...).
        keep_best_n: keep the n best steps by ``best_metric``; steps saved without that metric
            cannot be ranked and are kept (the manager logs that once).
        best_metric: the metric (a key of ``save(..., metrics=)``) that ranks steps; required by
            ``keep_best_n``; also what ``best_step()`` ranks by, even without ``keep_best_n``.
        best_mode: "min" (lower is better: a loss) or "max" (higher is better: an accuracy).
        keep_time_interval: keep one step per this many seconds (or this ``timedelta``) of
            commit time: the first step, then each step committed at least this long after the
            last one kept.
        retention: custom :class:`~orbit_pt.policies.RetentionPolicy` objects (one, or a list),
            combined (any-of) with the options above. A policy of the same kind as an option
            (``KeepLastN`` with ``keep_last_n``, ...) is a ValueError: drop one.
        async_save: ``save()`` returns after staging; writing and commit run in the background.
        read_only: open the root for reading only (an evaluator beside a training job): no lock,
            no clean-up, and ``save``/``delete`` raise.
        preemption_signals: signals that mark the job as preempted (see ``reached_preemption``).
        verify_on_restore: ``restore`` checks every file it reads against the checksum recorded
            at commit (a full read of the restored items before loading them).
        preemption_exit_code: the exit status of a process whose loop saves again after its
            preemption step was saved (see ``CheckpointManager.save``). The default, 143
            (128 + SIGTERM), is what schedulers read as "stopped by SIGTERM": torchelastic and a
            Kubernetes Job count it as a failure to retry, never as a job that completed.
        agreement_timeout: under torch.distributed, how long (seconds, or a ``timedelta``) a
            rank waits in one of the manager's agreements for the other ranks before its
            save, restore or preemption check fails. None keeps gloo's own default, 30
            minutes, which is also what a rank waits for a peer that is alive but stuck.
        local: a node-local tier (:class:`LocalTierOptions`) beside this root, the persistent
            tier; ``should_save(step)`` is then True on either tier's cadence.
    """

    save_interval_steps: int | None = None
    save_on_steps: Collection[int] | None = None
    save_policy: p.SavePolicy | None = None
    keep_last_n: int | None = None
    keep_every_k_steps: int | None = None
    keep_best_n: int | None = None
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"
    keep_time_interval: float | datetime.timedelta | None = None
    retention: p.RetentionPolicy | Collection[p.RetentionPolicy] | None = None
    async_save: bool = False
    read_only: bool = False
    preemption_signals: Sequence[signal.Signals] = (signal.SIGTERM,)
    verify_on_restore: bool = False
    preemption_exit_code: int = 143
    agreement_timeout: float | datetime.timedelta | None = None
    local: LocalTierOptions | None = None

    def __post_init__(self) -> None:
        if self.local is not None:
            if not isinstance(self.local, LocalTierOptions):
                raise CheckpointTypeError(
                    f"local must be a LocalTierOptions, got {type(self.local).__name__}"
                )
            if self.read_only:
                raise CheckpointValueError(
                    "read_only=True with a local tier: a read-only manager reads the persistent "
                    "root only; drop local=..."
                )
        if self.keep_best_n is not None and self.best_metric is None:
            raise CheckpointValueError(
                f"keep_best_n={self.keep_best_n} needs best_metric, the name of the metric to "
                "rank steps by (a key of save(..., metrics=)), e.g. best_metric='loss'"
            )
        if self.best_mode not in ("min", "max"):
            raise CheckpointValueError(
                f"best_mode must be 'min' or 'max', got {self.best_mode!r}; use 'min' for a "
                "loss and 'max' for an accuracy"
            )
        for name in ("async_save", "read_only", "verify_on_restore"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointTypeError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        timeout = self.agreement_timeout
        if timeout is not None:
            seconds: object = timeout
            if isinstance(timeout, datetime.timedelta):
                seconds = timeout.total_seconds()
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
                raise CheckpointValueError(
                    f"agreement_timeout must be a positive number of seconds or a timedelta, got "
                    f"{timeout!r}"
                )
        code = self.preemption_exit_code
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
            raise CheckpointValueError(
                f"preemption_exit_code must be an int in 0..255 (a process exit status), got "
                f"{code!r}"
            )
        # Both are read again each time a policy is built: a one-shot iterator would be empty
        # the second time, so only re-iterable collections are accepted.
        _check_collection(self.save_on_steps, "save_on_steps", "e.g. [1000, 5000]")
        if not isinstance(self.retention, p.RetentionPolicy):
            _check_collection(self.retention, "retention", "e.g. [KeepSteps([1000])]")
        # Building the policies validates every value and catches option/policy clashes early.
        self.retention_policy()
        self.best_policy()
        self.save_policy_object()

    def retention_policy(self) -> p.RetentionPolicy | None:
        """The combined retention policy, or None to keep every step.

        The manager keeps the union of what this policy keeps, plus the latest committed step.
        """
        built: list[tuple[str, p.RetentionPolicy]] = []
        if self.keep_last_n is not None:
            built.append((f"keep_last_n={self.keep_last_n}", p.KeepLastN(self.keep_last_n)))
        if self.keep_every_k_steps is not None:
            built.append(
                (
                    f"keep_every_k_steps={self.keep_every_k_steps}",
                    p.KeepEveryKSteps(self.keep_every_k_steps),
                )
            )
        if self.keep_best_n is not None:
            assert self.best_metric is not None  # checked in __post_init__
            built.append(
                (
                    f"keep_best_n={self.keep_best_n}",
                    p.KeepBestN(self.keep_best_n, self.best_metric, self.best_mode),
                )
            )
        if self.keep_time_interval is not None:
            built.append(
                (
                    f"keep_time_interval={self.keep_time_interval!r}",
                    p.KeepTimeInterval(_seconds(self.keep_time_interval)),
                )
            )
        custom = self._custom_retention()
        _refuse_clash(built, [leaf for c in custom for leaf in p.flatten_retention(c)], "retention")
        policies = [policy for _, policy in built] + custom
        if not policies:
            return None
        return policies[0] if len(policies) == 1 else p.AnyOf(*policies)

    def ranking_policies(self) -> list[p.KeepBestN]:
        """The best-n rules of the retention policy (from ``keep_best_n`` or ``retention=``)."""
        policy = self.retention_policy()
        if policy is None:
            return []
        return [leaf for leaf in p.flatten_retention(policy) if isinstance(leaf, p.KeepBestN)]

    def best_policy(self) -> p.KeepBestN | None:
        """The rule that ranks steps for ``best_step()``.

        By ``best_metric``/``best_mode`` when ``best_metric`` is set (with or without
        ``keep_best_n``); otherwise the first :class:`~orbit_pt.policies.KeepBestN` in
        ``retention=``; otherwise None.
        """
        if self.best_metric is not None:
            return p.KeepBestN(self.keep_best_n or 1, self.best_metric, self.best_mode)
        ranking = self.ranking_policies()
        return ranking[0] if ranking else None

    def save_policy_object(self) -> p.SavePolicy:
        """The combined save policy, always including :class:`~orbit_pt.policies.OnPreemption`.

        With no save rule at all (``save_interval_steps``, ``save_on_steps`` and ``save_policy``
        all None) every step is a save step. Whatever the rules, the step at which every rank
        agreed that the job is being preempted is a save step.
        """
        built: list[tuple[str, p.SavePolicy]] = []
        if self.save_interval_steps is not None:
            built.append(
                (
                    f"save_interval_steps={self.save_interval_steps}",
                    p.EveryNSteps(self.save_interval_steps),
                )
            )
        if self.save_on_steps is not None:
            built.append((f"save_on_steps={self.save_on_steps!r}", p.OnSteps(self.save_on_steps)))
        custom: list[p.SavePolicy] = []
        if self.save_policy is not None:
            if not isinstance(self.save_policy, p.SavePolicy):
                raise CheckpointTypeError(
                    "save_policy must be a SavePolicy (an object with should_save(step, *, "
                    f"preempted)), got {self.save_policy!r} ({type(self.save_policy).__name__}); "
                    "combine several with AnySavePolicy(...)"
                )
            custom = [self.save_policy]
            _refuse_clash(built, p.flatten_save(self.save_policy), "save_policy")
        policies = [policy for _, policy in built] + custom
        if not policies:
            policies = [p.EveryNSteps(1)]
        leaves = [leaf for policy in policies for leaf in p.flatten_save(policy)]
        if not any(isinstance(leaf, p.OnPreemption) for leaf in leaves):
            policies.append(p.OnPreemption())
        return p.AnySavePolicy(*policies)

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
                    f"list of them, got {policy!r} ({type(policy).__name__}) in it"
                )
        return given


def _refuse_clash(built: Sequence[tuple[str, object]], leaves: Sequence[object], arg: str) -> None:
    """An option and a custom policy of the same kind is ambiguous: refuse it, naming both."""
    for option, policy in built:
        for leaf in leaves:
            if type(leaf) is type(policy):
                name = option.split("=", 1)[0]
                raise CheckpointValueError(
                    f"both {option} and {leaf!r} in {arg}= were given, and they are the same "
                    f"kind of rule; drop {name}= or remove the {type(leaf).__name__} from {arg}="
                )


def _check_collection(value: object, name: str, example: str) -> None:
    if value is None:
        return
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        raise CheckpointTypeError(
            f"{name} must be a list, tuple or set, got {value!r} ({type(value).__name__}); "
            f"{example}"
        )


def _seconds(value: float | datetime.timedelta) -> float:
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    return value


def timeout_of(options: CheckpointManagerOptions) -> datetime.timedelta | None:
    """``agreement_timeout`` as a ``timedelta`` (None: the process group's default)."""
    timeout = options.agreement_timeout
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))
