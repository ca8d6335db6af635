"""Opening a checkpoint's files for reading: regular files only, and no links inside a step.

A checkpoint may come from anywhere -- copied, downloaded, or left on a shared disk by someone
else -- so its files are opened as if they were hostile (docs/format.md, "Reading limits"):

- **Regular files only.** A path is ``lstat``-ed before it is opened, and the open itself uses
  ``O_NONBLOCK`` (a FIFO with no writer would otherwise block ``open()`` forever) and is
  ``fstat``-ed after: a FIFO, socket, device or folder is refused without a byte being read.
- **No links inside a step.** Inside :func:`confined` (a restore or a verify of one step),
  every folder below the confining one is opened relative to its parent with ``O_NOFOLLOW``,
  and so is the file: a symbolic link anywhere below the step folder -- an item folder, a
  ``rank_*`` folder, a file -- is refused, so nothing outside the root is ever read. The
  confining folder itself, and the path above it, are the user's: a root reached through a
  link is fine. Outside a confinement, links are followed (``load_pretrained`` reads
  Hugging Face cache folders, whose files are links into ``blobs/``).

:func:`check_beneath` is the same walk without opening the file, for the size and checksum
checks of a step's listed files (``_storage/root.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from orbit_pt.errors import CorruptCheckpointError

# The deepest JSON document orbit_pt reads (metadata, model index, config and adapter files):
# the real ones nest 3 to 5 levels. Deeper is refused before anything walks it recursively.
MAX_JSON_DEPTH = 64
# The largest JSON document orbit_pt reads into memory (the metadata of a step saved by many
# ranks lists every rank's files, a few hundred bytes each).
MAX_JSON_BYTES = 1 << 30

_READ_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_DIRECTORY", 0)

_T = TypeVar("_T")

_confined: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "orbit_pt_confined", default=None
)

Identity = tuple[int, int]
"""A file's device and inode: a reopened file must be the one that was checked."""


@contextlib.contextmanager
def confined(folder: Path) -> Iterator[None]:
    """Within this context, no link below ``folder`` is followed by :func:`open_regular`.

    A restore or a verify enters it with the step folder; paths outside ``folder`` are opened
    as usual.
    """
    token = _confined.set(_absolute(folder))
    try:
        yield
    finally:
        _confined.reset(token)


def confining(folder: Path, fn: Callable[[], _T]) -> Callable[[], _T]:
    """``fn``, made to run :func:`confined` to ``folder`` (for a callback run elsewhere)."""

    def run() -> _T:
        with confined(folder):
            return fn()

    return run


