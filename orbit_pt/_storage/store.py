"""The root folder: the view of its committed steps, the atomic commit, superseding and deletion.

Commit protocol (docs/format.md): write the step into ``step_N.orbit-tmp/``, fsync every file and
folder in it, write ``_CHECKPOINT_METADATA`` last and fsync it and the folder, move any steps the
new one replaces into ``superseded/``, ``os.replace`` the folder to ``step_N/``, fsync the root.
Which folders are committed steps is decided by ``_storage/root.py`` (a step-named folder, not a
link, whose metadata is readable and names its step); so a crash at any instant leaves either
the old set of steps or the new one.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import filelock

from orbit_pt._control.collective import Collective
from orbit_pt._format import checksum as _checksum
from orbit_pt._format import coverage as _coverage
from orbit_pt._format import progress as _progress
from orbit_pt._storage import fs as _fs
from orbit_pt._storage import layout as _layout
from orbit_pt._storage import root as _root
from orbit_pt._storage.remote import RemoteRoot
from orbit_pt.errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointSaveError,
    CorruptCheckpointError,
    StepAlreadyExistsError,
    StepNotFoundError,
)
from orbit_pt.metadata import FileMetadata, ItemMetadata, StepMetadata

logger = logging.getLogger(__name__)
_MAIN = threading.main_thread()

WriteItems = Callable[[Path], dict[str, ItemMetadata]]
BuildMetadata = Callable[[dict[str, ItemMetadata], dict[str, FileMetadata]], StepMetadata]


class StepStore:
    """The committed steps under one root, and the only code that changes that root.

    Under torch.distributed only rank 0 touches the root (lock, clean-up, metadata, renames,
    deletions); every rank writes its own part of a step into the temporary folder, and every
    rank's view of the committed steps is updated from what rank 0 did, so that all ranks list
    the same steps.
    """

    def __init__(
        self,
        root: Path,
        *,
        read_only: bool,
        dist: Collective,
        lock_timeout: float = 0.0,
        remote: RemoteRoot | None = None,
    ) -> None:
        self.root = root
        self.read_only = read_only
        self.dist = dist
        # An object-store root: steps are committed there; ``root`` is the local mirror.
        self.remote = remote
        self._remote_seen: dict[int, tuple[str, StepMetadata]] = {}
        self._lock: filelock.BaseFileLock | None = None
        # Held for a whole rescan and around each change of the root and of the view, so that a
        # rescan (reload) never overwrites the view with a listing taken before a commit.
        self._mutex = threading.RLock()
        self._committed: dict[int, StepMetadata] = {}
        # step -> identity of the metadata file it was read from, so that a rescan re-reads a
        # step that another process replaced (a rollback) and no other.
        self._seen: dict[int, _root.Identity | None] = {}
        if not read_only:
            self.dist.run_everywhere(
                "orbit_pt.open", lambda: self._open_writer(lock_timeout), label=f"opening {root}"
            )
            if remote is not None and self.dist.enabled:
                self._check_shared_mirror()
        self.rescan()

    def _check_shared_mirror(self) -> None:
        """Every rank sees the mirror rank 0 uploads from (a rank's part must reach it)."""
        token = None
        if self.dist.is_primary:
            token = os.urandom(8).hex()
            _fs.write_file_atomically(self.root / _layout.MIRROR_TOKEN_FILE, token.encode())
        token = self.dist.broadcast(token)

        def check() -> None:
            path = self.root / _layout.MIRROR_TOKEN_FILE
            try:
                seen = path.read_text()
            except OSError:
                seen = None
            if seen != token:
                raise CheckpointError(
                    f"the local mirror {self.root} of {self.describe()} is not shared with rank "
                    "0 (this rank cannot see the file rank 0 just wrote there). Every rank "
                    "writes its part of a step into the mirror and rank 0 uploads it, so on "
                    "several machines pass storage_options={'cache_dir': PATH} with a folder on "
                    "a filesystem every rank sees"
                )

        self.dist.run_everywhere("orbit_pt.open.mirror", check, label=f"opening {self.describe()}")

    def _open_writer(self, lock_timeout: float) -> None:
        if not self.dist.is_primary:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(self.root / _layout.LOCK_FILE, timeout=lock_timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise CheckpointLockedError(
                f"another CheckpointManager is writing to {self.root} (it holds "
                f"{self.root / _layout.LOCK_FILE}); close it first, or open this one with "
                "CheckpointManagerOptions(read_only=True) to only read"
            ) from None
        self._lock = lock
        if self.remote is not None:
            try:
                self.remote.acquire_lease()
            except BaseException:
                lock.release()
                self._lock = None
                raise
            self.remote.remove_leftovers(self.remote.committed())
        self._remove_leftovers()

    # ------------------------------------------------------------------------------- discovery

    def rescan(self) -> None:
        """Re-read which steps are committed; metadata is re-read only where its file changed.

        Under torch.distributed a writer's view is rank 0's scan, broadcast (collective), so that
        every rank lists the same steps even while the shared filesystem is catching up.
        """
        if not self.dist.enabled:
            with self._mutex:
                self._scan()
            return
        table = None
        if self.dist.is_primary:
            with self._mutex:
                self._scan()
                table = {str(s): m.to_json().decode() for s, m in self._committed.items()}
        table = self.dist.broadcast(table)
        if not self.dist.is_primary:
            found = {
                int(s): StepMetadata.from_json(
                    text.encode(), path=self.step_path(int(s)) / _layout.METADATA_FILE
                )
                for s, text in table.items()
            }
            with self._mutex:
                self._committed = dict(sorted(found.items()))

    def _scan(self) -> None:
        if self.remote is not None:
            found = self.remote.committed(self._remote_seen)
            self._remote_seen = found
            self._committed = {step: meta for step, (_, meta) in found.items()}
            return
        known = {
            step: (seen, self._committed[step])
            for step, seen in self._seen.items()
            if seen is not None and step in self._committed
        }
        self._take(_root.scan_root(self.root, superseded=False, known=known))

    def _take(self, entries: Sequence[_root.RootEntry]) -> None:
        """Make the committed entries of a scan the view (under the mutex)."""
        found: dict[int, StepMetadata] = {}
        seen: dict[int, _root.Identity | None] = {}
        for entry in entries:
            if entry.committed and entry.step is not None and entry.meta is not None:
                found[entry.step], seen[entry.step] = entry.meta, entry.identity
            elif entry.defect in ("bad-metadata", "other-step"):
                # Someone wrote or renamed a step folder by hand: say where, so it can be found.
                logger.warning("ignoring %s: %s", entry.path, entry.reason)
        with self._mutex:
            self._committed = dict(sorted(found.items()))
            self._seen = seen

    def steps(self) -> list[int]:
        if self.read_only:
            self.rescan()  # another process writes this root: look again every time
        with self._mutex:
            return list(self._committed)

    def committed(self) -> dict[int, StepMetadata]:
        if self.read_only:
            self.rescan()
        with self._mutex:
            return dict(self._committed)

    def metadata(self, step: int | None) -> StepMetadata:
        if self.read_only:
            self.rescan()
        with self._mutex:
            meta = self._committed.get(step) if step is not None else None
            if meta is None:
                raise StepNotFoundError(step, self.root, list(self._committed))
        return meta

    def step_path(self, step: int) -> Path:
        return self.root / _layout.step_name(step)

    def describe(self, step: int | None = None) -> str:
        """Where the root (or ``step``) is, for messages: the URL of an object-store root."""
        if self.remote is not None:
            return self.remote.describe(step)
        return str(self.root if step is None else self.step_path(step))

    def publish_root_file(self, name: str) -> None:
        """Copy the root file ``name`` (the retention record) to the object store, if any."""
        if self.remote is None:
            return
        try:
            self.remote.put_root_file(self.root, name)
        except Exception as exc:  # a convenience for `orbit-pt ls`; the step is committed
            logger.warning("could not upload %s to %s: %s", name, self.describe(), exc)

    def fetch(self, step: int, meta: StepMetadata, items: Iterable[str]) -> None:
        """Make the files of ``items`` of an object-store step local (in the mirror).

        Files already in the mirror with their recorded size are not downloaded again. Safe on
        several ranks sharing the mirror: each download lands under a name of its own and is
        renamed into place.
        """
        if self.remote is None:
            return
        base = self.step_path(step)
        prefixes = tuple(f"{item}/" for item in items)
        wanted = [
            rel
            for rel, f in meta.files.items()
            if rel.startswith(prefixes) and not _fs.has_size(base / rel, f.size)
        ]
        if wanted:
            logger.info(
                "downloading %d file(s) of step %d from %s into %s",
                len(wanted),
                step,
                self.remote.describe(step),
                base,
            )
            self.remote.download(step, wanted, base)

    def check_files(
        self, step: int, meta: StepMetadata, *, checksums_of: Iterable[str] = ()
    ) -> None:
        """Every file the metadata lists is a regular file with its recorded size.

        Files of the items named in ``checksums_of`` are also read in full and checked against
        their recorded checksums. The first problem raises :class:`CorruptCheckpointError`.
        """
        base = self.step_path(step)
        verified = tuple(f"{item}/" for item in checksums_of)
        for check in _root.check_listed_files(
            base, meta.files, checksums=lambda rel: rel.startswith(verified)
        ):
            if check.problem is not None:
                raise CorruptCheckpointError(
                    f"step {step} is damaged: {check.path} {check.detail}; restore another step"
                )

    # ---------------------------------------------------------------------------------- commit

    def commit(
        self,
        step: int,
        write_items: WriteItems,
        build_metadata: BuildMetadata,
        *,
        dist: Collective | None = None,
    ) -> None:
        """Write a step through ``write_items`` (on every rank) and commit it atomically.

        Collective under torch.distributed: every rank calls it for the same step. Three
        agreements -- prepare (rank 0 makes the temporary folder), write (every rank writes its
        part and reports its checksums and byte ranges), finish (rank 0 checks that the ranks'
        ranges cover every piecewise-written file exactly once and writes the metadata) -- then
        rank 0 renames the folder into place and tells every rank the outcome. A failure on any
        rank fails the save on every rank, names the rank, and commits nothing.
        """
        dist = dist if dist is not None else self.dist
        tmp = self.root / _layout.tmp_name(step)
        started = time.perf_counter()
        primary = dist.is_primary
        try:
            dist.run_everywhere(
                "orbit_pt.save.prepare",
                lambda: self._prepare(step, tmp, primary=primary),
                label=f"preparing step {step}",
            )
            with _progress.showing(f"saving step {step}", primary=primary):
                (written, _), reports = dist.agree(
                    "orbit_pt.save.write",
                    lambda: self._write(tmp, write_items),
                    label=f"writing step {step}",
                    share=lambda result: result[1],
                )
            meta, _ = dist.agree(
                "orbit_pt.save.finish",
                lambda: self._finalize(step, tmp, written, reports, build_metadata, primary),
                label=f"finishing step {step}",
            )
        except StepAlreadyExistsError:
            raise  # nothing was written; the user must move the folder out of the way
        except BaseException as exc:
            if primary:
                _fs.remove_tree(tmp)
            if not isinstance(exc, Exception) and threading.current_thread() is _MAIN:
                raise  # KeyboardInterrupt: the peers were told; stop as the user asked
            raise CheckpointSaveError(step, tmp, _reason(exc)) from exc
        # The commit point: rank 0 alone renames, then every rank learns the outcome from it.
        outcome: dict[str, object] | None = None
        if primary:
            assert meta is not None
            try:
                remote = self.remote
                if remote is not None:
                    # Replaced steps go first (their objects have the new step's keys), then
                    # the files upload outside the mutex, so that readers keep answering.
                    with self._mutex:
                        superseded = self._supersede_from(step)
                    written_meta = meta
                    self._upload(step, lambda: remote.upload_files(step, tmp, written_meta))
                with self._mutex:
                    if remote is None:
                        superseded = self._supersede_from(step)
                    else:  # the commit point: the marker object
                        self._upload(step, lambda: remote.put_marker(step, tmp))
                    _fs.replace_durably(tmp, self.step_path(step))  # the commit point
                    self._record(step, meta, superseded)
                outcome = {"meta": meta.to_json().decode(), "superseded": superseded}
            except BaseException as exc:
                _fs.remove_tree(tmp)  # the rename did not happen: never leave a half step behind
                if self.remote is not None:
                    self._rescan_after_failure()
                outcome = {"error": _reason(exc)}
                dist.broadcast(outcome)
                if not isinstance(exc, Exception):
                    raise
                raise CheckpointSaveError(
                    step, tmp, f"committing on rank(s) [0]: {_reason(exc)}"
                ) from exc
        outcome = dist.broadcast(outcome)
        assert outcome is not None
        if "error" in outcome:
            raise CheckpointSaveError(step, tmp, f"committing on rank(s) [0]: {outcome['error']}")
        if not primary:
            meta = StepMetadata.from_json(
                str(outcome["meta"]).encode(), path=self.step_path(step) / _layout.METADATA_FILE
            )
            victims = outcome["superseded"]
            assert isinstance(victims, list)
            with self._mutex:
                self._record(step, meta, victims)
        if primary:
            assert meta is not None
            seconds = time.perf_counter() - started
            size = sum(f.size for f in meta.files.values())
            logger.info(
                "committed step %d to %s: %d files, %.3f GB in %.2f s (%.2f GB/s)",
                step,
                self.step_path(step),
                len(meta.files),
                size / 1e9,
                seconds,
                size / 1e9 / max(seconds, 1e-9),
            )

    def _rescan_after_failure(self) -> None:
        """After a failed commit, take the view from the store: whatever failed, it is right."""
        try:
            with self._mutex:
                self._scan()
        except Exception as exc:  # the store is unreachable: the next reload() catches up
            logger.warning("could not list %s after a failed save: %s", self.describe(), exc)

    def _record(self, step: int, meta: StepMetadata, superseded: list[int]) -> None:
        for victim in superseded:
            self._committed.pop(victim, None)
            self._seen.pop(victim, None)
            self._remote_seen.pop(victim, None)
        self._committed[step] = meta
        self._committed = dict(sorted(self._committed.items()))
        self._seen[step] = _root.metadata_identity(self.step_path(step))

    def _upload(self, step: int, upload: Callable[[], None]) -> None:
        """Run an upload of ``step``; on failure remove what was uploaded, then re-raise."""
        assert self.remote is not None
        try:
            upload()
        except BaseException:
            try:
                self.remote.remove_step_objects(step)
            except Exception as exc:  # the next writer's clean-up at open removes them
                logger.warning(
                    "could not remove the uploaded objects of uncommitted step %d from %s: %s",
                    step,
                    self.remote.describe(step),
                    exc,
                )
            raise

    def _prepare(self, step: int, tmp: Path, *, primary: bool) -> None:
        if not primary:
            return
        final = self.step_path(step)
        # lexists: a link (even a dangling one) under the step's name is in the way too; the
        # rename would silently replace it.
        if os.path.lexists(final) and step not in self._committed:
            entry = _root.step_entry(self.root, step)
            why = entry.reason if entry is not None and entry.reason else "not committed"
            raise StepAlreadyExistsError(
                f"{final} exists but is not a committed orbit_pt step ({why}); move it out of "
                f"{self.root} and save again"
            )
        _fs.fresh_folder(tmp)

    def _write(self, tmp: Path, write_items: WriteItems) -> tuple[dict[str, ItemMetadata], dict]:
        """Write this rank's part; report the checksums it computed and the ranges it wrote."""
        with _checksum.recording() as checksums, _coverage.recording() as ranges:
            written = write_items(tmp)
        # Every rank fsyncs what it can see: on a shared filesystem that flushes the pages this
        # rank wrote, which rank 0 could not flush for it.
        _fs.fsync_tree(tmp)
        base = tmp.absolute()

        def relative(path: str) -> str | None:
            try:
                return Path(path).relative_to(base).as_posix()
            except ValueError:
                return None  # outside the step: not ours to check

        report = {
            "checksums": {relative(p): c for p, c in checksums.items() if relative(p)},
            "ranges": {
                relative(p): _coverage.intervals(r) for p, r in ranges.items() if relative(p)
            },
        }
        return written, report

    def _finalize(
        self,
        step: int,
        tmp: Path,
        written: dict[str, ItemMetadata],
        reports: list[dict],
        build: BuildMetadata,
        primary: bool,
    ) -> StepMetadata | None:
        """Rank 0: check the ranks' writes, then write the metadata (not yet the commit)."""
        if not primary:
            return None
        recorded: dict[str, str] = {}
        by_file: dict[str, dict[int, list[list[int]]]] = {}
        for rank, report in enumerate(reports):
            recorded.update(report["checksums"])
            for name, intervals in report["ranges"].items():
                by_file.setdefault(name, {})[rank] = intervals
        files = {}
        for rel in _fs.iter_files(tmp):
            name = rel.as_posix()
            size = (tmp / rel).stat().st_size
            wrong = _coverage.problems(size, by_file.pop(name, {})) if name in by_file else []
            if wrong:
                raise CheckpointError(
                    f"{name} of step {step} was not written exactly once by the ranks: "
                    f"{'; '.join(wrong[:5])}; this is a bug in the handler that wrote it (its "
                    "ranks disagree about who writes which rows), please report it"
                )
            # Small files and files written piecewise by several ranks are read back once.
            checksum = recorded.get(name) or _checksum.of_file(tmp / rel)
            files[name] = FileMetadata(size=size, checksum=checksum)
        if by_file:
            raise CheckpointError(
                f"step {step}: ranks reported writing {sorted(by_file)}, which are not in "
                f"{tmp}; a handler wrote outside its folder or deleted a file"
            )
        meta = build(written, files)
        _fs.write_file_durably(tmp / _layout.METADATA_FILE, meta.to_json())
        _fs.fsync_path(tmp)
        return meta

    def _supersede_from(self, step: int) -> list[int]:
        """Move ``step`` and every newer committed step into ``superseded/``, newest first.

        Newest first, so that a crash in the middle leaves a prefix of the old timeline: the
        latest step is then some old step, never a gap, and every moved step is intact.
        """
        victims = sorted((s for s in self._committed if s >= step), reverse=True)
        if not victims:
            return victims
        if self.remote is not None:
            logger.warning(
                "saving step %d in %s replaces committed step(s) %s: copying them to %s/ and "
                "deleting them (delete them there when you no longer need them)",
                step,
                self.remote.url,
                victims,
                _layout.SUPERSEDED_DIR,
            )
            self.remote.supersede(victims)
            for victim in victims:  # no longer steps; their mirrored files go too
                self._committed.pop(victim, None)
                self._remote_seen.pop(victim, None)
                _fs.remove_tree(self.step_path(victim))
            return victims
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
            # A coarse clock can repeat a stamp; renaming onto an existing folder would fail.
            for n in itertools.count():
                destination = folder / _layout.superseded_name(victim, stamp, n)
                if not os.path.lexists(destination):
                    break
            os.replace(self.step_path(victim), destination)
        _fs.fsync_path(folder)
        _fs.fsync_path(self.root)
        return victims

    # ---------------------------------------------------------------------------------- delete

    def delete(self, steps: list[int], *, dist: Collective | None = None) -> None:
        """Delete committed steps: each is renamed out of the step namespace, then removed.

        Collective under torch.distributed (rank 0 deletes, every rank updates its view).
        """

        dist = dist if dist is not None else self.dist
        deleted: list[int] = []

        def remove() -> None:
            if not dist.is_primary:
                return
            for step in steps:
                doomed = self.root / (_layout.step_name(step) + _layout.DELETING_SUFFIX)
                _fs.remove_tree(doomed)
                with self._mutex:
                    if self.remote is not None:
                        self.remote.remove_step_objects(step)  # marker first: no step now
                        self._remote_seen.pop(step, None)
                    if os.path.lexists(self.step_path(step)) or self.remote is None:
                        os.replace(self.step_path(step), doomed)
                    self._committed.pop(step, None)
                _fs.fsync_path(self.root)
                deleted.append(step)  # out of the step namespace: no longer a step
                _fs.remove_tree(doomed)

        try:
            dist.run_everywhere("orbit_pt.delete", remove, label=f"deleting steps {steps}")
        finally:
            gone = dist.broadcast(deleted)
            with self._mutex:
                for step in gone:
                    self._committed.pop(step, None)

    # ------------------------------------------------------------------------------- lifecycle

    def _remove_leftovers(self) -> None:
        """Remove temporary and half-deleted folders that a crashed writer left behind.

        In an object-store root's mirror, also the mirrored steps the store no longer holds.
        """
        removed = []
        remote = set(self.remote.committed()) if self.remote is not None else None
        for entry in _root.scan_root(self.root, superseded=False):
            stale = remote is not None and entry.committed and entry.step not in remote
            if entry.kind in ("temporary", "deleting") or stale:
                _fs.remove_tree(entry.path)
                removed.append(entry.name)
        if removed:
            _fs.fsync_path(self.root)
            logger.info("removed %d leftover folder(s) in %s: %s", len(removed), self.root, removed)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.release_lease()
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return text if isinstance(exc, CheckpointError) and text else f"{type(exc).__name__}: {text}"
