"""The root folder: discovery of committed steps, the atomic commit, superseding and deletion.

Commit protocol (docs/format.md): write the step into ``step_N.orbit-tmp/``, fsync every file and
folder in it, write ``_CHECKPOINT_METADATA`` last and fsync it and the folder, move any steps the
new one replaces into ``superseded/``, ``os.replace`` the folder to ``step_N/``, fsync the root.
A folder is a committed step exactly when its name is a step name and its metadata file is
readable; so a crash at any instant leaves either the old set of steps or the new one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import filelock

from orbit_pt import _fs, _layout
from orbit_pt.errors import (
    CheckpointLockedError,
    CheckpointSaveError,
    CorruptCheckpointError,
    StepAlreadyExistsError,
    StepNotFoundError,
)
from orbit_pt.metadata import FileMetadata, ItemMetadata, StepMetadata

logger = logging.getLogger(__name__)

WriteItems = Callable[[Path], dict[str, ItemMetadata]]
BuildMetadata = Callable[[dict[str, ItemMetadata], dict[str, FileMetadata]], StepMetadata]


class StepStore:
    """The committed steps under one root, and the only code that changes that root."""

    def __init__(self, root: Path, *, read_only: bool, lock_timeout: float) -> None:
        self.root = root
        self.read_only = read_only
        self._lock: filelock.BaseFileLock | None = None
        self._committed: dict[int, StepMetadata] = {}
        if not read_only:
            root.mkdir(parents=True, exist_ok=True)
            self._lock = filelock.FileLock(root / _layout.LOCK_FILE, timeout=lock_timeout)
            try:
                self._lock.acquire()
            except filelock.Timeout:
                raise CheckpointLockedError(
                    f"another CheckpointManager is writing to {root} (it holds "
                    f"{root / _layout.LOCK_FILE}); close it first, or open this one with "
                    "CheckpointManagerOptions(read_only=True) to only read"
                ) from None
            self._remove_leftovers()
        self.rescan()

    # ------------------------------------------------------------------------------- discovery

    def rescan(self) -> None:
        """Re-read which steps are committed. Metadata of steps already known is not re-read."""
        found: dict[int, StepMetadata] = {}
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            entries = []
        for entry in entries:
            step = _layout.parse_step_name(entry.name)
            if step is None or not entry.is_dir(follow_symlinks=False):
                continue
            known = self._committed.get(step)
            if known is not None:
                found[step] = known
                continue
            meta = self._read_committed(Path(entry.path), step)
            if meta is not None:
                found[step] = meta
        self._committed = dict(sorted(found.items()))

    def _read_committed(self, path: Path, step: int) -> StepMetadata | None:
        meta_path = path / _layout.METADATA_FILE
        if not meta_path.is_file():
            return None  # not committed: never a step
        try:
            meta = StepMetadata.read(meta_path)
        except CorruptCheckpointError as exc:
            logger.warning("ignoring %s: %s", path, exc)
            return None
        if meta.step != step:
            logger.warning(
                "ignoring %s: its metadata says step %d; the folder was renamed by hand",
                path,
                meta.step,
            )
            return None
        return meta

    def steps(self) -> list[int]:
        if self.read_only:
            self.rescan()  # another process writes this root: look again every time
        return list(self._committed)

    def committed(self) -> dict[int, StepMetadata]:
        if self.read_only:
            self.rescan()
        return dict(self._committed)

    def metadata(self, step: int | None) -> StepMetadata:
        if self.read_only:
            self.rescan()
        meta = self._committed.get(step) if step is not None else None
        if meta is None:
            raise StepNotFoundError(step, self.root, list(self._committed))
        return meta

    def step_path(self, step: int) -> Path:
        return self.root / _layout.step_name(step)

    def check_files(self, step: int, meta: StepMetadata) -> None:
        """Every file the metadata lists is present with its recorded size."""
        base = self.step_path(step)
        for rel, info in meta.files.items():
            path = base / rel
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"step {step} is damaged: {path} is missing; restore another step"
                ) from None
            if size != info.size:
                raise CorruptCheckpointError(
                    f"step {step} is damaged: {path} has {size} bytes, the metadata recorded "
                    f"{info.size} (truncated or overwritten); restore another step"
                )

    # ---------------------------------------------------------------------------------- commit

    def commit(self, step: int, write_items: WriteItems, build_metadata: BuildMetadata) -> None:
        """Write a step through ``write_items`` into a temporary folder and commit it atomically."""
        final = self.step_path(step)
        if final.exists() and step not in self._committed:
            raise StepAlreadyExistsError(
                f"{final} exists but is not a committed orbit_pt step (no readable "
                f"{_layout.METADATA_FILE}); move it out of {self.root} and save again"
            )
        tmp = self.root / _layout.tmp_name(step)
        _fs.remove_tree(tmp)
        try:
            tmp.mkdir()
            written = write_items(tmp)
            files = {
                rel.as_posix(): FileMetadata(size=(tmp / rel).stat().st_size)
                for rel in _fs.iter_files(tmp)
            }
            _fs.fsync_tree(tmp)
            meta = build_metadata(written, files)
            _fs.write_file_durably(tmp / _layout.METADATA_FILE, meta.to_json())
            _fs.fsync_path(tmp)
        except BaseException as exc:
            _fs.remove_tree(tmp)
            if isinstance(exc, Exception):
                raise CheckpointSaveError(step, tmp, f"{type(exc).__name__}: {exc}") from exc
            raise
        self._supersede_from(step)
        os.replace(tmp, final)
        _fs.fsync_path(self.root)
        self._committed[step] = meta
        self._committed = dict(sorted(self._committed.items()))
        logger.info("committed step %d to %s", step, final)

    def _supersede_from(self, step: int) -> None:
        """Move ``step`` and every newer committed step into ``superseded/``, newest first.

        Newest first, so that a crash in the middle leaves a prefix of the old timeline: the
        latest step is then some old step, never a gap, and every moved step is intact.
        """
        victims = sorted((s for s in self._committed if s >= step), reverse=True)
        if not victims:
            return
        logger.warning(
            "saving step %d in %s replaces committed step(s) %s: moving them to %s/ "
            "(delete them there when you no longer need them)",
            step,
            self.root,
            victims,
            _layout.SUPERSEDED_DIR,
        )
        folder = self.root / _layout.SUPERSEDED_DIR
        folder.mkdir(exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        for victim in victims:
            destination = folder / f"{_layout.step_name(victim)}.{stamp}"
            os.replace(self.step_path(victim), destination)
            del self._committed[victim]
        _fs.fsync_path(folder)
        _fs.fsync_path(self.root)

    # ---------------------------------------------------------------------------------- delete

    def delete(self, step: int) -> None:
        """Delete a committed step: rename it out of the step namespace, then remove it."""
        doomed = self.root / (_layout.step_name(step) + _layout.DELETING_SUFFIX)
        _fs.remove_tree(doomed)
        os.replace(self.step_path(step), doomed)
        _fs.fsync_path(self.root)
        del self._committed[step]
        _fs.remove_tree(doomed)

    # ------------------------------------------------------------------------------- lifecycle

    def _remove_leftovers(self) -> None:
        """Remove temporary and half-deleted folders that a crashed writer left behind."""
        removed = []
        for entry in os.scandir(self.root):
            name = entry.name
            for suffix in (_layout.TMP_SUFFIX, _layout.DELETING_SUFFIX):
                stem = name.removesuffix(suffix)
                if (
                    name.endswith(suffix)
                    and _layout.parse_step_name(stem) is not None
                    and entry.is_dir(follow_symlinks=False)
                ):
                    _fs.remove_tree(Path(entry.path))
                    removed.append(name)
        if removed:
            _fs.fsync_path(self.root)
            logger.info("removed %d leftover folder(s) in %s: %s", len(removed), self.root, removed)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
