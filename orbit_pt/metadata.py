"""The ``_CHECKPOINT_METADATA`` file: what a committed step holds.

It is JSON (readable by any tool, never pickle) and is the last file written into a step, so
its presence is what makes a folder a committed step. docs/format.md specifies it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orbit_pt._format import checksum as _checksum
from orbit_pt._format import safe_open as _safe_open
from orbit_pt._storage import layout as _layout
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError, CorruptCheckpointError

FORMAT_NAME = "orbit_pt"
FORMAT_VERSION = 2


@dataclass(frozen=True)
class ItemMetadata:
    """How one item was saved: the handler's registered name and what the handler reported."""

    handler: str
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FileMetadata:
    """A file of the step, by its path relative to the step folder."""

    size: int
    checksum: str | None = None


@dataclass(frozen=True)
class StepMetadata:
    """Everything recorded about a committed step.

    Attributes:
        step: the training step.
        time: commit time, seconds since the epoch (UTC).
        items: item name -> how it was saved.
        metrics: the ``metrics=`` given to ``save`` (numbers only).
        world_size: how many ranks wrote the step.
        files: every file of the step except this metadata file, relative path -> size/checksum.
        orbit_pt_version: the version of orbit_pt that wrote it.
    """

    step: int
    time: float
    items: Mapping[str, ItemMetadata]
    metrics: Mapping[str, float] = field(default_factory=dict)
    world_size: int = 1
    files: Mapping[str, FileMetadata] = field(default_factory=dict)
    orbit_pt_version: str = ""

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "orbit_pt_version": self.orbit_pt_version,
            "step": self.step,
            "time": self.time,
            "world_size": self.world_size,
            "metrics": dict(self.metrics),
            "items": {
                name: {"handler": item.handler, "info": dict(item.info)}
                for name, item in self.items.items()
            },
            "files": {
                path: {"size": f.size, "checksum": f.checksum} for path, f in self.files.items()
            },
        }
        try:  # what a reader would refuse is refused now, at save, naming the field
            _parse(doc)
            if _safe_open.json_depth(doc, limit=_safe_open.MAX_JSON_DEPTH) > (
                _safe_open.MAX_JSON_DEPTH
            ):
                raise ValueError(
                    f"it nests deeper than {_safe_open.MAX_JSON_DEPTH} levels (an item's info?)"
                )
        except ValueError as exc:
            raise CheckpointValueError(
                f"the metadata of step {self.step} could not be read back ({exc}); a handler's "
                "info must be a small JSON object"
            ) from exc
        doc["checksum"] = _self_checksum(doc)
        return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, *, path: Path) -> StepMetadata:
        """Parse metadata; any problem is a :class:`CorruptCheckpointError` naming ``path``.

        Every field is checked against the schema (docs/format.md) -- its type and its range --
        after the self-checksum: a forged file whose checksum was recomputed is refused by
        field, never turned into an internal error later.
        """
        try:
            doc = _safe_open.parse_json(data, finite=True)  # NaN is not JSON
            if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
                raise ValueError("not an orbit_pt metadata file")
            version = _count(doc.get("format_version"), "format_version", low=1)
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"format_version {version!r} is newer than this orbit_pt understands "
                    f"({FORMAT_VERSION}); upgrade orbit_pt to read it"
                )
            recorded = doc.pop("checksum", None)
            if recorded != _self_checksum(doc):
                raise ValueError(
                    f"its checksum is {recorded!r:.80} but its content hashes to "
                    f"{_self_checksum(doc)!r}: it was changed after the commit"
                )
            return _parse(doc)
        # RecursionError: JSON nested deeper than the parser goes (garbage, or an attack).
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(
                f"checkpoint metadata {path} is unreadable ({exc}); the step it belongs to "
                "cannot be trusted -- restore another step, or move the folder away"
            ) from exc

    @classmethod
    def read(cls, path: Path) -> StepMetadata:
        """Read and parse the metadata file ``path``: a regular file, never a link."""
        try:
            data = _safe_open.read_bytes(path, limit=_safe_open.MAX_JSON_BYTES, nofollow=True)
        except OSError as exc:
            raise CorruptCheckpointError(f"cannot read checkpoint metadata {path}: {exc}") from exc
        return cls.from_json(data, path=path)


MAX_WORLD_SIZE = 1 << 20
"""The largest ``world_size`` a metadata file may record (a restore looks for every rank's
folder, so a forged huge number must not make it look for billions)."""
MAX_TIME = 253402300799.0
"""The latest ``time`` a metadata file may record: 9999-12-31 23:59:59 UTC, the last second a
date can show."""
_MAX_SIZE = 2**63 - 1


