"""Reading and writing the safetensors format straight from and into tensor memory.

The files are ordinary safetensors files (``safetensors.torch.load_file`` and transformers read
them). We write them ourselves instead of calling ``safetensors.torch.save_file`` because that
builds one ``bytes`` object holding every tensor (a full second copy of the state) and never
fsyncs; and we read them ourselves so that an in-place restore copies each tensor once, from the
file into its target, and so that every malformed header becomes a clear error naming the file.

Format: 8-byte little-endian header length N, N bytes of JSON header (padded with spaces to a
multiple of 8), then the tensor bytes, each tensor's ``data_offsets`` relative to the end of the
header, contiguous and covering the whole data section.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from orbit_pt._format import checksum as _checksum
from orbit_pt._format import progress as _progress
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
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointTypeError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise CheckpointTypeError(
            f"tensor {name!r} has layout {tensor.layout}; only dense tensors can be saved -- "
            "call .to_dense() on it first"
        )
    if tensor.is_quantized or tensor.is_nested:
        raise CheckpointTypeError(
            f"tensor {name!r} is quantized or nested and cannot be saved as it is"
        )
    return tensor.detach().to("cpu").contiguous()


class SafetensorsReader:
    """Validated access to the tensors of one safetensors file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries, self.metadata = _read_header(path)

    def keys(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read tensor ``name`` into ``out`` (same dtype and shape, contiguous CPU) or a new one."""
        entry = self.entries[name]
        if out is None:
            out = torch.empty(entry.shape, dtype=entry.dtype)
        with open(self.path, "rb", buffering=0) as f:
            _read_into(f, entry.start, tensor_bytes(out), self.path)
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
        """Every tensor, read in file order with one open file."""
        out: dict[str, torch.Tensor] = {}
        with open(self.path, "rb", buffering=0) as f:
            for name, entry in self.entries.items():
                tensor = torch.empty(entry.shape, dtype=entry.dtype)
                _read_into(f, entry.start, tensor_bytes(tensor), self.path)
                out[name] = tensor
        return out


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


def _read_into(f: object, offset: int, view: memoryview, path: Path) -> None:
    fd = f.fileno()  # type: ignore[attr-defined]
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


def _read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    def corrupt(reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{path} is not a valid safetensors file ({reason}); the checkpoint step holding it "
            "is damaged -- restore another step"
        )

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise corrupt("shorter than its 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8 or header_len > 100 << 20:
                raise corrupt(f"header length {header_len} does not fit a file of {size} bytes")
            raw = f.read(header_len)
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read {path}: {exc}") from exc
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise corrupt(f"header is not valid JSON: {exc}") from exc
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype = NAME_TO_DTYPE[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise corrupt(f"entry {name!r} is malformed: {exc}") from exc
        if (
            any(d < 0 for d in shape)
            or end - begin != math.prod(shape) * dtype.itemsize
            or begin < 0
        ):
            raise corrupt(f"entry {name!r} has offsets {begin}..{end} that do not fit {shape}")
        if data_start + end > size:
            raise corrupt(
                f"entry {name!r} ends at byte {data_start + end} but the file has {size} bytes "
                "(truncated)"
            )
        entries[name] = TensorEntry(name, dtype, shape, data_start + begin, data_start + end)
    return entries, metadata


def create_file(path: Path, header: bytes, data_size: int) -> None:
    """Create ``path`` holding ``header`` followed by ``data_size`` bytes still to be written.

    The data section is left as a hole that ``_direct_io.RangeWriter`` fills, in any order and
    from any process: that is what lets each rank of a distributed save write only its own rows.
    """
    with open(path, "xb", buffering=0) as f:
        f.write(header)
        f.truncate(len(header) + data_size)


def read_range(fd: int, offset: int, view: memoryview, path: Path) -> None:
    """Fill ``view`` from absolute file ``offset`` of ``fd``; a short file names ``path``."""
    _read_into(_Fd(fd), offset, view, path)


class _Fd:
    """Adapts a raw descriptor to the ``fileno()`` interface :func:`_read_into` expects."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd
