"""Reading and writing the safetensors format straight from and into tensor memory.

The files are ordinary safetensors files (``safetensors.torch.load_file`` and transformers read
them). We write them ourselves instead of calling ``safetensors.torch.save_file`` because that
builds one ``bytes`` object holding every tensor (a full second copy of the state) and never
fsyncs; and we read them ourselves so that an in-place restore copies each tensor once, from the
file into its target, and so that every malformed header becomes a clear error naming the file.

Format: 8-byte little-endian header length N, N bytes of JSON header (padded with spaces to a
multiple of 8), then the tensor bytes, each tensor's ``data_offsets`` relative to the end of the
header, contiguous and covering the whole data section.

Reading is bounded (docs/format.md, "Reading limits"): the header is at most
:data:`MAX_HEADER_BYTES`, is a JSON object of entries checked field by field (dtype a known name,
shape non-negative integers, offsets two integers inside the file, matching the shape, together
covering the data section without gap or overlap), so that a hostile header is a
:class:`~orbit_pt.CorruptCheckpointError` naming the file before any tensor is allocated.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from orbit_pt._format import checksum as _checksum
from orbit_pt._format import direct_io as _direct_io
from orbit_pt._format import progress as _progress
from orbit_pt._format import remote_files as _remote_files
from orbit_pt._format import safe_open as _safe_open
from orbit_pt._format.direct_io import RangeWriter
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError, CorruptCheckpointError

DTYPE_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
NAME_TO_DTYPE = {name: dtype for dtype, name in DTYPE_TO_NAME.items()}

# transformers refuses safetensors files whose header metadata lacks format "pt".
HEADER_METADATA: Mapping[str, str] = MappingProxyType({"format": "pt"})

# Reads and writes go through buffers of this size so that no syscall moves gigabytes at once.
_CHUNK = 64 << 20

MAX_HEADER_BYTES = 100_000_000
"""The largest header read, as the safetensors library itself allows."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file (offsets are absolute file offsets)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor; the view keeps the tensor alive."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise CheckpointValueError("tensor_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buffer = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    # The view refers to the ctypes array, which refers to the tensor: the memory cannot be
    # freed while any slice of the view is still in use (say, by a writer thread).
    buffer._orbit_pt_owner = tensor  # type: ignore[attr-defined]
    return memoryview(buffer).cast("B")


@dataclass(frozen=True)
class PlannedFile:
    """The layout of one safetensors file, computed from tensor names, dtypes and shapes alone.

    Every rank of a distributed save computes the same plan without holding the tensors; the
    tensor bytes are written into the planned ranges afterwards (``_format.sharding``).

    Attributes:
        filename: the file's name inside the item's folder.
        header: the file's first bytes (length prefix and JSON header).
        tensors: where each tensor lies, as absolute offsets into the file, in file order.
    """

    filename: str
    header: bytes
    tensors: tuple[TensorEntry, ...]

    @property
    def data_size(self) -> int:
        """Bytes after the header."""
        return sum(t.nbytes for t in self.tensors)


def plan_file(
    filename: str,
    specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
) -> PlannedFile:
    """Lay out ``(name, dtype, shape)`` tensors, in order, as the file ``filename``."""
    header, offsets = build_header(specs, metadata)
    tensors = tuple(
        TensorEntry(name, dtype, tuple(shape), *offsets[name]) for name, dtype, shape in specs
    )
    return PlannedFile(filename, header, tensors)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16``: the name config.json and orbit_pt's metadata use."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The inverse of :func:`torch_dtype_name` (a name another rank wrote)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointValueError(f"{name!r} is not the name of a torch dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``"BF16"``); a clear error for one it cannot store."""
    try:
        return DTYPE_TO_NAME[dtype]
    except KeyError:
        raise CheckpointTypeError(
            f"tensors of dtype {dtype} cannot be stored in safetensors; supported dtypes are "
            f"{', '.join(str(d) for d in DTYPE_TO_NAME)} -- convert the tensor first"
        ) from None


def build_header(
    entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The header bytes (length prefix included) and each tensor's data offsets.

    Only names, dtypes and shapes are needed, so every rank of a distributed save can compute
    the same file layout without holding the tensors.
    """
    header: dict[str, object] = {}
    offsets: dict[str, tuple[int, int]] = {}
    position = 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": dtype_name(dtype),
            "shape": list(shape),
            "data_offsets": [position, position + size],
        }
        offsets[name] = (position, position + size)
        position += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, {name: (a + len(prefix), b + len(prefix)) for name, (a, b) in offsets.items()}


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` to a new file at ``path``, fsync it, and return its size in bytes.

    The bytes go straight from tensor memory to the disk (O_DIRECT where the filesystem allows
    it), and the file's checksum is computed on the way and recorded for the commit.
    """
    cpu = {name: _contiguous_cpu(name, t) for name, t in tensors.items()}
    header, _ = build_header(((n, t.dtype, tuple(t.shape)) for n, t in cpu.items()), metadata)
    views = [memoryview(header), *(tensor_bytes(t) for t in cpu.values())]
    size = sum(len(v) for v in views)
    with open(path, "xb") as f:
        f.truncate(size)
    checksum = _checksum.Checksum()
    writer = RangeWriter(path)
    try:
        writer.write(0, views, checksum)
    finally:
        writer.close()
    _checksum.record(path, checksum.value())
    return size


def _contiguous_cpu(name: str, tensor: torch.Tensor) -> torch.Tensor:
    check_storable(name, tensor)
    return tensor.detach().to("cpu").contiguous()


def check_storable(name: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor that has no dense bytes to store, naming it and saying what to do.

    Checked before any copy (an async save's staging too), so that a sparse, nested, quantized
    or meta tensor is a :class:`~orbit_pt.CheckpointTypeError` / ``CheckpointValueError``
    rather than whatever torch raises when asked to copy it.
    """
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointTypeError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
    if tensor.is_nested:
        raise CheckpointTypeError(
            f"tensor {name!r} is a nested tensor, which safetensors cannot store; save its "
            "components (tensor.unbind()) instead"
        )
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise CheckpointTypeError(
            f"tensor {name!r} has layout {tensor.layout}; only dense tensors can be saved -- "
            "call .to_dense() on it first"
        )
    if tensor.is_quantized:
        raise CheckpointTypeError(
            f"tensor {name!r} is quantized and cannot be saved as it is; dequantize it first "
            "(tensor.dequantize())"
        )
    if tensor.is_meta:
        raise CheckpointValueError(
            f"tensor {name!r} is on the meta device: it has a shape but no data to save; "
            "materialize it first (e.g. module.to_empty(device=...) and load its weights)"
        )


class SafetensorsReader:
    """Validated access to the tensors of one safetensors file.

    The file is opened as ``_format.safe_open`` opens a checkpoint's files (a regular file; no
    link inside a step being restored), its header is checked, and every later read reopens
    that same file (a file swapped in meanwhile is refused). A path that is read remotely in
    this context (``_format.remote_files``: an object-store step being restored) is read by
    byte range from there instead, and nothing of it is on the disk.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._remote = _remote_files.remote_file(path)
        self._identity: _safe_open.Identity | None = None
        if self._remote is not None:
            remote = self._remote
            self.where = remote.url

            def read_remote(n: int, offset: int) -> bytes:
                buffer = bytearray(n)
                remote.read_into(offset, memoryview(buffer))
                return bytes(buffer)

            self.entries, self.metadata = _read_header(read_remote, remote.size, self.where)
            # Runs of small tensors come in one request each, not one per tensor.
            spans = [(entry.start, entry.end) for entry in self.entries.values()]
            self._remote = _remote_files.CoalescedReads(remote, spans)
            return
        self.where = str(path)
        try:
            fd = _safe_open.open_regular(path)
        except OSError as exc:
            raise CorruptCheckpointError(f"cannot read {path}: {exc}") from exc
        try:
            self._identity = _safe_open.identity_of(fd)
            size = os.fstat(fd).st_size
            self.entries, self.metadata = _read_header(
                functools.partial(os.pread, fd), size, self.where
            )
        except OSError as exc:
            raise CorruptCheckpointError(f"cannot read {path}: {exc}") from exc
        finally:
            os.close(fd)

    def keys(self) -> list[str]:
        return list(self.entries)

    @property
    def is_remote(self) -> bool:
        """Whether the bytes come by ranged requests (a restore from object storage)."""
        return self._remote is not None

    def read_range(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` from absolute offset ``offset`` of the file whose header was checked."""
        if self._remote is not None:
            self._remote.read_into(offset, view)
            _progress.advance(len(view))
            return
        fd = self._open()
        try:
            _read_into(fd, offset, view, self.path)
        finally:
            os.close(fd)

    def read_runs(self, offsets: Sequence[int], run: int, view: memoryview) -> None:
        """Fill ``view`` with ``run`` bytes from each absolute offset, one after another: a
        block of a tensor that is not whole rows, read with one open file (local files only)."""
        assert self._remote is None, "ranged requests read whole rows (layouts.from_rows)"
        fd = self._open()
        try:
            for k, offset in enumerate(offsets):
                _read_into(fd, offset, view[k * run : (k + 1) * run], self.path)
        finally:
            os.close(fd)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read tensor ``name`` into ``out`` (same dtype and shape, contiguous CPU) or a new one."""
        entry = self.entries[name]
        if out is None:
            out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_range(entry.start, tensor_bytes(out))
        return out

    def read_into(self, name: str, target: torch.Tensor) -> torch.Tensor:
        """Read tensor ``name`` into ``target`` (same shape; any device, layout or dtype).

        The bytes go straight from the file into ``target``'s memory when it can take them
        (:func:`fits_in_place`); otherwise through a new tensor that is copied, and cast, over.
        """
        entry = self.entries[name]
        if fits_in_place(target, entry.dtype, entry.shape):
            return self.read(name, out=target)
        return target.copy_(self.read(name))

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor, read in file order (with one open file, when it is on the disk)."""
        out = {
            name: torch.empty(entry.shape, dtype=entry.dtype)
            for name, entry in self.entries.items()
        }
        if self._remote is not None:
            _remote_files.for_each(
                list(self.entries.items()),
                lambda item: self.read_range(item[1].start, tensor_bytes(out[item[0]])),
                remote=True,
            )
            return out
        fd = self._open()
        try:
            for name, entry in self.entries.items():
                _read_into(fd, entry.start, tensor_bytes(out[name]), self.path)
        finally:
            os.close(fd)
        return out

    def _open(self) -> int:
        """A read-only descriptor of the file whose header was checked; the caller closes it."""
        assert self._identity is not None
        return _safe_open.reopen(self.path, self._identity)


def fits_in_place(out: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> bool:
    """Whether file bytes of ``dtype`` and ``shape`` can be read straight into ``out``'s memory.

    That needs contiguous CPU memory of the same dtype and shape; a restore into anything else
    reads into a new tensor and copies it over.
    """
    return (
        out.device.type == "cpu"
        and out.is_contiguous()
        and out.dtype == dtype
        and tuple(out.shape) == tuple(shape)
    )


def _read_into(fd: int, offset: int, view: memoryview, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + _CHUNK]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(
                f"{path} is truncated: expected {len(view)} bytes at offset {offset}, "
                f"the file ends after {done}"
            )
        done += n
    _progress.advance(done)


def _read_header(
    read: Callable[[int, int], bytes], size: int, where: str
) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The entries and ``__metadata__`` of a file of ``size`` bytes, every field checked.

    ``read(n, offset)`` reads from the file (``os.pread`` of an open one, or a ranged request);
    ``where`` names the file in messages.
    """

    def corrupt(reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where} is not a valid safetensors file ({reason}); the checkpoint step holding it "
            "is damaged -- restore another step"
        )

    if size < 8:
        raise corrupt("shorter than its 8-byte header length")
    prefix = read(8, 0)
    if len(prefix) < 8:
        raise corrupt("shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > size - 8 or header_len > MAX_HEADER_BYTES:
        raise corrupt(
            f"header length {header_len} does not fit a file of {size} bytes (at most "
            f"{MAX_HEADER_BYTES} bytes of header are read)"
        )
    raw = read(header_len, 8)
    if len(raw) < header_len:
        raise corrupt(f"the file ends inside its {header_len}-byte header")
    try:
        header = json.loads(raw)
    except RecursionError:
        raise corrupt("header is nested too deeply to be a safetensors header") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise corrupt(f"header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise corrupt(f"header is a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise corrupt("__metadata__ is not an object of strings")
    data_start = 8 + header_len
    data_size = size - data_start
    entries = {
        name: _entry(name, info, data_start, data_size, corrupt) for name, info in header.items()
    }
    _check_coverage(entries.values(), data_start, size, corrupt)
    return entries, metadata


def _entry(
    name: str,
    info: object,
    data_start: int,
    data_size: int,
    corrupt: Callable[[str], CorruptCheckpointError],
) -> TensorEntry:
    """One header entry, checked against the schema and the file's size."""
    if not isinstance(info, dict):
        raise corrupt(f"entry {name!r:.80} is a JSON {type(info).__name__}, not an object")
    named = info.get("dtype")
    dtype = NAME_TO_DTYPE.get(named) if isinstance(named, str) else None
    if dtype is None:
        raise corrupt(
            f"entry {name!r:.80} has dtype {named!r:.40}, not one of {', '.join(NAME_TO_DTYPE)}"
        )
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise corrupt(f"entry {name!r:.80} has shape {shape!r:.80}, not a list of integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
        raise corrupt(f"entry {name!r:.80} has data_offsets {offsets!r:.80}, not two integers >= 0")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise corrupt(
            f"entry {name!r:.80} has data_offsets {begin}..{end} outside the file's "
            f"{data_size}-byte data section (truncated?)"
        )
    if _nbytes(shape, dtype.itemsize, limit=data_size) != end - begin:
        raise corrupt(
            f"entry {name!r:.80} has offsets {begin}..{end} that do not fit {dtype} {shape!r:.80}"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _nbytes(shape: list[int], itemsize: int, *, limit: int) -> int:
    """The bytes of a tensor of ``shape``, or ``limit + 1`` as soon as it exceeds ``limit``.

    Never a product of thousands of huge numbers: a hostile shape costs one pass.
    """
    if 0 in shape:
        return 0
    total = itemsize
    for dim in shape:
        total *= dim
        if total > limit:
            return limit + 1
    return total


def _check_coverage(
    entries: Iterable[TensorEntry],
    data_start: int,
    size: int,
    corrupt: Callable[[str], CorruptCheckpointError],
) -> None:
    """The tensors cover the data section exactly: no gap, no overlap, nothing after them."""
    position = data_start
    for entry in sorted(entries, key=lambda e: (e.start, e.end)):
        if entry.start != position:
            raise corrupt(
                f"tensor {entry.name!r:.80} starts at byte {entry.start}, expected {position}: "
                "overlapping or gapped data"
            )
        position = entry.end
    if position != size:
        raise corrupt(f"its tensors end at byte {position}, the file has {size}")


def create_file(path: Path, header: bytes, data_size: int) -> None:
    """Create ``path`` holding ``header`` followed by ``data_size`` bytes still to be written.

    The data section is left as a hole that ``_direct_io.RangeWriter`` fills, in any order and
    from any process: that is what lets each rank of a distributed save write only its own rows.
    """
    with open(path, "xb", buffering=0) as f:
        f.write(header)
        f.truncate(len(header) + data_size)
    _direct_io.report(path, len(header) + data_size, 0, memoryview(header))
