"""Files of a step that are read by byte range from where they are stored, not from the disk.

A restore from an object-store root reads each ``.safetensors`` file with ranged requests, only
the bytes this rank needs (its FSDP rows, or whole tensors), straight into the tensors. Such a
file is never written to the disk: a partly downloaded file would read as zeros wherever it was
not filled, and a user loading the step folder with ``from_pretrained`` must never see one. So
nothing stands for it on the disk either -- no placeholder, nothing to remove afterwards.

The storage layer knows where the files are, the format layer reads them, and the handlers in
between only pass paths around: :func:`reading` makes a mapping of path -> :class:`RemoteFile`
current for one restore, :class:`~orbit_pt._format.safetensors.SafetensorsReader` reads a path
found in it through its :class:`RemoteFile`, and handlers ask :func:`is_file` and
:func:`names_in` instead of the disk whether a file of the step is there.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

import torch

T = TypeVar("T")

CONCURRENT_READS = 8
"""Tensors read at once when their bytes come by ranged requests (each may be several ranges)."""


class RemoteFile(Protocol):
    """One file of a step, read by byte range (an object in object storage)."""

    @property
    def url(self) -> str:
        """Where the file is, for messages (``s3://bucket/prefix/step_.../model/...``)."""

    @property
    def size(self) -> int:
        """Its size in bytes, checked against the step's metadata before it is read."""

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the file's bytes from ``offset``.

        Raises:
            CheckpointError: the bytes could not be read (after retries); the message names
                the file's :attr:`url`.
        """


_current: contextvars.ContextVar[Mapping[Path, RemoteFile] | None] = contextvars.ContextVar(
    "orbit_pt_remote_files", default=None
)


@contextlib.contextmanager
def reading(files: Mapping[Path, RemoteFile]) -> Iterator[None]:
    """Within this context, the paths in ``files`` are read through their :class:`RemoteFile`."""
    token = _current.set({_absolute(path): file for path, file in files.items()} or None)
    try:
        yield
    finally:
        _current.reset(token)


def remote_file(path: Path) -> RemoteFile | None:
    """The :class:`RemoteFile` that ``path`` is read from in this context, or None (the disk)."""
    files = _current.get()
    return None if files is None else files.get(_absolute(path))


def is_file(path: Path) -> bool:
    """Whether ``path`` is a file of the step: on the disk, or read remotely."""
    return remote_file(path) is not None or path.is_file()


def names_in(directory: Path) -> set[str]:
    """The names of the entries of ``directory``, on the disk and read remotely."""
    names = {entry.name for entry in directory.iterdir()} if directory.is_dir() else set()
    files = _current.get()
    if files:
        folder = _absolute(directory)
        names.update(path.name for path in files if path.parent == folder)
    return names


def _absolute(path: Path) -> Path:
    """``path`` made absolute, ``..`` resolved by name: one file, one key."""
    return Path(os.path.normpath(Path(path).absolute()))


def for_each(items: Sequence[T], read: Callable[[T], None], *, remote: bool) -> None:
    """``read(item)`` for every item, in order -- or, when the reads go by ranged requests
    (``remote``), several at once: a file of many small tensors then costs a few round trips
    to the store, not one after another per tensor.

    The reads run with the caller's context (its progress display) and with autograd off, as
    they write into parameters. The first failure, in ``items`` order, is raised; reads not
    started yet are dropped.
    """
    if not remote or len(items) < 2:
        for item in items:
            read(item)
        return
    context = contextvars.copy_context()

    def run(item: T) -> None:
        with torch.no_grad():
            read(item)

    with ThreadPoolExecutor(max_workers=min(CONCURRENT_READS, len(items))) as pool:
        futures = [pool.submit(context.copy().run, run, item) for item in items]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
