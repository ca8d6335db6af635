"""Durable filesystem primitives: fsync, durable small writes, and publishing by rename.

Everything orbit_pt makes appear -- a committed step, an exported model folder, the root's
retention record -- is written under a temporary name, made durable, and renamed into place
with :func:`replace_durably`, so that it appears whole or not at all. :func:`staged_folder` is
that whole sequence for a folder written in one go; the commit of a step runs the same three
steps (:func:`fresh_folder`, :func:`fsync_tree`, then the rename and the fsync of its folder)
across the ranks' agreement phases (``_storage/store.py``), keeping the rename and that fsync
apart: an error between them leaves the step committed, and must be reported so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's or folder's data and metadata to stable storage."""
    # O_RDONLY works for folders and files alike; fsync on any descriptor of an inode flushes
    # all of its dirty pages, including those written through another descriptor.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (folders after their contents), then ``root``.

    A folder that cannot be listed raises: its files would otherwise go unflushed, silently.
    """
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False, onerror=_raise):
        for filename in filenames:
            fsync_path(Path(dirpath) / filename)
        fsync_path(Path(dirpath))


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it (not its folder)."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_durably(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` atomically (replacing it) and make the rename durable.

    ``src`` must already be durable (its data fsynced): the rename is the commit point, and
    after a crash the name ``dst`` holds either what it held before or all of ``src``.
    """
    os.replace(src, dst)
    fsync_path(dst.parent)
    if src.parent != dst.parent:
        fsync_path(src.parent)


def write_file_atomically(path: Path, data: bytes) -> None:
    """Replace the file at ``path`` with ``data``: a reader sees the old bytes or the new ones.

    The temporary file has a fixed name beside ``path`` (``<name>.tmp``): only the root's one
    writer writes these files, and a leftover from a crash is simply overwritten next time.
    """
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    write_file_durably(tmp, data)
    replace_durably(tmp, path)


def fresh_folder(path: Path) -> None:
    """Create ``path`` as an empty folder, removing whatever a crash left there first."""
    remove_tree(path)
    path.mkdir()


@contextlib.contextmanager
def staged_folder(tmp: Path, final: Path) -> Iterator[Path]:
    """Write a folder that appears at ``final`` whole or not at all.

    Yields ``tmp``, a fresh empty folder beside ``final``; when the block ends, every file and
    folder under it is fsynced and it is renamed to ``final``. If the block (or the publishing)
    fails, ``tmp`` is removed and nothing appears at ``final``.
    """
    fresh_folder(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
        replace_durably(tmp, final)
    except BaseException:
        remove_tree(tmp)
        raise


def iter_files(root: Path) -> Iterator[Path]:
    """Every regular file under ``root``, in a stable order, as paths relative to ``root``.

    A folder that cannot be listed raises (``os.walk`` would skip it without a word).
    """
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise):
        dirnames.sort()
        for filename in sorted(filenames):
            yield (Path(dirpath) / filename).relative_to(root)


def _raise(error: OSError) -> None:
    raise error


def remove_tree(path: Path) -> None:
    """Remove a folder and everything in it; a missing folder is not an error.

    A symbolic link in its place is removed itself, never followed: a leftover
    ``.orbit-tmp`` link in a shared root must not cost the folder it points to.
    """
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISLNK(os.lstat(path).st_mode):
            path.unlink()
        else:
            shutil.rmtree(path)  # a file in the way is an error for the caller to report


def has_size(path: Path, size: int) -> bool:
    """Whether ``path`` is a regular file (not a link) of ``size`` bytes."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == size
