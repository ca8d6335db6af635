"""Which committed steps retention keeps, and by which rule: the one place that rule lives.

The kept set is the union of what each retention policy keeps, plus the latest committed step,
always (docs/retention.md). A best-n policy also keeps the steps saved without its metric,
since it cannot rank them. :func:`decide` applies that rule and says, per step, which rules keep
it; :meth:`CheckpointManager.apply_retention <orbit_pt.CheckpointManager.apply_retention>` deletes
what it does not keep, and ``orbit-pt ls``/``prune`` show it.

The root also records the retention options its writer last used (:func:`record`, in
``.orbit-retention.json``), so that ``orbit-pt ls`` can say which rule keeps each step without
the training job's code. Custom policy objects are recorded by their ``repr`` only: they cannot
be rebuilt from it.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orbit_pt._format import safe_open as _safe_open
from orbit_pt._storage import fs as _fs
from orbit_pt._storage import layout as _layout
from orbit_pt.errors import CheckpointError, CorruptCheckpointError
from orbit_pt.options import CheckpointManagerOptions
from orbit_pt.policies import (
    CheckpointInfo,
    KeepBestN,
    KeepEveryKSteps,
    KeepLastN,
    KeepSteps,
    KeepTimeInterval,
    RetentionPolicy,
    flatten_retention,
)

__all__ = ["RecordedRetention", "RetentionDecision", "decide", "read_record", "rule_label"]

logger = logging.getLogger(__name__)

LATEST = "latest"
"""The reason the latest committed step is kept, whatever the policies say."""
UNRANKED = "unranked"
"""Appended to a best-n rule's label for a step it keeps because it lacks the metric."""

_RECORD_FORMAT = "orbit_pt.retention"
_RECORD_VERSION = 1
# The options that build the retention policy, in the order CheckpointManagerOptions lists them.
_RECORDED_OPTIONS = (
    "keep_last_n",
    "keep_every_k_steps",
    "keep_best_n",
    "best_metric",
    "best_mode",
    "keep_time_interval",
)


@dataclass(frozen=True)
class RetentionDecision:
    """What retention does with one committed step.

    Attributes:
        step: the step.
        kept: whether it is kept; a step not kept is deleted by
            :meth:`~orbit_pt.CheckpointManager.apply_retention` (unless ``dry_run``).
        kept_by: the rules that keep it, in the policy's order: each rule's label (as
            :func:`rule_label`), ``"<label>:unranked"`` for a best-n rule keeping a step saved
            without its metric, and ``"latest"`` for the latest step. Empty when it is not kept;
            with no retention policy every step is kept, and only the latest names a reason.
    """

    step: int
    kept: bool
    kept_by: tuple[str, ...] = ()


def decide(
    checkpoints: Sequence[CheckpointInfo], policy: RetentionPolicy | None
) -> list[RetentionDecision]:
    """Apply the retention rule to ``checkpoints`` (sorted by step): one decision per step.

    With ``policy`` None every step is kept. Pure: no I/O, no clock.
    """
    if not checkpoints:
        return []
    reasons: dict[int, list[str]] = {c.step: [] for c in checkpoints}
    for leaf in flatten_retention(policy) if policy is not None else []:
        label = rule_label(leaf)
        for step in sorted(leaf.keep(checkpoints)):
            if step not in reasons:
                continue  # a policy may name steps that are not committed; they are not ours
            unranked = isinstance(leaf, KeepBestN) and not any(
                leaf.metric in c.metrics for c in checkpoints if c.step == step
            )
            reasons[step].append(f"{label}:{UNRANKED}" if unranked else label)
    latest = checkpoints[-1].step
    reasons[latest].append(LATEST)
    return [
        RetentionDecision(step, policy is None or bool(why), tuple(why))
        for step, why in reasons.items()
    ]


def rule_label(policy: RetentionPolicy) -> str:
    """A short readable name of a retention rule, as ``orbit-pt`` flags spell it."""
    if isinstance(policy, KeepLastN):
        return f"keep-last-n={policy.n}"
    if isinstance(policy, KeepEveryKSteps):
        return f"keep-every-k-steps={policy.k}"
    if isinstance(policy, KeepBestN):
        return f"keep-best-n={policy.n}({policy.metric},{policy.mode})"
    if isinstance(policy, KeepTimeInterval):
        return f"keep-time-interval={policy.seconds:g}s"
    if isinstance(policy, KeepSteps):
        return f"keep-steps={','.join(map(str, sorted(policy.steps)))}"
    return repr(policy)