def _parse(doc: Mapping[str, Any]) -> StepMetadata:
    """The metadata in ``doc`` (its checksum already checked), every field checked.

    Raises:
        ValueError: naming the first field that does not match the schema.
    """
    items = _object(doc.get("items"), "items")
    files = _object(doc.get("files", {}), "files")
    metrics = _object(doc.get("metrics", {}), "metrics")
    return StepMetadata(
        step=_count(doc.get("step"), "step"),
        time=_number(doc.get("time"), "time", low=0.0, high=MAX_TIME),
        # Names and paths are checked so that a forged metadata file can never make a restore
        # read outside the step folder.
        items={
            _layout.check_item_name(name): _item(item, f"items[{name!r:.60}]")
            for name, item in items.items()
        },
        metrics={name: _number(value, f"metrics[{name!r:.60}]") for name, value in metrics.items()},
        world_size=_count(doc.get("world_size", 1), "world_size", low=1, high=MAX_WORLD_SIZE),
        files={
            _layout.check_relative_path(rel): _file(entry, f"files[{rel!r:.100}]")
            for rel, entry in files.items()
        },
        orbit_pt_version=_string(doc.get("orbit_pt_version", ""), "orbit_pt_version"),
    )


def _item(value: Any, where: str) -> ItemMetadata:
    item = _object(value, where)
    handler = _string(item.get("handler"), f"{where}.handler")
    _check(bool(handler), f"{where}.handler", "a non-empty string", handler)
    return ItemMetadata(handler=handler, info=_object(item.get("info", {}), f"{where}.info"))


def _file(value: Any, where: str) -> FileMetadata:
    entry = _object(value, where)
    checksum = entry.get("checksum")
    if checksum is not None:
        checksum = _string(checksum, f"{where}.checksum", expected="a string or null")
    size = _count(entry.get("size"), f"{where}.size", high=_MAX_SIZE)
    return FileMetadata(size=size, checksum=checksum)


def _check(ok: bool, field: str, expected: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"field {field} must be {expected}, got {value!r:.80}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _object(value: Any, field: str) -> dict[str, Any]:
    _check(isinstance(value, dict), field, "an object", value)
    return value  # type: ignore[no-any-return]


def _string(value: Any, field: str, *, expected: str = "a string") -> str:
    _check(isinstance(value, str), field, expected, value)
    return value  # type: ignore[no-any-return]


def _count(value: Any, field: str, *, low: int = 0, high: int | None = None) -> int:
    bounds = f"an integer >= {low}" + ("" if high is None else f" and <= {high}")
    ok = _is_int(value) and value >= low and (high is None or value <= high)
    _check(ok, field, bounds, value)
    return value  # type: ignore[no-any-return]


def _number(
    value: Any, field: str, *, low: float | None = None, high: float | None = None
) -> float:
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    bounds = "" if low is None else f" between {low:g} and {high:g}"
    _check(ok, field, f"a finite number{bounds}", value)
    return float(value)


def _self_checksum(doc: Mapping[str, Any]) -> str:
    """The metadata's checksum of itself: xxh3-64 of its canonical JSON without the checksum.

    Canonical: keys sorted, no whitespace (separators "," and ":"), non-ASCII escaped, floats
    in shortest round-trip form -- what ``json.dumps(..., sort_keys=True, separators=(",", ":"))``
    writes. docs/format.md specifies it for other tools.
    """
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return _checksum.of_bytes(canonical.encode())


def validate_metrics(metrics: Mapping[str, Any] | None, *, step: int) -> dict[str, float]:
    """Metrics as plain floats, or a ValueError that names the bad one."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise CheckpointTypeError(
            f"metrics for step {step} must be a mapping of name -> number, "
            f"got {type(metrics).__name__}"
        )
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise CheckpointValueError(
                f"metric names must be non-empty strings, got {name!r} at step {step}"
            )
        try:
            number = float(value)  # accepts python numbers and one-element tensors
        except (TypeError, ValueError) as exc:
            raise CheckpointTypeError(
                f"metric {name!r} at step {step} must be a number, got {type(value).__name__}; "
                "pass e.g. loss.item()"
            ) from exc
        if not math.isfinite(number):
            raise CheckpointValueError(
                f"metric {name!r} at step {step} is {number}; only finite numbers can be ranked "
                "and stored -- leave it out of metrics for this step"
            )
        out[name] = number
    return out
