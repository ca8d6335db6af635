"""Which bytes of a safetensors file each rank writes and reads, for FSDP2 and other DTensors.

FSDP2 shards every parameter on dim 0, so a rank's local shard is a block of whole rows of the
full tensor -- one contiguous byte range of it in a safetensors file. A save therefore needs no
gathering: every rank computes the same file plan from global names, dtypes and shapes, rank 0
creates each file (header, final length), and after one agreement every rank ``pwrite``\\ s its
rows at ``tensor start + first row * row bytes``. A restore reads only the rows a rank holds,
straight into its local shard, whatever the number of ranks that wrote the file.

What each rank writes of one tensor is a :class:`Piece`:

- a plain tensor (a buffer, an unsharded model, Adam's ``step``) is written whole by rank 0;
- a DTensor whose placements are ``Shard(0)``/``Replicate`` only (FSDP2, HSDP) is written as row
  blocks, each by one rank: the one with coordinate 0 on every replicated mesh dimension;
- any other layout (``Shard(1)`` from tensor parallelism, ``_StridedShard``, ``Partial``) is
  gathered with ``full_tensor()`` -- a collective on the tensor's own mesh, so it runs while
  staging, on the training thread -- and written whole by the mesh's first rank, with a log line.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from orbit_pt._control.collective import Collective
from orbit_pt._format import checksum as _checksum
from orbit_pt._format import coverage as _coverage
from orbit_pt._format.checksum import Checksum
from orbit_pt._format.direct_io import RangeWriter
from orbit_pt._format.safetensors import (
    PlannedFile,
    SafetensorsReader,
    TensorEntry,
    create_file,
    fits_in_place,
    tensor_bytes,
)
from orbit_pt._format.staging import StagingPool
from orbit_pt.errors import CheckpointValueError, CorruptCheckpointError

logger = logging.getLogger(__name__)

try:  # torch.distributed is optional in some torch builds
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class Piece:
    """What this rank writes of one tensor.

    Attributes:
        shape: the global shape (what the file plan records).
        dtype: the tensor's own dtype (the plan may cast it, e.g. ``export_dtype``).
        data: the rows this rank writes, starting at global row ``row``; None when another
            rank writes them (or there are none).
        row: the first global row of ``data`` (0 for a whole tensor).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    data: torch.Tensor | None
    row: int = 0


def is_dtensor(tensor: Any) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def row_block(tensor: Any) -> tuple[int, int, bool] | None:
    """``(first row, rows, writes)`` of a DTensor's local shard, or None if it is not whole rows.

    ``writes`` says whether this rank is the one replica that writes the block. A 0-dim tensor
    counts as one row.
    """
    placements = tuple(tensor.placements)
    if not all(isinstance(p, Replicate) or (type(p) is Shard and p.dim == 0) for p in placements):
        return None
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not part of this tensor's mesh: nothing to write or read
        return 0, 0, False
    shape = tuple(tensor.shape)
    if not shape:
        first, rows = 0, 1
    else:
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        if tuple(local_shape[1:]) != shape[1:] or any(offset[1:]):
            return None
        first, rows = int(offset[0]), int(local_shape[0])
    writes = all(
        c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate)
    )
    return first, rows, writes


def piece_of(name: str, tensor: torch.Tensor, *, rank: int) -> Piece:
    """What this rank writes of ``tensor``; gathers layouts that are not row blocks.

    Collective for a DTensor that needs gathering: call it on every rank of its mesh, for the
    same tensors in the same order, on the training thread.
    """
    shape, dtype = tuple(tensor.shape), tensor.dtype
    if not is_dtensor(tensor):
        return Piece(shape, dtype, tensor.detach() if rank == 0 else None)
    block = row_block(tensor)
    if block is not None:
        first, rows, writes = block
        local = tensor.to_local().detach()  # type: ignore[attr-defined]
        if shape and local.shape[0] != rows:
            raise CheckpointValueError(
                f"tensor {name!r}: rank {rank} holds {tuple(local.shape)} of {shape}, but its "
                f"placements {tensor.placements} say {rows} row(s) from row {first}; the "  # type: ignore[attr-defined]
                "DTensor is inconsistent -- save it after the optimizer step completes"
            )
        return Piece(shape, dtype, local if writes and rows else None, first if shape else 0)
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    logger.info(
        "tensor %r has placements %s on a mesh of shape %s, which are not blocks of whole rows; "
        "gathering it with full_tensor() to write it from one rank",
        name,
        tensor.placements,  # type: ignore[attr-defined]
        tuple(mesh.shape),
    )
    full = tensor.full_tensor().detach()  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    first_rank = coordinate is not None and all(c == 0 for c in coordinate)
    return Piece(shape, dtype, full.to("cpu") if first_rank else None)


