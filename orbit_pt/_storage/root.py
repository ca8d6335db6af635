"""The root's view: which entries of a root are committed steps, and whether their files are whole.

Every reader asks this module -- the manager's :class:`~orbit_pt._storage.store.StepStore`,
``orbit-pt`` (ls, info, verify, prune, export), :func:`orbit_pt.verify.verify_step` and
:func:`orbit_pt.export.export_model` -- so that they all agree on which steps exist. An entry of
the root is a committed step exactly when (docs/format.md, "Committed"):

1. its name is a step name (:func:`~orbit_pt._storage.layout.parse_step_name`);
2. it is a folder itself, not a symbolic link to one: a link may point anywhere, and
   superseding or deleting through it would touch what this root's writer never wrote;
3. it holds a ``_CHECKPOINT_METADATA`` file that parses;
4. that metadata records the step of the folder's name.

The files of a committed step are checked here too (:func:`check_listed_files`): restore stops
at the first problem, ``verify`` collects them all.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from orbit_pt._format import checksum as _checksum
from orbit_pt._format import progress as _progress
from orbit_pt._format import safe_open as _safe_open
from orbit_pt._storage import layout as _layout
from orbit_pt.errors import CheckpointError, CorruptCheckpointError, StepNotFoundError
from orbit_pt.metadata import FileMetadata, StepMetadata

EntryKind = Literal["committed", "temporary", "deleting", "superseded", "foreign"]
"""What an entry of a root is:

- ``committed``: a step (the four conditions of the module docstring);
- ``temporary``: ``step_N.orbit-tmp/``, a step being written or left by a crash;
- ``deleting``: ``step_N.orbit-deleting/``, a step being deleted or left by a crash;
- ``superseded``: an entry of ``superseded/``, a step replaced by a later save (a rollback);
- ``foreign``: anything else -- including a step-named link, file, or folder without valid
  metadata. orbit_pt never moves or deletes a foreign entry.
