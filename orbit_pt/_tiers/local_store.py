"""A node's local root: the per-rank shards of one run, committed by a marker and a rename.

Layout (``<root>`` is ``LocalTierOptions.root``; every rank of a node sees the same one)::

    <root>/run-<run id>/step_<N>/rank_<R>/        rank R's shard of step N (its own, or a replica)
        <item>/state.msgpack, <item>/tensors.safetensors
        SHARD.json                                 the marker, written last
    <root>/run-<run id>/.orbit-tmp/...             shards being written or received
    <root>/run-<run id>/.orbit-deleting/...        shards being deleted

A shard folder appears under its final name only by the rename of a complete, fsynced folder
whose marker names the run, the step, the rank, the world size, the save's attempt (a nonce all
ranks agreed on) and every file with its size and xxh3-64 checksum. A folder without a valid
marker, or whose marker names another run, step, rank or world size, is not listed. The run id
comes from the persistent root (``.orbit-run-id``): a local root left by another run is in
another ``run-`` folder and is never read or touched by this one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orbit_pt._format import checksum as _checksum
from orbit_pt._storage import fs as _fs
from orbit_pt._storage.layout import parse_step_name, step_name
from orbit_pt.errors import CorruptCheckpointError

logger = logging.getLogger(__name__)

MARKER = "SHARD.json"
FORMAT_VERSION = 1
TMP_DIR = ".orbit-tmp"
DELETING_DIR = ".orbit-deleting"
_RANK_NAME = re.compile(r"rank_(\d{5,})")


def rank_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def parse_rank_name(name: str) -> int | None:
    match = _RANK_NAME.fullmatch(name)
    if match is None:
        return None
    rank = int(match.group(1))
    return rank if rank_name(rank) == name else None


class LocalStore:
    """This rank's view of its node's local root, for one run and world size."""

    def __init__(self, root: Path, run_id: str, *, world_size: int) -> None:
        self.base = Path(root)
        self.run_id = run_id
        self.world_size = world_size
        self.root = self.base / f"run-{run_id}"
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / TMP_DIR).mkdir(exist_ok=True)

    # ------------------------------------------------------------------------------- naming

    def shard_path(self, step: int, rank: int) -> Path:
        return self.root / step_name(step) / rank_name(rank)

    def fresh_tmp(self, step: int, rank: int, *, create: bool = True) -> Path:
        """An empty folder to write rank ``rank``'s shard of ``step`` into. ``create=False``:
        only its unique name (a receiver creates it as the first bytes arrive, so that failing
        to create it is reported after the stream, never leaving its sender waiting)."""
        tmp = self.root / TMP_DIR / f"{step_name(step)}.{rank_name(rank)}.{uuid.uuid4().hex}"
        if create:
            tmp.mkdir(parents=True)
        return tmp

    # ------------------------------------------------------------------------------ writing

    def finish(self, tmp: Path, marker: Mapping[str, Any]) -> None:
        """Write the marker (last) and make the folder durable, ready for :meth:`commit`."""
        _fs.write_file_durably(tmp / MARKER, json.dumps(marker, sort_keys=True).encode())
        _fs.fsync_tree(tmp)

    def commit(self, tmp: Path, step: int, rank: int) -> None:
        """Rename a finished folder into place (replacing an older shard of the same name)."""
        final = self.shard_path(step, rank)
        final.parent.mkdir(exist_ok=True)
        if final.exists():
            self._remove(final)
        tmp.rename(final)
        _fs.fsync_path(final.parent)
        _fs.fsync_path(self.root)

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------------------ reading

    def markers(self) -> dict[int, dict[int, dict[str, Any]]]:
        """step -> rank -> marker, for every committed shard of this run and world size here."""
        found: dict[int, dict[int, dict[str, Any]]] = {}
        try:
            steps = list(os.scandir(self.root))
        except FileNotFoundError:
            return found
        for entry in steps:
            step = parse_step_name(entry.name)
            if step is None or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                ranks = list(os.scandir(entry.path))
            except OSError:
                continue
            for sub in ranks:
                rank = parse_rank_name(sub.name)
                if rank is None or not sub.is_dir(follow_symlinks=False):
                    continue
                marker = self._read_marker(Path(sub.path))
                if marker is None:
                    continue
                if (
                    marker.get("run") != self.run_id
                    or marker.get("step") != step
                    or marker.get("rank") != rank
                    or marker.get("world_size") != self.world_size
                ):
                    continue
                found.setdefault(step, {})[rank] = marker
        return found

    def marker(self, step: int, rank: int) -> dict[str, Any] | None:
        return self._read_marker(self.shard_path(step, rank))

    def read_file(self, step: int, rank: int, rel: str) -> bytes:
        return (self.shard_path(step, rank) / rel).read_bytes()

    def verify(self, step: int, rank: int, marker: Mapping[str, Any]) -> None:
        """Check every file of a shard against its marker (size and checksum).

        Raises:
            CorruptCheckpointError: naming the file and what differs.
        """
        folder = self.shard_path(step, rank)
        for rel, recorded in sorted(marker["files"].items()):
            path = folder / rel
            try:
                size = path.stat().st_size
            except OSError as exc:
                raise CorruptCheckpointError(
                    f"local shard {folder}: {rel} cannot be read ({exc})"
                ) from exc
            if size != recorded["size"]:
                raise CorruptCheckpointError(
                    f"local shard {folder}: {rel} has {size} bytes, its marker records "
                    f"{recorded['size']}"
                )
            actual = _checksum.of_file(path, _checksum.algorithm_of(recorded["checksum"]))
            if actual != recorded["checksum"]:
                raise CorruptCheckpointError(
                    f"local shard {folder}: {rel} has checksum {actual}, its marker records "
                    f"{recorded['checksum']} (the file changed since it was committed)"
                )

    # ----------------------------------------------------------------------------- deleting

    def steps(self) -> list[int]:
        """Every step folder of this run here, complete or not."""
        out: list[int] = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return out
        for entry in entries:
            step = parse_step_name(entry.name)
            if step is not None:
                out.append(step)
        return sorted(out)

    def delete_step(self, step: int) -> None:
        """Remove a step folder (renamed away first, so it is never listed half-deleted)."""
        folder = self.root / step_name(step)
        if folder.exists():
            self._remove(folder)

    def delete_shard(self, step: int, rank: int) -> None:
        folder = self.shard_path(step, rank)
        if folder.exists():
            self._remove(folder)
        with contextlib.suppress(OSError):  # other shards of the step are still here
            folder.parent.rmdir()

    def remove_leftovers(self) -> None:
        """Remove what a crash left: shards being written or deleted. Call it only when no
        rank of this node is writing (at open, before the first save's agreement)."""
        for name in (TMP_DIR, DELETING_DIR):
            folder = self.root / name
            if not folder.exists():
                continue
            for entry in os.scandir(folder):
                shutil.rmtree(entry.path, ignore_errors=True)

    def _remove(self, folder: Path) -> None:
        doomed_dir = self.root / DELETING_DIR
        doomed_dir.mkdir(exist_ok=True)
        doomed = doomed_dir / f"{folder.parent.name}.{folder.name}.{uuid.uuid4().hex}"
        folder.rename(doomed)
        _fs.fsync_path(folder.parent)
        shutil.rmtree(doomed, ignore_errors=True)

    @staticmethod
    def _read_marker(folder: Path) -> dict[str, Any] | None:
        try:
            data = json.loads((folder / MARKER).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            return None
        files = data.get("files")
        if not isinstance(files, dict) or not isinstance(data.get("items"), dict):
            return None
        return data


def node_key(root: Path) -> list[Any]:
    """What identifies the node-local folder ``root``: ranks with equal keys share a node."""
    root.mkdir(parents=True, exist_ok=True)
    st = root.stat()
    return [os.uname().nodename, st.st_dev, st.st_ino]
