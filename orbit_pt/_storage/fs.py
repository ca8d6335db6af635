"""Durable filesystem primitives: fsync of files and folders, and durable small writes."""

from __future__ import annotations

import contextlib
import os
import shutil
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
    """fsync every file and folder under ``root`` (folders after their contents), then ``root``."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for filename in filenames:
            fsync_path(Path(dirpath) / filename)
        fsync_path(Path(dirpath))


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it (not its folder)."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def iter_files(root: Path) -> Iterator[Path]:
    """Every regular file under ``root``, in a stable order, as paths relative to ``root``."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for filename in sorted(filenames):
            yield (Path(dirpath) / filename).relative_to(root)


def remove_tree(path: Path) -> None:
    """Remove a folder and everything in it; a missing folder is not an error."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
