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

import bisect
import contextlib
import contextvars
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, TypeVar

import torch

T = TypeVar("T")

CONCURRENT_READS = 8
"""Tensors read at once when their bytes come by ranged requests (each may be several ranges)."""


SMALL_TENSOR = 1 << 20
"""Tensors up to this size are read with their small neighbours, in one request per run."""

RUN_BYTES = 16 << 20
"""The most one such run spans (one ranged request, one part of the store's reads)."""

RUN_GAP = 4096
"""Bytes between two small tensors that may still be read with them (alignment padding)."""

KEPT_RUN_BYTES = 64 << 20
"""Runs kept for later reads at most, per file; one evicted early is read again if needed."""


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


class CoalescedReads:
    """A :class:`RemoteFile` whose small tensors are read in runs, not one request each.

    A model's norms and biases, and an optimizer's per-parameter scalars, are many tensors of a
    few kilobytes: read one ranged request each, a restore pays a round trip per tensor (and a
    request each to the store's bill). Here consecutive tensors of at most
    :data:`SMALL_TENSOR` bytes form runs of up to :data:`RUN_BYTES`; the first read inside a
    run fetches the whole run with one request, and later reads in it (from any thread) copy
    from that. Larger reads go straight to the file, so a rank restoring its FSDP rows of a
    large tensor still downloads only those rows; of the small tensors it downloads every
    row, which costs at most their total size once per rank.

    Memory: at most :data:`KEPT_RUN_BYTES` of runs (plus those being read) are held; the
    oldest goes first, and is fetched again if something in it is read later -- correct,
    only slower. Readers that go through a file's tensors in order never refetch.
    """

    def __init__(self, file: RemoteFile, spans: Iterable[tuple[int, int]]) -> None:
        self._file = file
        self._runs = _runs_of(spans)
        self._starts = [start for start, _ in self._runs]
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, Future[bytearray]] = OrderedDict()
        self._kept_bytes = 0

    @property
    def url(self) -> str:
        return self._file.url

    @property
    def size(self) -> int:
        return self._file.size

    def read_into(self, offset: int, view: memoryview) -> None:
        run = self._run_holding(offset, len(view))
        if run is None:
            self._file.read_into(offset, view)
            return
        data = self._fetch(run)
        at = offset - run[0]
        view[:] = memoryview(data)[at : at + len(view)]

    def _run_holding(self, offset: int, n: int) -> tuple[int, int] | None:
        index = bisect.bisect_right(self._starts, offset) - 1
        if index < 0:
            return None
        start, end = self._runs[index]
        return (start, end) if offset + n <= end else None

    def _fetch(self, run: tuple[int, int]) -> bytearray:
        start, end = run
        with self._lock:
            future = self._kept.get(start)
            mine = future is None
            if future is None:
                future = Future()
                self._kept[start] = future
                self._kept_bytes += end - start
                while self._kept_bytes > KEPT_RUN_BYTES and len(self._kept) > 1:
                    old_start, _ = self._kept.popitem(last=False)
                    self._kept_bytes -= self._end_of(old_start) - old_start
            else:
                self._kept.move_to_end(start)
        if not mine:
            return future.result()
        try:
            data = bytearray(end - start)
            self._file.read_into(start, memoryview(data))
        except BaseException as exc:
            with self._lock:  # not kept: a later read tries again (and names its own failure)
                if self._kept.get(start) is future:
                    del self._kept[start]
                    self._kept_bytes -= end - start
            future.set_exception(exc)
            raise
        future.set_result(data)
        return data

    def _end_of(self, start: int) -> int:
        return self._runs[bisect.bisect_left(self._starts, start)][1]


def _runs_of(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Runs of at least two consecutive small spans (``(start, end)`` byte ranges), in order."""
    runs: list[tuple[int, int]] = []
    start = end = -1
    count = 0

    def close() -> None:
        if count >= 2:
            runs.append((start, end))

    for a, b in sorted(spans):
        small = b - a <= SMALL_TENSOR
        if small and count and a >= end and a - end <= RUN_GAP and b - start <= RUN_BYTES:
            end, count = b, count + 1
            continue
        close()
        start, end, count = (a, b, 1) if small else (-1, -1, 0)
    close()
    return runs