def rule_labels(policy: RetentionPolicy | None) -> list[str]:
    """The label of each rule of ``policy`` (none for None)."""
    return [rule_label(leaf) for leaf in flatten_retention(policy)] if policy is not None else []


# ----------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class RecordedRetention:
    """The retention options a root's writer last used, as recorded in the root.

    Attributes:
        options: the options that build the policy (``keep_last_n``, ``keep_every_k_steps``,
            ``keep_best_n``, ``best_metric``, ``best_mode``, ``keep_time_interval`` in seconds).
        custom: the ``repr`` of each policy given as ``retention=``; these cannot be rebuilt.
        rules: the label of every rule, custom ones included.
    """

    options: Mapping[str, Any]
    custom: tuple[str, ...] = ()
    rules: tuple[str, ...] = ()

    def rebuild(self, **extra: Any) -> CheckpointManagerOptions | None:
        """Options with the recorded rules that can be rebuilt (plus ``extra``); None if none."""
        given = {k: v for k, v in self.options.items() if v is not None and k != "best_mode"}
        if not given:
            return None
        return CheckpointManagerOptions(
            **given, best_mode=self.options.get("best_mode", "min"), **extra
        )


def record(root: Path, options: CheckpointManagerOptions) -> None:
    """Record ``options``' retention at ``root`` for ``orbit-pt ls`` (the writer's rank 0 only).

    Written atomically, and only when it changed: a root whose writers never configured
    retention gets no file. A failure is logged, never raised: the record is a convenience,
    and the save that triggered it has committed.
    """
    path = root / _layout.RETENTION_FILE
    data = _record_bytes(options)
    try:
        try:
            if _safe_open.read_bytes(path) == data:  # a regular file (a FIFO would block)
                return
        except FileNotFoundError:
            if options.retention_policy() is None:
                return  # nothing to say, and nothing older to correct
        _fs.write_file_atomically(path, data)
    except (OSError, CorruptCheckpointError) as exc:
        logger.warning("could not record the retention options in %s: %s", path, exc)


def read_record(root: Path) -> RecordedRetention | None:
    """The retention recorded at ``root``, or None when none was.

    Raises:
        CorruptCheckpointError: the record exists but cannot be read.
    """
    path = root / _layout.RETENTION_FILE
    try:
        doc = _safe_open.read_json(path)  # a regular file; bounded size and nesting
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"the retention record {path} is unreadable: {exc}") from exc
    try:
        if doc["format"] != _RECORD_FORMAT or doc["format_version"] > _RECORD_VERSION:
            raise ValueError(f"format {doc['format']!r} version {doc['format_version']!r}")
        recorded = RecordedRetention(
            options={name: doc["options"].get(name) for name in _RECORDED_OPTIONS},
            custom=tuple(str(c["repr"]) for c in doc["custom"]),
            rules=tuple(str(r) for r in doc["rules"]),
        )
        recorded.rebuild()  # the recorded values must still make valid options
    except (KeyError, TypeError, ValueError, AttributeError, CheckpointError) as exc:
        raise CorruptCheckpointError(
            f"the retention record {path} is not one this orbit_pt understands ({exc}); "
            "give the retention rules as flags"
        ) from exc
    return recorded


def _record_bytes(options: CheckpointManagerOptions) -> bytes:
    recorded = {name: getattr(options, name) for name in _RECORDED_OPTIONS}
    interval = recorded["keep_time_interval"]
    if isinstance(interval, datetime.timedelta):
        recorded["keep_time_interval"] = interval.total_seconds()
    custom = options.retention
    given = [] if custom is None else [custom] if isinstance(custom, RetentionPolicy) else custom
    doc = {
        "format": _RECORD_FORMAT,
        "format_version": _RECORD_VERSION,
        "options": recorded,
        "custom": [{"repr": repr(p), "reconstructible": False} for p in given],
        "rules": rule_labels(options.retention_policy()),
    }
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