def open_regular(path: Path, *, nofollow: bool = False) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (see the module doc).

    Args:
        path: the file.
        nofollow: refuse ``path`` itself when it is a link, even outside a confinement (a
            step's ``_CHECKPOINT_METADATA`` is never one).

    Raises:
        CorruptCheckpointError: ``path`` (or, in a confinement, a folder on its way) is a link,
            or it is not a regular file.
        OSError: it cannot be opened (missing, permission denied, ...).
    """
    path = Path(path)
    base = _confined.get()
    parts = _below(path, base) if base is not None else None
    if parts is None:
        return _open_file(None, str(path), path, nofollow=nofollow)
    assert base is not None
    folder = _open_folders(base, parts[:-1], path)
    try:
        return _open_file(folder, parts[-1], path, nofollow=True)
    finally:
        os.close(folder)


def reopen(path: Path, identity: Identity) -> int:
    """A read-only descriptor of ``path``, which must still be the file ``identity`` names.

    For readers that opened a file with :func:`open_regular` once and open it again for each
    read: one ``open`` and one ``fstat``. Whatever now lies at ``path`` -- a link, a swapped
    folder on its way -- only the very file that was checked is read; anything else is refused.
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != identity or not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(
                f"{path} was replaced while it was being read (it is not the file whose header "
                "was checked); read the step again when nothing is changing it"
            )
        return fd
    except BaseException:
        os.close(fd)
        raise


def identity_of(fd: int) -> Identity:
    """The :data:`Identity` of an open file."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def read_bytes(path: Path, *, limit: int | None = None, nofollow: bool = False) -> bytes:
    """The whole content of the regular file ``path`` (see :func:`open_regular`).

    Args:
        path: the file.
        limit: refuse a file larger than this many bytes (before reading it).
        nofollow: as for :func:`open_regular`.

    Raises:
        CorruptCheckpointError: see :func:`open_regular`; or the file is over ``limit``.
        OSError: it cannot be opened or read.
    """
    fd = open_regular(path, nofollow=nofollow)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise CorruptCheckpointError(
                f"{path} has {size} bytes, more than the {limit} orbit_pt reads from a file of "
                "its kind; it is not a file orbit_pt wrote"
            )
        chunks = []
        remaining = size
        while remaining > 0:  # exactly the size: a file that grows meanwhile is not followed
            chunk = os.read(fd, min(remaining, 64 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_json(data: bytes | str, *, max_depth: int = MAX_JSON_DEPTH, finite: bool = False) -> Any:
    """``json.loads`` with a nesting limit, for documents read from a checkpoint.

    Args:
        data: the document.
        max_depth: the deepest nesting accepted.
        finite: refuse ``NaN``, ``Infinity`` and numbers too large for a float (``1e400``),
            for formats that forbid them.

    Raises:
        ValueError: not JSON, or nested deeper than ``max_depth`` (also when it is so deep
            that the parser itself gives up), or a number ``finite`` refuses, or an object
            that holds one key twice (JSON readers disagree about which one counts).
    """
    options: dict[str, Any] = {"object_pairs_hook": _unique_keys}
    if finite:
        options.update(parse_constant=_no_constant, parse_float=_finite_float)
    try:
        document = json.loads(data, **options)
    except RecursionError:
        raise ValueError(f"nested deeper than the {max_depth} levels allowed") from None
    depth = json_depth(document, limit=max_depth)
    if depth > max_depth:
        raise ValueError(f"nested deeper than the {max_depth} levels allowed")
    return document


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"it holds the key {key!r:.80} more than once")
        document[key] = value
    return document


def _no_constant(name: str) -> float:
    raise ValueError(f"it holds {name}, which this format does not allow")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"it holds the number {text[:40]}, too large for a float")
    return value


def read_json(path: Path, *, nofollow: bool = False) -> Any:
    """The JSON document in the regular file ``path``, with size and nesting limits.

    Raises:
        CorruptCheckpointError: naming ``path``: not a regular file, too large, not JSON, or
            nested too deeply.
        OSError: it cannot be opened or read.
    """
    data = read_bytes(path, limit=MAX_JSON_BYTES, nofollow=nofollow)
    try:
        return parse_json(data)
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise CorruptCheckpointError(f"{path} is not valid JSON: {exc}") from exc


def read_json_object(path: Path) -> dict[str, Any]:
    """:func:`read_json`, for a file whose document must be an object (a JSON ``{...}``)."""
    document = read_json(path)
    if not isinstance(document, dict):
        raise CorruptCheckpointError(
            f"{path} holds a JSON {type(document).__name__}, not an object"
        )
    return document


def json_depth(document: Any, *, limit: int) -> int:
    """How deep ``document`` nests (a scalar is 0), counted without recursion; stops past
    ``limit`` (returns ``limit + 1``)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(document, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        depth += 1
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children if isinstance(child, (dict, list)))
    return deepest


Problem = tuple[Literal["not-a-file", "unreadable"], str]


def check_beneath(folder: Path, parts: Sequence[str]) -> Problem | None:
    """What is wrong with the file ``folder/parts...``, looked at without following links.

    Every folder on the way below ``folder`` must be a folder and not a link, and the file,
    when it exists, a regular file and not a link. A missing file is no problem here (the
    caller reports it as missing).

    Returns:
        None, or ``("not-a-file", detail)`` / ``("unreadable", detail)``.
    """
    at = folder
    try:
        for i, part in enumerate(parts):
            at = at / part
            try:
                st = os.lstat(at)
            except FileNotFoundError:
                return None
            last = i == len(parts) - 1
            if stat.S_ISLNK(st.st_mode):
                what = "is a symbolic link" if last else f"lies below {at}, a symbolic link"
                return "not-a-file", f"{what}; orbit_pt reads nothing through links in a step"
            if last and not stat.S_ISREG(st.st_mode):
                return "not-a-file", f"is a {_kind(st.st_mode)}, not a regular file"
            if not last and not stat.S_ISDIR(st.st_mode):
                return "not-a-file", f"lies below {at}, a {_kind(st.st_mode)}, not a folder"
    except OSError as exc:
        return "unreadable", f"cannot be read: {exc}"
    return None


# ---------------------------------------------------------------------------------- internals


def _below(path: Path, base: Path) -> list[str] | None:
    """The components of ``path`` below ``base``, or None when it is not below it."""
    try:
        parts = _absolute(path).relative_to(base).parts
    except ValueError:
        return None
    return list(parts) or None


def _absolute(path: Path) -> Path:
    """``path`` made absolute, ``..`` resolved by name (links are not looked at)."""
    return Path(os.path.normpath(Path(path).absolute()))


def _open_folders(base: Path, parts: Sequence[str], path: Path) -> int:
    """A descriptor of ``base/parts...``, each part opened below the last without links."""
    fd = os.open(base, _DIR_FLAGS)
    try:
        at = base
        for part in parts:
            at = at / part
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else _kind(st.st_mode)
                raise CorruptCheckpointError(
                    f"{path} lies below {at}, which is {_article(what)}, not a folder; orbit_pt "
                    "reads nothing through links in a step -- the step is damaged, restore "
                    "another step"
                )
            inner = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_file(folder: int | None, name: str, path: Path, *, nofollow: bool) -> int:
    st = os.stat(name, dir_fd=folder, follow_symlinks=not nofollow)
    _refuse_irregular(st.st_mode, path)
    fd = os.open(name, _READ_FLAGS | (_NOFOLLOW if nofollow else 0), dir_fd=folder)
    try:
        _refuse_irregular(os.fstat(fd).st_mode, path)  # it may have changed since the stat
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refuse_irregular(mode: int, path: Path) -> None:
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else _article(_kind(mode))
        raise CorruptCheckpointError(
            f"{path} is {what}, not a regular file; orbit_pt reads only regular files (and no "
            "links inside a step) -- the step is damaged, restore another step"
        )


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "regular file" if stat.S_ISREG(mode) else "special file"


def _article(what: str) -> str:
    return f"an {what}" if what[0] in "aeiou" else f"a {what}"