"""

Defect = Literal[
    "not-a-step-name",
    "link",
    "not-a-folder",
    "no-metadata",
    "bad-metadata",
    "other-step",
    "unreadable",
]
"""Why a foreign entry is not a committed step (``bad-metadata`` and ``other-step`` are worth a
warning: someone wrote or renamed a step folder by hand; ``unreadable``: this process may not
look inside it, e.g. another user's folder)."""

Identity = tuple[int, int, int]
"""The inode, size and modification time of a metadata file: a rescan re-reads only changed ones."""

FileProblemKind = Literal[
    "metadata", "missing", "not-a-file", "size", "checksum", "unreadable", "no-checksum"
]

# A leftover counts only as a real folder: a link or a file with such a name is foreign, so
# that the clean-up at open never deletes through a link.
_LEFTOVERS: tuple[tuple[str, EntryKind], ...] = (
    (_layout.TMP_SUFFIX, "temporary"),
    (_layout.DELETING_SUFFIX, "deleting"),
)
_NOTES: dict[EntryKind, str] = {
    "temporary": "being written, or left by a crash; not a step",
    "deleting": "being deleted, or left by a crash; not a step",
    "superseded": "replaced by a later save of the same or an earlier step (a rollback)",
}


@dataclass(frozen=True)
class RootEntry:
    """One entry of a root (or of its ``superseded/`` folder).

    Attributes:
        name: the path relative to the root, ``/``-separated (``superseded/step_...`` inside it).
        path: the entry on disk.
        kind: what it is (see :data:`EntryKind`).
        step: the step its name stands for; None when its name stands for none.
        meta: a committed step's metadata (also a superseded step's, when readable).
        reason: why it is not a committed step, readable; empty when it is one.
        defect: the same as a code, for a foreign entry.
        identity: of a committed step's metadata file (see :data:`Identity`).
    """

    name: str
    path: Path
    kind: EntryKind
    step: int | None
    meta: StepMetadata | None = None
    reason: str = ""
    defect: Defect | None = None
    identity: Identity | None = None

    @property
    def committed(self) -> bool:
        return self.kind == "committed"


def scan_root(
    root: Path,
    *,
    superseded: bool = True,
    known: Mapping[int, tuple[Identity, StepMetadata]] | None = None,
) -> list[RootEntry]:
    """Every entry of ``root``, by step (entries without one first), ``superseded/`` last.

    Args:
        root: the checkpoint root; a missing root has no entries.
        superseded: also list the entries of ``superseded/``.
        known: step -> (identity, metadata) from an earlier scan; a step whose metadata file
            still has that identity is not read again.

    The root's own files (its lock, its retention record) are not entries. An entry this
    process may not examine (another user's folder: a permission error) is a foreign
    ``unreadable`` entry, never an error: one such folder must not hide the others.

    Raises:
        CheckpointError: the root cannot be listed, or reading an entry failed otherwise than
            by a permission error (EIO, ...): a listing that silently left out a committed step
            would be wrong, so there is none.
    """
    entries: list[RootEntry] = []
    # A list, not a context manager: the whole listing is taken at once, before any metadata
    # is read (and tests replace os.scandir with a plain iterator).
    try:
        listing = _list(root)
    except OSError as exc:
        raise CheckpointError(
            f"cannot list the checkpoint root {root}: {exc}; it must be a folder this process "
            "may read (and the disk must answer)"
        ) from exc
    for item in listing:
        if item.name in _layout.ROOT_FILES:
            continue
        path = Path(item.path)
        if item.name == _layout.SUPERSEDED_DIR and _is_folder(item):
            if superseded:
                entries.extend(_scan_superseded(path))
            continue
        entry = _examine(root, item.name, path, item, known or {})
        if entry is not None:
            entries.append(entry)
    entries.sort(key=lambda e: (e.kind == "superseded", -1 if e.step is None else e.step, e.name))
    return entries


def step_entry(root: Path, step: int) -> RootEntry | None:
    """The entry named for ``step`` under ``root``, or None when nothing has that name."""
    path = root / _layout.step_name(step)
    if not os.path.lexists(path):
        return None
    return _examine(root, path.name, path, None, {})


def committed_entry(root: Path, step: int) -> RootEntry:
    """The committed step ``step`` of ``root``.

    Raises:
        StepNotFoundError: nothing under ``root`` has the step's name.
        CorruptCheckpointError: something has, but it is not a committed step (the message
            says why).
    """
    entry = step_entry(root, step)
    if entry is None:
        raise StepNotFoundError(step, root, committed_steps(root))
    if not entry.committed:
        raise CorruptCheckpointError(
            f"{entry.path} is not a committed step ({entry.reason}); run `orbit-pt verify "
            f"{root} {step}` for details"
        )
    return entry


def read_committed(root: Path, step: int) -> StepMetadata:
    """The metadata of the committed ``step`` of ``root`` (raises as :func:`committed_entry`)."""
    meta = committed_entry(root, step).meta
    assert meta is not None  # a committed entry always has its metadata
    return meta


def committed_steps(root: Path) -> list[int]:
    """The committed steps of ``root``, ascending."""
    return [e.step for e in scan_root(root, superseded=False) if e.committed and e.step is not None]


# ------------------------------------------------------------------------------ classifying


class _Lstat:
    """The two questions :func:`_classify` asks of an ``os.DirEntry``, for a single path."""

    def __init__(self, path: Path) -> None:
        self._link = path.is_symlink()
        self._dir = not self._link and path.is_dir()

    def is_symlink(self) -> bool:
        return self._link

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self._dir


def _list(folder: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_folder(item: os.DirEntry[str]) -> bool:
    """Whether ``item`` is a folder itself (not a link); False when that cannot be told."""
    try:
        return item.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _examine(
    root: Path,
    name: str,
    path: Path,
    item: os.DirEntry[str] | None,
    known: Mapping[int, tuple[Identity, StepMetadata]],
    *,
    again: bool = True,
) -> RootEntry | None:
    """:func:`_classify`, with its errors sorted: refused is unreadable, anything else raises.

    None when the entry vanished after the listing named it: a writer's retention or rollback
    renamed it away while this process (a reader polling a live root) looked at it. One that is
    still there but changed under the read (its metadata replaced) is looked at once more.
    """
    try:
        return _classify(name, path, item if item is not None else _Lstat(path), known)
    except PermissionError as exc:  # EACCES, EPERM: another user's folder
        return _unreadable(name, path, exc)
    except OSError as exc:
        vanished = isinstance(exc, (FileNotFoundError, NotADirectoryError))
        if vanished and not os.path.lexists(path):
            return None
        if vanished and again:
            return _examine(root, name, path, None, {}, again=False)
        raise CheckpointError(
            f"reading {path} failed: {exc}; the committed steps of {root} cannot be listed "
            "without it (a failing disk or file system?). Try again, and check the disk if it "
            "persists"
        ) from exc


def _classify(
    name: str,
    path: Path,
    item: os.DirEntry[str] | _Lstat,
    known: Mapping[int, tuple[Identity, StepMetadata]],
) -> RootEntry:
    is_folder = item.is_dir(follow_symlinks=False)
    step = _layout.parse_step_name(name)
    if step is None:
        for suffix, kind in _LEFTOVERS:
            stem = _layout.parse_step_name(name.removesuffix(suffix))
            if name.endswith(suffix) and stem is not None and is_folder:
                return RootEntry(name, path, kind, stem, reason=_NOTES[kind])
        return RootEntry(
            name, path, "foreign", None, reason="not an orbit_pt name", defect="not-a-step-name"
        )
    if item.is_symlink():
        return _foreign(
            name,
            path,
            step,
            "link",
            "a symbolic link: a step folder is never a link (orbit_pt neither reads nor deletes "
            "through one); put the folder itself here",
        )
    if not is_folder:
        return _foreign(name, path, step, "not-a-folder", "a file, not a step folder")
    meta_path = path / _layout.METADATA_FILE
    try:
        info = meta_path.stat()
    except (FileNotFoundError, NotADirectoryError):
        info = None
    # Any other OSError (a folder this user may not enter, EIO) goes up: "unreadable".
    identity = _identity(meta_path) if info is not None else None
    cached = known.get(step)
    if cached is not None and identity is not None and cached[0] == identity:
        return RootEntry(name, path, "committed", step, cached[1], identity=identity)
    if info is None or not stat.S_ISREG(info.st_mode):
        return _foreign(
            name,
            path,
            step,
            "no-metadata",
            f"no {_layout.METADATA_FILE}: never committed (a crash mid-save, or a copy that "
            "stopped early); not a step",
        )
    try:
        # As StepMetadata.read (a regular file, never a link), but an OSError goes up: it is
        # not the metadata's fault (see _examine).
        data = _safe_open.read_bytes(meta_path, limit=_safe_open.MAX_JSON_BYTES, nofollow=True)
        meta = StepMetadata.from_json(data, path=meta_path)
    except CorruptCheckpointError as exc:
        return _foreign(name, path, step, "bad-metadata", f"unreadable metadata: {exc}")
    if meta.step != step:
        return _foreign(
            name,
            path,
            step,
            "other-step",
            f"its metadata records step {meta.step}: renamed by hand? rename it back to "
            f"{_layout.step_name(meta.step)}",
        )
    return RootEntry(name, path, "committed", step, meta, identity=identity)


def _foreign(name: str, path: Path, step: int, defect: Defect, reason: str) -> RootEntry:
    return RootEntry(name, path, "foreign", step, reason=reason, defect=defect)


def _unreadable(name: str, path: Path, exc: OSError) -> RootEntry:
    """An entry that could not be examined: foreign, whatever its name says."""
    why = exc.strerror or str(exc)
    step = _layout.parse_step_name(name)
    return RootEntry(
        name,
        path,
        "foreign",
        step,
        reason=f"this process may not look inside it ({why}: another user's?); not a step",
        defect="unreadable",
    )


def _scan_superseded(folder: Path) -> Iterator[RootEntry]:
    try:
        items = _list(folder)
    except OSError as exc:
        # Only listed, never a step: an unreadable superseded/ hides nothing that counts.
        yield _unreadable(_layout.SUPERSEDED_DIR, folder, exc)
        return
    for item in items:
        name = f"{_layout.SUPERSEDED_DIR}/{item.name}"
        path = Path(item.path)
        step = _layout.parse_superseded_name(item.name)
        if step is None or not _is_folder(item):
            yield RootEntry(
                name, path, "foreign", None, reason="not an orbit_pt name", defect="not-a-step-name"
            )
            continue
        meta: StepMetadata | None = None
        with contextlib.suppress(CorruptCheckpointError, OSError):
            meta = StepMetadata.read(path / _layout.METADATA_FILE)
        if meta is not None and meta.step != step:
            meta = None  # not the step it was moved aside as: nothing of it is trusted
        yield RootEntry(name, path, "superseded", step, meta, reason=_NOTES["superseded"])


def metadata_identity(step_dir: Path) -> Identity | None:
    """The :data:`Identity` of a step folder's metadata file (None when it cannot be stat'ed)."""
    return _identity(step_dir / _layout.METADATA_FILE)


def _identity(path: Path) -> Identity | None:
    """The inode, size and modification time of ``path``, or None when it cannot be stat'ed."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


# ------------------------------------------------------------------------------ whole files


@dataclass(frozen=True)
class FileCheck:
    """The outcome of checking one file a step's metadata lists.

    Attributes:
        rel: its path relative to the step folder, as listed.
        path: the file.
        problem: what is wrong with it, or None.
        detail: the problem, readable; it follows the file's path in messages
            (``".../model.safetensors has 10 bytes, ..."``).
        sized: it is a regular file with its recorded size, so its content can be parsed.
        checksummed: its checksum was recomputed and matched.
        unchecksummed: it was recorded without a checksum (and none was required).
        bytes_read: bytes read to recompute its checksum.
    """

    rel: str
    path: Path
    problem: FileProblemKind | None = None
    detail: str = ""
    sized: bool = False
    checksummed: bool = False
    unchecksummed: bool = False
    bytes_read: int = 0


def check_listed_files(
    step_dir: Path,
    files: Mapping[str, FileMetadata],
    *,
    checksums: Callable[[str], bool] = lambda rel: True,
    require_checksums: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Iterator[FileCheck]:
    """Check each listed file of a step, in the metadata's order, one at a time.

    A file must be a regular file (not a link, not a folder) inside the step folder with its
    recorded size; a file for which ``checksums(rel)`` is True is also read in full and its
    checksum compared. A consumer may stop at the first problem (restore) or collect them all
    (verify); files after the one it stops at are not read.

    Args:
        step_dir: the step folder.
        files: what the metadata lists: path relative to the step -> size and checksum.
        checksums: which files to read in full and compare with their recorded checksum.
        require_checksums: a file recorded without a checksum is a problem (``no-checksum``)
            instead of being reported ``unchecksummed``.
        progress: called with the bytes read after each chunk, besides any progress display
            already active (``orbit_pt._format.progress``).
    """
    for rel, info in files.items():
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts or "\\" in rel:
            yield FileCheck(rel, step_dir / rel, "metadata", _OUTSIDE)
            continue
        path = step_dir / pure
        if (found := _safe_open.check_beneath(step_dir, pure.parts)) is not None:
            yield FileCheck(rel, path, *found)  # a link on its way, a FIFO, a folder, EACCES
            continue
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            detail = f"is missing (the metadata recorded {info.size} bytes)"
            yield FileCheck(rel, path, "missing", detail)
            continue
        except OSError as exc:
            yield FileCheck(rel, path, "unreadable", f"cannot be read: {exc}")
            continue
        if size != info.size:
            detail = (
                f"has {size} bytes, the metadata recorded {info.size} (truncated or overwritten)"
            )
            yield FileCheck(rel, path, "size", detail)
            continue
        if info.checksum is None:
            if require_checksums:
                yield FileCheck(
                    rel, path, "no-checksum", "has no recorded checksum (an older step)", sized=True
                )
            else:
                yield FileCheck(rel, path, sized=True, unchecksummed=True)
        elif checksums(rel):
            yield _compare_checksum(rel, path, info.checksum, progress)
        else:
            yield FileCheck(rel, path, sized=True)


_OUTSIDE = "is not a path inside the step folder; not read"


def _compare_checksum(
    rel: str, path: Path, recorded: str, progress: Callable[[int], None] | None
) -> FileCheck:
    try:
        _checksum.check_algorithm(recorded)
    except CheckpointError as exc:
        return FileCheck(rel, path, "checksum", str(exc), sized=True)
    with _counting(progress) as counter:
        try:
            actual = _checksum.of_file(path, _checksum.algorithm_of(recorded))
        except OSError as exc:
            detail = f"cannot be read: {exc}"
            return FileCheck(rel, path, "unreadable", detail, sized=True, bytes_read=counter.done)
    if actual != recorded:
        return FileCheck(
            rel,
            path,
            "checksum",
            f"has checksum {actual}, the metadata recorded {recorded} (its bytes changed after "
            "the commit)",
            sized=True,
            bytes_read=counter.done,
        )
    return FileCheck(rel, path, sized=True, checksummed=True, bytes_read=counter.done)


class _Counter(_progress.Progress):
    """Counts the bytes one checksum reads, for a caller's callback and any display above it."""

    def __init__(
        self, callback: Callable[[int], None] | None, outer: _progress.Progress | None
    ) -> None:
        super().__init__("checking checksums")
        self._callback = callback
        self._outer = outer

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._callback is not None:
            self._callback(nbytes)
        if self._outer is not None:
            self._outer.advance(nbytes)

    def close(self) -> None:
        """Nothing to draw: the display above it, if any, draws itself."""


@contextlib.contextmanager
def _counting(callback: Callable[[int], None] | None) -> Iterator[_Counter]:
    # checksum.of_file reports its chunks to the progress display of the current context; a
    # counter put in front of that display sees every chunk and passes it on. _format.progress
    # has no public hook for this yet, hence its private context variable, here only.
    counter = _Counter(callback, _progress._current.get())
    token = _progress._current.set(counter)
    try:
        yield counter
    finally:
        _progress._current.reset(token)
