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
from orbit_pt._storage import layout as _layout
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError, CorruptCheckpointError

FORMAT_NAME = "orbit_pt"
FORMAT_VERSION = 1


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
        doc["checksum"] = _self_checksum(doc)
        return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, data: bytes, *, path: Path) -> StepMetadata:
        """Parse metadata; any problem is a :class:`CorruptCheckpointError` naming ``path``."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
                raise ValueError("not an orbit_pt metadata file")
            version = doc["format_version"]
            if not isinstance(version, int) or version > FORMAT_VERSION:
                raise ValueError(
                    f"format_version {version!r} is newer than this orbit_pt understands "
                    f"({FORMAT_VERSION}); upgrade orbit_pt to read it"
                )
            recorded = doc.pop("checksum", None)
            if recorded != _self_checksum(doc):
                raise ValueError(
                    f"its checksum is {recorded!r} but its content hashes to "
                    f"{_self_checksum(doc)!r}: it was changed after the commit"
                )
            return cls(
                step=_int(doc["step"], "step"),
                time=float(doc["time"]),
                # Names and paths are checked so that a forged metadata file can never make a
                # restore read outside the step folder.
                items={
                    _layout.check_item_name(name): ItemMetadata(
                        handler=str(item["handler"]), info=item.get("info", {})
                    )
                    for name, item in doc["items"].items()
                },
                metrics={str(k): float(v) for k, v in doc.get("metrics", {}).items()},
                world_size=_int(doc.get("world_size", 1), "world_size"),
                files={
                    _layout.check_relative_path(p): FileMetadata(
                        size=_int(f["size"], "size"), checksum=f.get("checksum")
                    )
                    for p, f in doc.get("files", {}).items()
                },
                orbit_pt_version=str(doc.get("orbit_pt_version", "")),
            )
        # RecursionError: JSON nested deeper than the parser goes (garbage, or an attack).
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise CorruptCheckpointError(
                f"checkpoint metadata {path} is unreadable ({exc}); the step it belongs to "
                "cannot be trusted -- restore another step, or move the folder away"
            ) from exc

    @classmethod
    def read(cls, path: Path) -> StepMetadata:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CorruptCheckpointError(f"cannot read checkpoint metadata {path}: {exc}") from exc
        return cls.from_json(data, path=path)


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


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointTypeError(f"{name} must be an integer, got {value!r}")
    return value