def plan_digest(files: Sequence[PlannedFile]) -> str:
    """A short hash of the file names and headers: equal on every rank when the plans agree."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.filename.encode())
        digest.update(f.header)
    return digest.hexdigest()[:16]


def write_files(
    directory: Path,
    files: Sequence[PlannedFile],
    pieces: Mapping[str, Piece],
    *,
    rank: int,
    world_size: int,
    collective: Collective | None,
    what: str,
) -> None:
    """Create the planned ``files`` in ``directory`` (rank 0) and write this rank's pieces.

    ``pieces`` holds this rank's :class:`Piece` of every tensor the files plan, by name.

    Under torch.distributed one agreement on ``collective`` sits between the two: it is the
    barrier that orders rank 0's file creation before every other rank's writes, and it also
    checks that every rank computed the same plan, so ranks holding different models fail
    instead of writing a wrong checkpoint.
    """
    if world_size > 1:
        if collective is None or not collective.enabled:
            raise CheckpointValueError(
                f"{what}: a save on {world_size} ranks needs HandlerContext.collective to agree "
                "on the files; call the handler through CheckpointManager, or pass the "
                "manager's collective in the context"
            )
        digest = plan_digest(files)

        def create() -> None:
            if rank == 0:
                for f in files:
                    _create(directory / f.filename, f)

        # One agreement is both the barrier (files exist before anyone writes) and the check
        # that every rank planned the same files.
        _, digests = collective.agree(
            "orbit_pt.handler.create_files",
            create,
            label=f"creating the files of {what}",
            share=lambda _: digest,
        )
        if len(set(digests)) > 1:
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            raise CheckpointValueError(
                f"{what}: rank(s) {differ} planned different files than rank 0 (tensor names, "
                "dtypes or global shapes differ between ranks); every rank must save the same "
                "model -- pipeline-parallel stages are not supported by this handler"
            )
    else:
        for f in files:
            _create(directory / f.filename, f)
    for f in files:
        path = directory / f.filename
        planned = [(entry, pieces[entry.name]) for entry in f.tensors]
        mine = sorted(
            ((e, p) for e, p in planned if p.data is not None and p.data.numel()),
            key=lambda ep: ep[0].start + ep[1].row * _row_bytes(ep[0]),
        )
        if not mine:
            continue
        if not path.exists():
            # This rank's folder is its own (an object-store save from several machines): a
            # sparse copy of the file's length takes its rows; the ranks' copies are joined in
            # the store.
            with open(path, "xb", buffering=0) as new:
                new.truncate(len(f.header) + f.data_size)
        writer = RangeWriter(path)
        try:
            if world_size == 1 and _covers_file(f, mine):
                # One writer for the whole file: stream it in order and hash it on the way,
                # so the commit need not read it back for its checksum.
                checksum = Checksum()
                views = (tensor_bytes(_piece_bytes(e, p)) for e, p in mine)
                size = len(f.header) + f.data_size
                writer.write(0, itertools.chain([memoryview(f.header)], views), checksum, size=size)
                _checksum.record(path, checksum.value())
                _coverage.record(path, 0, size, None)
            else:
                # Each range's CRC-32C, computed as it is written: rank 0 combines the ranks'
                # ranges into the file's checksum, so nobody reads the file back.
                for entry, piece in mine:
                    data = tensor_bytes(_piece_bytes(entry, piece))
                    offset = entry.start + piece.row * _row_bytes(entry)
                    crc = _checksum.RangeChecksum()
                    writer.write(offset, [data], crc)
                    _coverage.record(path, offset, len(data), crc.crc)
        finally:
            writer.close()


def _create(path: Path, f: PlannedFile) -> None:
    create_file(path, f.header, f.data_size)
    _coverage.record(path, 0, len(f.header), _checksum.crc_of(f.header))


def _covers_file(f: PlannedFile, mine: Sequence[tuple[TensorEntry, Piece]]) -> bool:
    """Whether ``mine`` are whole tensors that tile the file's data section in order."""
    position = len(f.header)
    for entry, piece in mine:
        if piece.row != 0 or entry.start != position or piece.data is None:
            return False
        if piece.data.numel() * entry.dtype.itemsize != entry.nbytes:
            return False
        position = entry.end
    return position == len(f.header) + f.data_size


