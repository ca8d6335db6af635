"""The root folder: the view of its committed steps, the atomic commit, superseding and deletion.

Commit protocol (docs/format.md): write the step into ``step_N.orbit-tmp/``, fsync every file and
folder in it, write ``_CHECKPOINT_METADATA`` last and fsync it and the folder, move any steps the
new one replaces into ``superseded/``, ``os.replace`` the folder to ``step_N/``, fsync the root.
Which folders are committed steps is decided by ``_storage/root.py`` (a step-named folder, not a
link, whose metadata is readable and names its step); so a crash at any instant leaves either
the old set of steps or the new one.

Errors (docs/reliability.md): the rename is the commit point, so an error after it (the root's
fsync) leaves the step committed and raises :class:`~orbit_pt.errors.StepNotDurableError`; an
error before it raises :class:`~orbit_pt.errors.CheckpointSaveError`. After any error while
committing, superseding or deleting, the view of the committed steps is re-read from the root
before the error is raised, and the error names the committed steps: the view never lists a step
that the root does not hold, or misses one that it does.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import filelock

from orbit_pt._control.collective import Collective
from orbit_pt._format import checksum as _checksum
from orbit_pt._format import coverage as _coverage
from orbit_pt._format import progress as _progress
from orbit_pt._format.remote_files import RemoteFile
from orbit_pt._storage import fs as _fs
from orbit_pt._storage import layout as _layout
from orbit_pt._storage import root as _root
from orbit_pt._storage import scattered as _scattered
from orbit_pt._storage import streaming as _streaming
from orbit_pt._storage.remote import RemoteRoot
from orbit_pt.errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointSaveError,
    CorruptCheckpointError,
    StepAlreadyExistsError,
    StepNotDurableError,
    StepNotFoundError,
)
from orbit_pt.metadata import FileMetadata, ItemMetadata, StepMetadata

logger = logging.getLogger(__name__)
_MAIN = threading.main_thread()
# Foreign step-named entries that someone should look at (see _storage/root.py's Defect).
_WORTH_A_WARNING = ("bad-metadata", "other-step", "unreadable")

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
        # Ranks that do not all see one mirror (several machines) each write their part of a
        # step into a folder of their own and upload it themselves (_storage/scattered.py).
        self.scattered = False
        self._write_root = root
        self._lock: filelock.BaseFileLock | None = None
        # Held for a whole rescan and around each change of the root and of the view, so that a
        # rescan (reload) never overwrites the view with a listing taken before a commit.
        self._mutex = threading.RLock()
        self._committed: dict[int, StepMetadata] = {}
        # step -> identity of the metadata file it was read from, so that a rescan re-reads a
        # step that another process replaced (a rollback) and no other.
        self._seen: dict[int, _root.Identity | None] = {}
        self._warned: set[tuple[str, str]] = set()  # (entry, reason) already logged
        # Deleted steps' files are removed off the caller's path: once a step is renamed out
        # of the step namespace (and that is flushed) it is gone, whatever happens to its files.
        self._removals: dict[Path, Future[None]] = {}
        self._remover: ThreadPoolExecutor | None = None
        try:
            if not read_only:
                self.dist.run_everywhere(
                    "orbit_pt.open",
                    lambda: self._open_writer(lock_timeout),
                    label=f"opening {root}",
                )
                if remote is not None and self.dist.enabled:
                    self._find_shared_mirror()
            self.rescan()
        except BaseException:
            # Released here and now, not when the garbage collector finds the lock: the
            # exception's traceback keeps this object alive, and a retry must not be refused.
            self.close()
            raise

    def _find_shared_mirror(self) -> None:
        """Whether every rank sees the mirror rank 0 writes; if not, each rank gets its own.

        With one mirror (one machine, or a shared filesystem) the ranks write a step together
        into it and rank 0 uploads the files, which stay there as a cache. Without, every rank
        writes into a private folder and uploads its own bytes (_storage/scattered.py).
        """
        token = None
        if self.dist.is_primary:
            token = os.urandom(8).hex()
            _fs.write_file_atomically(self.root / _layout.MIRROR_TOKEN_FILE, token.encode())
        token = self.dist.broadcast(token)

        def sees_it() -> bool:
            try:
                return bool((self.root / _layout.MIRROR_TOKEN_FILE).read_text() == token)
            except OSError:
                return False

        _, seen = self.dist.agree(
            "orbit_pt.open.mirror", sees_it, label=f"opening {self.describe()}", share=bool
        )
        if all(seen):
            return
        self.scattered = True
        self._write_root = _scattered.private_root(self.root, self.dist.rank)

        def fresh_private_folder() -> None:
            # Only uncommitted parts of steps are ever in it: a crashed save's are removed.
            _fs.remove_tree(self._write_root)
            self._write_root.mkdir(parents=True)

        self.dist.run_everywhere(
            "orbit_pt.open.private", fresh_private_folder, label=f"opening {self.describe()}"
        )
        if self.dist.is_primary:
            logger.info(
                "the ranks of %s do not share the mirror %s (rank(s) %s cannot see it): each "
                "rank writes its part of a step into a folder of its own and uploads it",
                self.describe(),
                self.root,
                [rank for rank, ok in enumerate(seen) if not ok],
            )

    def _open_writer(self, lock_timeout: float) -> None:
        """Rank 0: take the root's lock (and an object-store root's lease), then clean up.

        Whatever fails after the lock is taken, :meth:`close` (called by ``__init__``) releases it.
        """
        if not self.dist.is_primary:
            return
        lock_path = self.root / _layout.LOCK_FILE
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the checkpoint root {self.root}: {exc}; pass a folder this "
                "process may write, or open it with CheckpointManagerOptions(read_only=True) "
                "to only read"
            ) from exc
        if lock_path.is_symlink():
            # The lock is opened for writing: through a link that would be a file anywhere.
            raise CheckpointError(
                f"{lock_path} is a symbolic link; orbit_pt never writes through one. Remove "
                "it (no writer holds a lock through a link) and open the root again"
            )
        lock = filelock.FileLock(lock_path, timeout=lock_timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise CheckpointLockedError(
                f"another CheckpointManager is writing to {self.root} (it holds "
                f"{lock_path}); close it first, or open this one with "
                "CheckpointManagerOptions(read_only=True) to only read"
            ) from None
        except OSError as exc:
            raise CheckpointError(
                f"cannot take the lock {lock_path} of {self.root}: {exc}; the root must be a "
                "folder this process may write, or open it with "
                "CheckpointManagerOptions(read_only=True) to only read"
            ) from exc
        self._lock = lock
        if self.remote is not None:
            self.remote.acquire_lease()
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
        shared: dict[str, Any] | None = None
        failure: Exception | None = None
        if self.dist.is_primary:
            with self._mutex:
                try:
                    self._scan()
                    shared = {"view": self._table()}
                except Exception as exc:  # the other ranks wait in the broadcast: tell them
                    failure = exc
                    shared = {"error": _reason(exc)}
        shared = self.dist.broadcast(shared)
        assert shared is not None
        if failure is not None:
            raise failure
        if "error" in shared:
            raise CheckpointError(f"listing {self.describe()} on rank 0 failed: {shared['error']}")
        self._take_table(shared["view"])

    def _table(self) -> dict[str, str]:
        """The view as JSON-able data, for rank 0 to broadcast (under the mutex)."""
        return {str(s): m.to_json().decode() for s, m in self._committed.items()}

    def _take_table(self, table: dict[str, str] | None) -> None:
        """On a rank other than 0: make rank 0's broadcast view (:meth:`_table`) this rank's."""
        if self.dist.is_primary or table is None:
            return
        found = {
            int(s): StepMetadata.from_json(
                text.encode(), path=self.step_path(int(s)) / _layout.METADATA_FILE
            )
            for s, text in table.items()
        }
        with self._mutex:
            self._committed = dict(sorted(found.items()))

    def _rederive(self, gone: Iterable[int] = ()) -> list[int] | None:
        """After a failure that may have changed the root: take the view from it again.

        Rank 0 only. The steps in ``gone`` are known to have left the step namespace and are
        dropped first, so the view is right about them even if the root cannot be listed now.
        Returns the committed steps, or None when the root could not be listed (then the next
        :meth:`rescan` catches up).
        """
        with self._mutex:
            for step in gone:
                self._forget(step)
            try:
                self._scan()
            except Exception as exc:
                logger.warning(
                    "could not list %s again after a failure: %s; call reload() to see which "
                    "steps are committed",
                    self.describe(),
                    exc,
                )
                return None
            return list(self._committed)

    def _forget(self, step: int) -> None:
        """Drop ``step`` from the view (under the mutex)."""
        self._committed.pop(step, None)
        self._seen.pop(step, None)
        self._remote_seen.pop(step, None)

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
        seen_once = self._warned
        for entry in entries:
            if entry.committed and entry.step is not None and entry.meta is not None:
                found[entry.step], seen[entry.step] = entry.meta, entry.identity
            elif entry.defect in _WORTH_A_WARNING and (entry.name, entry.reason) not in seen_once:
                # Someone wrote or renamed a step folder by hand, or another user's folder is
                # in the root: say where (once per manager: a reader scans at every question),
                # so it can be found; it is skipped, never fatal.
                seen_once.add((entry.name, entry.reason))
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

    def fetch(
        self,
        step: int,
        meta: StepMetadata,
        items: Iterable[str],
        *,
        by_range: Iterable[str],
        checked_here: Container[str] = (),
    ) -> dict[Path, RemoteFile]:
        """Make the files of ``items`` of an object-store step readable by this restore.

        Files already in the mirror with their recorded size are read from there. Of the
        others, the ``.safetensors`` files of the items in ``by_range`` (whose handlers read by
        range) stay in the store: the returned mapping (mirror path ->
        :class:`~orbit_pt._format.remote_files.RemoteFile`) is what a restore reads them
        through, only the bytes it needs; nothing of them is written into the mirror, so the
        mirror never holds a partial file. Every other file (small: JSON, msgpack; and those
        in ``checked_here``, which this rank checks in full) is downloaded whole into the
        mirror.

        Safe on several ranks sharing the mirror: each download lands under a name of its own
        and is renamed into place. A local root returns ``{}``.
        """
        if self.remote is None:
            return {}
        base = self.step_path(step)
        prefixes = tuple(f"{item}/" for item in items)
        wanted = {
            rel: f.size
            for rel, f in meta.files.items()
            if rel.startswith(prefixes) and not _fs.has_size(base / rel, f.size)
        }
        ranged = tuple(f"{item}/" for item in by_range)
        remote = {
            rel: size
            for rel, size in wanted.items()
            if rel.startswith(ranged) and rel.endswith(".safetensors") and rel not in checked_here
        }
        whole = sorted(rel for rel in wanted if rel not in remote)
        if whole:
            logger.info(
                "downloading %d file(s) of step %d from %s into %s",
                len(whole),
                step,
                self.remote.describe(step),
                base,
            )
            self.remote.download(step, whole, base)
        if not remote:
            return {}
        opened = self.remote.open_files(step, remote)
        for rel in remote:
            # The item's folders, empty of these files: a handler may list them.
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
        logger.info(
            "reading %d file(s) of step %d by range from %s (only the bytes this rank restores)",
            len(opened),
            step,
            self.remote.describe(step),
        )
        return {base / rel: file for rel, file in opened.items()}

    def check_files(
        self,
        step: int,
        meta: StepMetadata,
        *,
        items: Iterable[str],
        checksums_of: Iterable[str] = (),
        checked_elsewhere: Container[str] = (),
        remote: Iterable[Path] = (),
    ) -> None:
        """Every file the metadata lists is a regular file with its recorded size.

        Files of the items named in ``checksums_of`` are also read in full and checked against
        their recorded checksums, except those in ``checked_elsewhere`` (another rank checks
        them in the same agreement, :mod:`orbit_pt._storage.verifiers`). The first problem
        raises :class:`CorruptCheckpointError`.
        In the mirror of an object-store root only the files of ``items`` (those
        :meth:`fetch` made local) are checked, and not the ``remote`` ones, which are read from
        the store (:meth:`fetch` checked their sizes there).
        """
        base = self.step_path(step)
        verified = tuple(f"{item}/" for item in checksums_of)
        files = meta.files
        if self.remote is not None:
            fetched = tuple(f"{item}/" for item in items)
            elsewhere = {path.relative_to(base).as_posix() for path in remote}
            files = {
                rel: f
                for rel, f in files.items()
                if rel.startswith(fetched) and rel not in elsewhere
            }
        for check in _root.check_listed_files(
            base,
            files,
            checksums=lambda rel: rel.startswith(verified) and rel not in checked_elsewhere,
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
        tmp = self._write_root / _layout.tmp_name(step)
        started = time.perf_counter()
        primary = dist.is_primary
        own = self.scattered  # every rank writes into, and cleans up, a folder of its own
        # Rank 0 of a shared mirror uploads the files: it starts while they are written.
        stream = (
            _streaming.StreamingUpload(self.remote, step, tmp)
            if self.remote is not None and primary and not own
            else None
        )
        try:
            dist.run_everywhere(
                "orbit_pt.save.prepare",
                lambda: self._prepare(step, tmp, primary=primary),
                label=f"preparing step {step}",
            )
            with (
                _progress.showing(f"saving step {step}", primary=primary),
                stream.watching() if stream is not None else contextlib.nullcontext(),
            ):
                (written, _), reports = dist.agree(
                    "orbit_pt.save.write",
                    lambda: self._write(tmp, write_items),
                    label=f"writing step {step}",
                    share=lambda result: result[1],
                    to_primary=True,  # the reports are rank 0's to check: W values, not W²
                )
            (meta, plan), _ = dist.agree(
                "orbit_pt.save.finish",
                lambda: self._finalize(step, tmp, written, reports, build_metadata, primary),
                label=f"finishing step {step}",
            )
        except StepAlreadyExistsError:
            raise  # nothing was written; the user must move the folder out of the way
        except BaseException as exc:
            if stream is not None:
                stream.abort()
            if primary or own:
                self._discard(tmp)
            if not isinstance(exc, Exception) and threading.current_thread() is _MAIN:
                raise  # KeyboardInterrupt: the peers were told; stop as the user asked
            raise CheckpointSaveError(step, tmp, _reason(exc)) from exc
        # The commit point: rank 0 alone commits, then every rank learns the outcome from it.
        outcome: dict[str, Any] | None = None
        failure: BaseException | None = None
        if own:
            outcome, failure = self._publish_scattered(step, tmp, meta, plan, dist)
        elif primary:
            assert meta is not None
            outcome, failure = self._publish(step, tmp, meta, stream)
        outcome = dist.broadcast(outcome)
        assert outcome is not None
        if not primary:
            self._take_outcome(step, outcome)
        if failure is not None and not isinstance(failure, Exception):
            raise failure  # KeyboardInterrupt: the peers were told; stop as the user asked
        if "error" in outcome:
            raise CheckpointSaveError(
                step,
                tmp,
                f"committing on rank(s) [0]: {outcome['error']}",
                superseded=outcome["moved"],
                committed=outcome["steps"],
            ) from failure
        if "not_durable" in outcome:
            raise StepNotDurableError(
                step,
                self.step_path(step),
                str(outcome["not_durable"]),
                superseded=outcome["superseded"],
                committed=outcome["steps"],
            ) from failure
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

    def _publish(
        self, step: int, tmp: Path, meta: StepMetadata, stream: _streaming.StreamingUpload | None
    ) -> tuple[dict[str, Any], BaseException | None]:
        """Rank 0: move the steps ``step`` replaces aside, commit it, and make that durable.

        Returns the outcome every rank acts on (JSON-able) and what failed it (None when
        nothing did); raises nothing. After a failure the view is re-read from the root, and
        the outcome says exactly what is committed now: ``step`` itself when only making the
        commit durable failed (``not_durable``), else which replaced steps had already been
        moved into ``superseded/`` (``moved``) -- and the committed steps (``steps``; None when
        the root could not be listed).
        """
        final = self.step_path(step)
        moved: list[int] = []
        superseded: list[int] = []
        committed = False
        try:
            remote = self.remote
            if remote is None:
                with self._mutex:
                    superseded = self._supersede_from(step, moved)
                    os.replace(tmp, final)  # the commit point
                    committed = True
                    self._record(step, meta, superseded)
                # Apart from the commit: a failure here leaves the step committed, not durable.
                _fs.fsync_path(self.root)
            else:
                # Replaced steps go first (their objects have the new step's keys), then the
                # files upload outside the mutex, so that readers keep answering. Streamed
                # files' parts are mostly sent already; nothing is visible until completed.
                with self._mutex:
                    superseded = self._supersede_from(step, moved)
                assert stream is not None  # rank 0 of a shared mirror streams (commit)
                self._upload(step, lambda: stream.upload(meta))
                with self._mutex:
                    self._upload(step, lambda: remote.put_marker(step, tmp))  # the commit point
                    committed = True
                    self._keep_in_mirror(step, tmp, final)
                    self._record(step, meta, superseded)
            return {"meta": meta.to_json().decode(), "superseded": superseded}, None
        except BaseException as exc:
            failure = exc
        if not committed:
            if stream is not None:
                stream.abort()  # parts sent for nothing: no incomplete upload is left
            self._discard(tmp)  # the commit did not happen: never leave a half step behind
        return self._failed_outcome(meta, committed, superseded, moved, failure), failure

    def _failed_outcome(
        self,
        meta: StepMetadata,
        committed: bool,
        superseded: list[int],
        moved: list[int],
        failure: BaseException,
    ) -> dict[str, Any]:
        """What every rank learns after a failed publish: re-derived from the root."""
        steps = self._rederive(moved)
        with self._mutex:
            view = self._table() if steps is not None else None
        if committed:
            outcome: dict[str, Any] = {
                "meta": meta.to_json().decode(),
                "superseded": superseded,
                "not_durable": _reason(failure),
            }
        else:
            outcome = {"error": _reason(failure), "moved": moved}
        outcome.update(steps=steps, view=view)
        return outcome

    def _publish_scattered(
        self,
        step: int,
        tmp: Path,
        meta: StepMetadata | None,
        plan_doc: dict[str, Any] | None,
        dist: Collective,
    ) -> tuple[dict[str, Any] | None, BaseException | None]:
        """Every rank: upload its own part of ``step``, then rank 0 commits (scattered.py).

        Returns rank 0's outcome and failure as :meth:`_publish` does (None on other ranks);
        raises nothing. Each rank removes its folder afterwards: its files are parts of files,
        no cache.
        """
        remote = self.remote
        assert remote is not None
        primary = dist.is_primary
        moved: list[int] = []
        superseded: list[int] = []
        committed = False
        failure: BaseException | None = None
        plan: _scattered.UploadPlan | None = None
        started: dict[str, Any] | None = None
        if primary:
            assert meta is not None
            assert plan_doc is not None
            try:
                plan = _scattered.UploadPlan.from_json(plan_doc)
                with self._mutex:
                    superseded = self._supersede_from(step, moved)
                remote.check_lease()
                for rel in plan.split:
                    plan.upload_ids[rel] = remote.store.start_upload(remote.step_key(step, rel))
                started = {"plan": plan.to_json()}
            except BaseException as exc:
                failure = exc
                started = {"error": _reason(exc)}
        started = dist.broadcast(started)
        assert started is not None
        if "plan" in started:
            shared = _scattered.UploadPlan.from_json(started["plan"])
            rank = dist.rank
            try:
                _, own = dist.agree(
                    "orbit_pt.save.upload",
                    lambda: _scattered.upload_own(remote, step, tmp, shared, rank),
                    label=f"uploading step {step}",
                    share=lambda records: records,
                )
                mixed: list[Any] = [[]]
                if shared.has_mixed_parts:
                    _, mixed = dist.agree(
                        "orbit_pt.save.upload.mixed",
                        lambda: _scattered.upload_mixed(remote, step, tmp, shared, rank),
                        label=f"uploading the shared parts of step {step}",
                        share=lambda records: records,
                    )
                if primary:
                    assert meta is not None
                    records = [r for rank_records in (*own, *mixed) for r in rank_records]
                    _scattered.complete(remote, step, shared, records)
                    with self._mutex:
                        remote.put_marker(step, tmp)  # the commit point
                        committed = True
                        self._record(step, meta, superseded)
            except BaseException as exc:
                if failure is None:
                    failure = exc
        self._discard(tmp)
        if not primary:
            # An Exception is told to every rank in the outcome; a KeyboardInterrupt is re-raised.
            return None, failure
        assert meta is not None
        if failure is None:
            return {"meta": meta.to_json().decode(), "superseded": superseded}, None
        if not committed:
            if plan is not None:
                _scattered.abort(remote, step, plan)
            try:
                remote.remove_step_objects(step)
            except Exception as exc:  # the next writer's clean-up at open removes them
                logger.warning(
                    "could not remove the uploaded objects of uncommitted step %d from %s: %s",
                    step,
                    remote.describe(step),
                    exc,
                )
        return self._failed_outcome(meta, committed, superseded, moved, failure), failure

    def _take_outcome(self, step: int, outcome: dict[str, Any]) -> None:
        """On a rank other than 0: update the view from the outcome of rank 0's commit."""
        with self._mutex:
            for victim in outcome.get("moved", ()):
                self._forget(victim)
            if "meta" in outcome:
                meta = StepMetadata.from_json(
                    str(outcome["meta"]).encode(),
                    path=self.step_path(step) / _layout.METADATA_FILE,
                )
                self._record(step, meta, list(outcome["superseded"]))
        self._take_table(outcome.get("view"))

    def _keep_in_mirror(self, step: int, tmp: Path, final: Path) -> None:
        """An object-store step is committed: keep its files in the local mirror, a cache.

        A failure only costs a download when the step is restored, so it is logged.
        """
        try:
            _fs.replace_durably(tmp, final)
        except OSError as exc:
            logger.warning(
                "step %d is committed to %s, but keeping its files in the local mirror %s "
                "failed: %s; they are downloaded when the step is restored",
                step,
                self.describe(step),
                final,
                exc,
            )
            self._discard(tmp)

    def _discard(self, tmp: Path) -> None:
        """Remove the temporary folder of a step that was not committed; never raise.

        Raising would hide the save's own error. What is left is not a step; a writer removes
        it when it opens the root, and the next save of that step starts by removing it.
        """
        try:
            _fs.remove_tree(tmp)
        except OSError as exc:
            logger.warning(
                "could not remove %s, which holds nothing committed: %s; the next writer to "
                "open %s removes it",
                tmp,
                exc,
                self.root,
            )

    def _record(self, step: int, meta: StepMetadata, superseded: list[int]) -> None:
        for victim in superseded:
            self._forget(victim)
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
        if self.scattered and not primary:
            _fs.fresh_folder(tmp)
            return
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

        segments = {relative(p): _coverage.segments(r) for p, r in ranges.items() if relative(p)}
        report: dict[str, Any] = {
            "checksums": {relative(p): c for p, c in checksums.items() if relative(p)}
        }
        if not self.scattered:
            # A few numbers per file, not every range: rank 0 gets W values per file, never
            # W x tensors (see _format/coverage.py).
            report["summaries"] = {
                rel: _coverage.summary((tmp / rel).stat().st_size, segs)
                for rel, segs in segments.items()
                if rel is not None
            }
            return written, report
        report["segments"] = segments  # rank 0 plans who uploads which bytes from them
        if self.scattered:
            # Nobody else sees this folder: say what is in it, with the checksum of every
            # file that is whole here (small files a handler wrote without recording one).
            files = {}
            for rel in _fs.iter_files(tmp):
                name = rel.as_posix()
                checksum = report["checksums"].get(name)
                if checksum is None and name not in segments:
                    checksum = _checksum.of_file(tmp / rel)
                files[name] = [(tmp / rel).stat().st_size, checksum]
            report["files"] = files
        return written, report

    def _finalize(
        self,
        step: int,
        tmp: Path,
        written: dict[str, ItemMetadata],
        reports: list[dict],
        build: BuildMetadata,
        primary: bool,
    ) -> tuple[StepMetadata | None, dict[str, Any] | None]:
        """Rank 0: check the ranks' writes, then write the metadata (not yet the commit).

        Returns the metadata and, when the ranks wrote into folders of their own, the plan of
        who uploads what (JSON).
        """
        if not primary:
            return None, None
        recorded: dict[str, str] = {}
        by_file: dict[str, dict[int, _coverage.Segments]] = {}
        summaries: dict[str, dict[int, list[Any]]] = {}
        for rank, report in enumerate(reports):
            recorded.update(report["checksums"])
            for name, segments in report.get("segments", {}).items():
                by_file.setdefault(name, {})[rank] = segments
            for name, summary in report.get("summaries", {}).items():
                summaries.setdefault(name, {})[rank] = summary
        listed = self._listed_files(step, tmp, reports)
        for name, ranks in by_file.items():  # segments (scattered ranks): summarized here
            size = listed[name][0] if name in listed else 0
            summaries[name] = {r: _coverage.summary(size, segs) for r, segs in ranks.items()}
        files = {}
        for name, (size, holders_checksum) in listed.items():
            covered = summaries.pop(name, {})
            wrong = _coverage.summary_problems(size, covered) if covered else []
            if wrong:
                raise CheckpointError(
                    f"{name} of step {step} was not written exactly once by the ranks: "
                    f"{'; '.join(wrong[:5])}; this is a bug in the handler that wrote it (its "
                    "ranks disagree about who writes which rows), please report it"
                )
            # A file written in ranges gets its checksum from the ranks' CRCs; only small
            # files that no writer recorded (a custom handler's) are read back.
            checksum = (
                recorded.get(name)
                or (_coverage.fold_summaries(size, covered) if covered else None)
                or holders_checksum
                or _checksum.of_file(tmp / name)
            )
            files[name] = FileMetadata(size=size, checksum=checksum)
        unknown = sorted(set(summaries))
        if unknown:
            raise CheckpointError(
                f"step {step}: ranks reported writing {unknown}, which are not in "
                f"{tmp}; a handler wrote outside its folder or deleted a file"
            )
        meta = build(written, files)
        _fs.write_file_durably(tmp / _layout.METADATA_FILE, meta.to_json())
        _fs.fsync_path(tmp)
        if not self.scattered:
            return meta, None
        holders = {
            name: [rank for rank, report in enumerate(reports) if name in report["files"]]
            for name in listed
        }
        ranges = {
            name: {rank: _coverage.intervals(segs) for rank, segs in segments.items()}
            for name, segments in by_file.items()
        }
        sizes = {name: size for name, (size, _) in listed.items()}
        return meta, _scattered.plan_upload(holders, sizes, ranges).to_json()

    def _listed_files(
        self, step: int, tmp: Path, reports: list[dict]
    ) -> dict[str, tuple[int, str | None]]:
        """Every file of the step: its size, and a checksum its rank computed (or None)."""
        if not self.scattered:
            return {
                rel.as_posix(): ((tmp / rel).stat().st_size, None) for rel in _fs.iter_files(tmp)
            }
        listed: dict[str, tuple[int, str | None]] = {}
        for rank, report in enumerate(reports):
            for name, (size, checksum) in report["files"].items():
                if name in listed and listed[name][0] != size:
                    raise CheckpointError(
                        f"{name} of step {step} has {listed[name][0]} bytes on one rank and "
                        f"{size} on rank {rank}; ranks that write one file must agree on it"
                    )
                in_ranges = any(name in r["segments"] for r in reports)
                if name in listed and not in_ranges and checksum != listed[name][1]:
                    raise CheckpointError(
                        f"{name} of step {step} was written with different contents by "
                        f"several ranks (rank {rank} and an earlier one); a file that is "
                        "not written in ranges must be written by one rank"
                    )
                listed.setdefault(name, (size, checksum))
        return dict(sorted(listed.items()))

    def _supersede_from(self, step: int, moved: list[int]) -> list[int]:
        """Move ``step`` and every newer committed step into ``superseded/``, newest first.

        Newest first, so that a crash in the middle leaves a prefix of the old timeline: the
        latest step is then some old step, never a gap, and every moved step is intact. Each
        step leaves the view as it leaves the step namespace, and is appended to ``moved``; a
        step that is no longer there at all (removed behind this manager's back) is dropped
        from the view. Returns every step that left the view.
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
            for victim in victims:
                self.remote.supersede([victim])
                self._forget(victim)
                moved.append(victim)
                # No longer a step; its mirrored files go too (a leftover is removed at open).
                with contextlib.suppress(OSError):
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
        if folder.is_symlink() or (os.path.lexists(folder) and not folder.is_dir()):
            raise CheckpointError(
                f"{folder} is not a folder (a link or a file); orbit_pt moves replaced steps "
                "only into a real superseded/ folder inside the root. Move it away and save again"
            )
        folder.mkdir(exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        for victim in victims:
            # A coarse clock can repeat a stamp; renaming onto an existing folder would fail.
            for n in itertools.count():
                destination = folder / _layout.superseded_name(victim, stamp, n)
                if not os.path.lexists(destination):
                    break
            if self._rename_step(victim, destination):
                moved.append(victim)
        _fs.fsync_path(folder)
        _fs.fsync_path(self.root)
        return victims

    def _rename_step(self, step: int, destination: Path) -> bool:
        """Rename committed ``step`` out of the step namespace (under the mutex).

        Returns False when the step was no longer there (it is dropped from the view with a
        warning: whoever removed it, a rollback or a retention pass must go on); any other
        failure is raised, and the step stays.
        """
        path = self.step_path(step)
        try:
            os.replace(path, destination)
        except FileNotFoundError:
            if os.path.lexists(path):
                raise
            logger.warning(
                "step %d is no longer in %s (removed by something other than this manager?); "
                "dropping it from the list of committed steps",
                step,
                self.root,
            )
            self._forget(step)
            return False
        self._forget(step)
        return True

    # ---------------------------------------------------------------------------------- delete

    def delete(
        self, steps: list[int], *, dist: Collective | None = None, background: bool = False
    ) -> None:
        """Delete committed steps: each is renamed out of the step namespace, then removed.

        With ``background`` (retention after a save), the files of the renamed steps are
        removed on a thread of their own, off the training loop's path; otherwise before this
        returns (whoever deletes by hand usually wants the disk space back).

        A step that cannot be deleted does not stop the others. A step already gone from the
        root is dropped from the view. After any failure the view is re-read from the root,
        and one :class:`CheckpointError` names each step not deleted and the committed steps
        now. Collective under torch.distributed (rank 0 deletes, every rank takes its view).
        """
        dist = dist if dist is not None else self.dist
        failures: dict[int, str] = {}
        first: list[Exception] = []

        def remove() -> None:
            if not dist.is_primary:
                return
            for step in steps:
                try:
                    self._delete_one(step, background=background)
                except Exception as exc:  # the next step is still deleted
                    failures.setdefault(step, _reason(exc))
                    first.append(exc)

        outcome: dict[str, Any] | None = None
        try:
            dist.run_everywhere("orbit_pt.delete", remove, label=f"deleting steps {steps}")
        finally:
            if dist.is_primary:
                now = self._rederive() if failures else None
                with self._mutex:
                    outcome = {
                        "failures": {str(s): why for s, why in failures.items()},
                        "gone": [s for s in steps if s not in self._committed],
                        "steps": now if failures else list(self._committed),
                        "view": self._table() if now is not None else None,
                    }
            outcome = dist.broadcast(outcome)
            assert outcome is not None
            if not dist.is_primary:
                with self._mutex:
                    for step in outcome["gone"]:
                        self._forget(step)
                self._take_table(outcome["view"])
        if outcome["failures"]:
            detail = "; ".join(f"step {s}: {why}" for s, why in outcome["failures"].items())
            now = outcome["steps"]
            raise CheckpointError(
                f"deleting step(s) {sorted(map(int, outcome['failures']))} from "
                f"{self.describe()} failed ({detail}); the other steps asked for are deleted, "
                "and "
                + (
                    f"the committed steps are now {now}"
                    if now is not None
                    else "the root could not be listed again: call reload() to see its steps"
                )
            ) from (first[0] if first else None)

    def _delete_one(self, step: int, *, background: bool) -> None:
        """Rank 0: take ``step`` out of the step namespace, then remove its files.

        Once renamed it is no longer a step, whatever happens next: a failure to flush the
        rename or to remove the files is logged, and what is left is removed when a writer next
        opens the root.
        """
        doomed = self.root / (_layout.step_name(step) + _layout.DELETING_SUFFIX)
        with self._mutex:
            if self.remote is not None:
                self.remote.remove_step_objects(step)  # marker first: no step now
                self._forget(step)
                if not os.path.lexists(self.step_path(step)):
                    return  # nothing of it in the mirror
            self._wait_for_removal(doomed)
            _fs.remove_tree(doomed)  # what an earlier failed deletion of this step left
            if not self._rename_step(step, doomed):
                return
        try:
            _fs.fsync_path(self.root)
        except OSError as exc:  # a deletion that a power loss undoes is simply done again
            logger.warning(
                "could not flush the deletion of step %d in %s: %s", step, self.root, exc
            )
        if not background:
            self._remove_deleted(step, doomed)
            return
        with self._mutex:
            if self._remover is None:
                self._remover = ThreadPoolExecutor(1, thread_name_prefix="orbit_pt-remove")
            self._removals = {p: f for p, f in self._removals.items() if not f.done()}
            self._removals[doomed] = self._remover.submit(self._remove_deleted, step, doomed)

    def _remove_deleted(self, step: int, doomed: Path) -> None:
        """On the removal thread: the files of a step that is already deleted."""
        try:
            _fs.remove_tree(doomed)
        except OSError as exc:
            logger.warning(
                "step %d is deleted from %s, but removing its files in %s failed: %s; the next "
                "writer to open the root removes them",
                step,
                self.root,
                doomed,
                exc,
            )

    def wait_for_removals(self) -> None:
        """Wait until the files of every step deleted so far are removed (for tests: the
        removals run on their own thread)."""
        with self._mutex:
            pending = list(self._removals.values())
        for removal in pending:
            removal.result()

    def _wait_for_removal(self, doomed: Path) -> None:
        pending = self._removals.pop(doomed, None)
        if pending is not None:
            pending.result()

    # ------------------------------------------------------------------------------- lifecycle

    def _remove_leftovers(self) -> None:
        """Remove temporary and half-deleted folders that a crashed writer left behind.

        In an object-store root's mirror, also the mirrored steps the store no longer holds.
        """
        removed = []
        remote = set(self.remote.committed()) if self.remote is not None else None
        for entry in _root.scan_root(self.root, superseded=False):
            stale = remote is not None and entry.committed and entry.step not in remote
            if not (entry.kind in ("temporary", "deleting") or stale):
                continue
            try:
                _fs.remove_tree(entry.path)
            except OSError as exc:
                # Not a step either way; a leftover that cannot go (another user's, a failing
                # disk) must not keep the root from opening.
                logger.warning(
                    "could not remove the leftover %s in %s: %s; it is not a step and is left "
                    "as it is",
                    entry.path,
                    self.root,
                    exc,
                )
                continue
            removed.append(entry.name)
        if removed:
            logger.info("removed %d leftover folder(s) in %s: %s", len(removed), self.root, removed)
            try:
                _fs.fsync_path(self.root)
            except OSError as exc:  # a removal undone by a power loss is removed again
                logger.warning("could not flush %s after removing leftovers: %s", self.root, exc)

    def close(self) -> None:
        """Finish removing deleted steps' files, then release the lease (object-store root)
        and the lock; each even if another fails."""
        with self._mutex:
            remover, self._remover = self._remover, None
            self._removals = {}
        if remover is not None:
            remover.shutdown(wait=True)
        with contextlib.ExitStack() as release:  # callbacks run last-in first-out
            lock, self._lock = self._lock, None
            if lock is not None:
                release.callback(lock.release)
            if self.remote is not None:
                release.callback(self.remote.release_lease)


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return text if isinstance(exc, CheckpointError) and text else f"{type(exc).__name__}: {text}"