def _piece_bytes(entry: TensorEntry, piece: Piece) -> torch.Tensor:
    """``piece`` as contiguous CPU memory of the planned dtype, checked against the plan."""
    assert piece.data is not None
    # Converted one piece at a time: at most one converted copy is alive, never the state.
    data = piece.data.detach().to("cpu", entry.dtype).contiguous()
    nbytes = data.numel() * data.element_size()
    offset = piece.row * _row_bytes(entry)
    if offset + nbytes > entry.nbytes:
        raise CheckpointValueError(
            f"tensor {entry.name!r}: {nbytes} bytes from row {piece.row} do not fit its "
            f"{entry.nbytes} bytes in the file plan; it changed while being saved"
        )
    if piece.row == 0 and tuple(data.shape) == entry.shape and nbytes != entry.nbytes:
        raise CheckpointValueError(
            f"tensor {entry.name!r} has {nbytes} bytes but the file plan expects "
            f"{entry.nbytes}; it changed while being saved"
        )
    return data


def _row_bytes(entry: TensorEntry) -> int:
    if not entry.shape or entry.shape[0] == 0:
        return entry.nbytes
    return entry.nbytes // entry.shape[0]


# ------------------------------------------------------------------------------------ restore


def read_local(
    reader: SafetensorsReader, name: str, like: Any, out: torch.Tensor | None
) -> torch.Tensor:
    """This rank's part of tensor ``name``, laid out like the DTensor ``like``.

    Row blocks are read straight from the file into ``out`` (or a new tensor); other layouts
    read the whole tensor and keep this rank's slice of it. The result has the file's dtype
    unless it was read into ``out``.
    """
    entry = reader.entries[name]
    block = row_block(like)
    if block is None:
        logger.info(
            "tensor %r has placements %s, which are not blocks of whole rows; reading it whole "
            "from %s and keeping this rank's part",
            name,
            like.placements,
            reader.where,
        )
        full = reader.read(name).to(like.to_local().device, like.dtype)
        local = distribute_tensor(
            full, like.device_mesh, like.placements, src_data_rank=None
        ).to_local()
        if out is not None:
            out.copy_(local)
            return out
        return local
    first, rows, _ = block
    local_shape = (rows, *entry.shape[1:]) if entry.shape else ()
    direct = out is not None and fits_in_place(out, entry.dtype, local_shape)
    buffer = out if direct else torch.empty(local_shape, dtype=entry.dtype)
    assert buffer is not None
    view = tensor_bytes(buffer)
    if len(view):
        start = entry.start + (first * _row_bytes(entry) if entry.shape else 0)
        if start + len(view) > entry.end:
            raise CorruptCheckpointError(
                f"{reader.where}: rows {first}..{first + rows} of {name!r} lie outside its "
                f"{entry.shape[0]} saved rows; the step does not fit this model"
            )
        reader.read_range(start, view)  # only these rows: from the disk, or by ranged requests
    if out is not None and not direct:
        out.copy_(buffer)
        return out
    return buffer


def stage_pieces(pool: StagingPool, pieces: Mapping[str, Piece]) -> dict[str, Piece]:
    """``pieces`` with their data copied into ``pool``'s reused host buffers (for async saves)."""
    copies = pool.copy_all({n: p.data for n, p in pieces.items() if p.data is not None})
    return {n: p if p.data is None else replace(p, data=copies[n]) for n, p in pieces.items()}
