"""Which bytes of a safetensors file each rank writes and reads, for any DTensor layout.

A rank's part of a tensor in a row-major file is one byte range when it is a block of whole
rows (FSDP2's ``Shard(0)``, and FSDP x TP's ``_StridedShard(0)``). A save needs no gathering:
every rank computes the same file plan from global names, dtypes and shapes, rank 0 creates each
file (header, final length), and after one agreement every rank ``pwrite``\\ s its rows at
``tensor start + first row * row bytes``. Any other layout (``Shard(1)``, 2-D meshes, experts
sharded on another dimension) is first moved to rows inside its replica group by
:mod:`._layouts` (point-to-point, at most a shard per rank). Ranks may hold different tensors
(pipeline stages): :func:`settle` agrees on their union and on who writes each tensor once.
A restore reads only each rank's rows, whatever wrote them. See docs/layouts.md.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from orbit_pt._control.collective import Collective
from orbit_pt._format import checksum as _checksum
from orbit_pt._format import coverage as _coverage
from orbit_pt._format import layouts as _layouts
from orbit_pt._format.checksum import Checksum
from orbit_pt._format.direct_io import RangeWriter
from orbit_pt._format.safetensors import (
    PlannedFile,
    SafetensorsReader,
    TensorEntry,
    create_file,
    fits_in_place,
    tensor_bytes,
    torch_dtype,
    torch_dtype_name,
)
from orbit_pt._format.staging import StagingPool
from orbit_pt.errors import CheckpointValueError, CorruptCheckpointError

logger = logging.getLogger(__name__)

try:  # torch.distributed is optional in some torch builds
    from torch.distributed.tensor import DTensor
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
        holder: a DTensor's mesh (its global ranks): the ranks that hold the tensor and decide
            among themselves who writes it; None for a plain tensor.
        pending: rows still to be moved from the replica group's boxes (see :func:`settle`),
            as a call returning ``(first row, rows)``; None when ``data`` is final.
        private: ``data`` is memory of the save's own (moved rows), not the model's: an async
            save need not copy it again when it is already in host memory.
        box: with a ``pending`` move, this rank's box of the tensor, which ``data`` holds, when
            the box lies in the file as long runs (:func:`._layouts.in_long_runs`): a save into
            files every rank shares writes it run by run instead of moving it (see
            :func:`settle_union`). After settling, set only when ``data`` is such a box.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    data: torch.Tensor | None
    row: int = 0
    holder: tuple[int, ...] | None = None
    pending: Callable[[], tuple[int, torch.Tensor]] | None = None
    private: bool = False
    box: _layouts.Box | None = None


def is_dtensor(tensor: Any) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def row_block(tensor: Any) -> tuple[int, int, bool] | None:
    """``(first row, rows, writes)`` of a DTensor's local shard, or None if it is not whole rows.

    ``writes`` says whether this rank is the one replica that writes the block. A 0-dim tensor
    counts as one row.
    """
    layout = _layouts.layout_of(tensor)
    if layout is None:  # not part of this tensor's mesh: nothing to write or read
        return 0, 0, False
    box = layout.box
    if not layout.shape:
        return 0, 1, layout.writes
    if not box.is_rows(layout.shape):
        return None
    return box.offset[0], box.shape[0], layout.writes


def piece_of(name: str, tensor: torch.Tensor, *, rank: int) -> Piece:
    """What this rank writes of ``tensor``; never gathers.

    A plain tensor is kept on every rank until :func:`settle` picks its one writer. A DTensor
    whose local shard is not whole rows gets a ``pending`` move to rows, which :func:`settle`
    runs (collective within the tensor's replica group).
    """
    shape, dtype = tuple(tensor.shape), tensor.dtype
    if not is_dtensor(tensor):
        return Piece(shape, dtype, tensor.detach())
    layout = _layouts.layout_of(tensor)
    if layout is None:
        return Piece(shape, dtype, None)
    holder = layout.mesh_ranks
    local = tensor.to_local().detach()  # type: ignore[attr-defined]
    box = layout.box
    if not shape or box.is_rows(shape):
        rows = box.shape[0] if shape else 1
        if shape and local.shape[0] != rows:
            raise CheckpointValueError(
                f"tensor {name!r}: rank {rank} holds {tuple(local.shape)} of {shape}, but its "
                f"placements {tensor.placements} say {rows} row(s) from row {box.offset[0]}; "  # type: ignore[attr-defined]
                "the DTensor is inconsistent -- save it after the optimizer step completes"
            )
        data = local if layout.writes and rows else None
        return Piece(shape, dtype, data, box.offset[0] if shape else 0, holder)
    if tuple(local.shape) != box.shape:
        raise CheckpointValueError(
            f"tensor {name!r}: rank {rank} holds {tuple(local.shape)} of {shape}, but its "
            f"placements {tensor.placements} say {box.shape}; the DTensor is inconsistent -- "  # type: ignore[attr-defined]
            "save it after the optimizer step completes"
        )
    if not layout.writes:
        return Piece(shape, dtype, None, 0, holder)

    def move() -> tuple[int, torch.Tensor]:
        rows_box, rows = _layouts.to_rows(layout, local)
        return rows_box.offset[0], rows

    if _layouts.in_long_runs(layout):
        return Piece(shape, dtype, local, 0, holder, move, box=box)
    return Piece(shape, dtype, None, 0, holder, move)


def settle(
    pieces: Mapping[str, Piece],
    *,
    rank: int,
    world_size: int,
    collective: Collective | None,
    what: str,
    in_place: bool = False,
) -> dict[str, Piece]:
    """:func:`settle_union` without a value to gather: the agreed pieces only."""
    return settle_union(
        pieces,
        rank=rank,
        world_size=world_size,
        collective=collective,
        what=what,
        in_place=in_place,
    )[0]


def settle_union(
    pieces: Mapping[str, Piece],
    *,
    rank: int,
    world_size: int,
    collective: Collective | None,
    what: str,
    extra: Any = None,
    in_place: bool = False,
) -> tuple[dict[str, Piece], list[Any] | None]:
    """Every rank's pieces of one item, agreed: the union of the tensors, each written once.

    When every rank holds the same tensors (data parallel, FSDP, TP) this is one small
    agreement and plain tensors are written by rank 0. When they differ (pipeline stages), the
    ranks' names, dtypes, shapes and meshes are gathered; the result lists every tensor of any
    rank, in order of the first rank holding it, and a tensor is written by the lowest rank
    holding it (a DTensor: by that rank's mesh). The same name with another dtype or shape on
    two ranks is an error. Then the pending moves to rows run, in that order, on every rank --
    except, with ``in_place`` (every rank writes into the same files, on a filesystem they
    share), for boxes that lie in the file as long runs: those are written run by run, as they
    are, which costs no moves and no memory. ``in_place`` must be the same on every rank.

    Call it on every rank, for the same item; it must not run inside a thread pool.

    Returns the pieces, and -- only when the ranks hold different tensors or ``extra``\\ s --
    every rank's ``extra`` (JSON-able) on rank 0 (an empty list on the others); None when
    they hold the same, or on one process.
    """
    if world_size == 1 or collective is None or not collective.enabled:
        return _resolved(pieces, in_place), None
    mine = [[n, torch_dtype_name(p.dtype), list(p.shape), p.holder] for n, p in pieces.items()]
    # ``extra`` counts too: stages may hold the same tensors yet differ in what rides along
    # (an optimizer before its first step holds no tensors, but its stages' parameters differ).
    digest = hashlib.sha256(repr((mine, extra)).encode()).hexdigest()[:16]
    _, digests = collective.agree(
        "orbit_pt.handler.tensors",
        lambda: None,
        label=f"agreeing on the tensors of {what}",
        share=lambda _: digest,
    )
    if len(set(digests)) == 1:
        same = {
            n: p if p.holder is not None or rank == 0 else replace(p, data=None)
            for n, p in pieces.items()
        }
        return _resolved(same, in_place), None
    _, held = collective.agree(
        "orbit_pt.handler.union",
        lambda: None,
        label=f"gathering the tensors each rank holds of {what}",
        share=lambda _: [[n, d, s, h if h is not None else [rank]] for n, d, s, h in mine],
    )
    union: dict[str, tuple[str, list[int], list[int], int]] = {}
    conflicts: list[str] = []
    for holder_rank, entries in enumerate(held):
        for name, dtype, shape, mesh in entries:
            seen = union.get(name)
            if seen is None:
                union[name] = (dtype, shape, mesh, holder_rank)
            elif (seen[0], seen[1]) != (dtype, shape):
                conflicts.append(
                    f"{name}: rank {seen[3]} holds {seen[0]} {seen[1]}, rank {holder_rank} "
                    f"holds {dtype} {shape}"
                )
    extras: list[Any] = []
    if extra is not None:
        _, extras = collective.agree(
            "orbit_pt.handler.union_extra",
            lambda: None,
            label=f"gathering what each rank holds of {what}",
            share=lambda _: extra,
            to_primary=True,
        )
    if conflicts:
        raise CheckpointValueError(
            f"{what}: {len(conflicts)} tensor(s) are held by several ranks with different "
            f"dtypes or global shapes ({'; '.join(conflicts[:5])}); every rank that holds a "
            "tensor of a given name must hold the same tensor (pipeline stages use the "
            "model's global names, and share only tensors that are the same)"
        )
    settled: dict[str, Piece] = {}
    for name, (dtype, shape, mesh, _) in union.items():
        piece = pieces.get(name)
        own = [rank] if piece is None or piece.holder is None else list(piece.holder)
        if piece is not None and own == mesh:
            settled[name] = piece
        elif piece is not None:
            settled[name] = Piece(piece.shape, piece.dtype, None)
        else:
            settled[name] = Piece(tuple(shape), torch_dtype(dtype), None)
    return _resolved(settled, in_place), extras


def _resolved(pieces: Mapping[str, Piece], in_place: bool) -> dict[str, Piece]:
    """``pieces`` with every pending move to rows run, in order (boxes in long runs are kept
    as they are ``in_place``)."""
    out: dict[str, Piece] = {}
    for name, piece in pieces.items():
        if piece.pending is None:
            out[name] = piece  # a box comes only with its pending move
            continue
        if in_place and piece.box is not None:
            out[name] = replace(piece, pending=None)
            continue
        first, rows = piece.pending()
        data = rows if rows.numel() else None
        out[name] = replace(piece, data=data, row=first, pending=None, private=True, box=None)
    return out


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
                "dtypes or global shapes differ between ranks, or the ranks' handlers are "
                "configured differently, e.g. max_shard_size or export_dtype); every rank must "
                "save the item with the same handler settings"
            )
    else:
        for f in files:
            _create(directory / f.filename, f)
    for f in files:
        path = directory / f.filename
        planned = [(entry, pieces[entry.name]) for entry in f.tensors]
        mine = sorted(
            ((e, p) for e, p in planned if p.data is not None and p.data.numel()),
            key=lambda ep: _first_byte(*ep),
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
                    if piece.box is not None:
                        _write_runs(writer, entry, piece.box, data)
                        continue
                    offset = entry.start + piece.row * _row_bytes(entry)
                    crc = _checksum.RangeChecksum()
                    writer.write(offset, [data], crc)
                    _coverage.record(path, offset, len(data), crc.crc)
        finally:
            writer.close()


def _first_byte(entry: TensorEntry, piece: Piece) -> int:
    """Where in its file the first byte this rank writes of ``entry`` goes."""
    if piece.box is not None:  # the box's first element, row-major (no need for every run)
        strides = [math.prod(entry.shape[d + 1 :]) for d in range(len(entry.shape))]
        first = sum(o * st for o, st in zip(piece.box.offset, strides, strict=True))
        return entry.start + first * entry.dtype.itemsize
    return entry.start + piece.row * _row_bytes(entry)


def _write_runs(
    writer: RangeWriter, entry: TensorEntry, box: _layouts.Box, data: memoryview
) -> None:
    """Write this rank's ``box`` of ``entry`` (``data``: its bytes, row-major) run by run.

    Its CRC covers the box's whole span with zeros between the runs, which is what the ranks'
    coverage summaries fold (the other ranks' runs fill the gaps).
    """
    itemsize = entry.dtype.itemsize
    offsets, run = _layouts.runs(box, entry.shape)
    run_bytes = run * itemsize
    starts = [entry.start + o * itemsize for o in offsets]
    if len(data) != run_bytes * len(starts):
        raise CheckpointValueError(
            f"tensor {entry.name!r}: {len(data)} bytes do not fill the box {box.shape} at "
            f"{box.offset} of {entry.shape}; it changed while being saved"
        )
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    crc = _checksum.RangeChecksum()
    for k, start in enumerate(starts):
        if k:
            crc.skip(start - starts[k - 1] - run_bytes)
        crc.update(view[k * run_bytes : (k + 1) * run_bytes])
    writer.write_runs(starts, run_bytes, view)
    _coverage.record_runs(writer.path, starts, run_bytes, crc.crc)


def _create(path: Path, f: PlannedFile) -> None:
    create_file(path, f.header, f.data_size)
    _coverage.record(path, 0, len(f.header), _checksum.crc_of(f.header))


def _covers_file(f: PlannedFile, mine: Sequence[tuple[TensorEntry, Piece]]) -> bool:
    """Whether ``mine`` are whole tensors that tile the file's data section in order."""
    position = len(f.header)
    for entry, piece in mine:
        if piece.row != 0 or entry.start != position or piece.data is None:
            return False
        if piece.box is not None:
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


def needs_exchange(like: Any, *, remote: bool) -> bool:
    """Whether reading this rank's part of the DTensor ``like`` moves rows between ranks (its
    local shard is not whole rows, and is not read straight from a local file: see
    :func:`._layouts.reads_direct`); such reads are collective within its replica group and
    must run in the same order on every rank, never in a thread pool. ``remote``: the step is
    read by ranged requests."""
    if not is_dtensor(like) or row_block(like) is not None:
        return False
    layout = _layouts.layout_of(like)
    return layout is not None and not _layouts.reads_direct(layout, remote=remote)


def read_local(
    reader: SafetensorsReader, name: str, like: Any, out: torch.Tensor | None
) -> torch.Tensor:
    """This rank's part of tensor ``name``, laid out like the DTensor ``like``.

    Row blocks are read straight from the file into ``out`` (or a new tensor), and so are other
    boxes whose contiguous runs are long enough, from a local file. Any other layout is read as
    the replica group's even share of whole rows -- each member reads its own rows once -- and
    moved into the members' boxes (:func:`._layouts.from_rows`): no rank reads or holds more
    than its share. The result has the file's dtype unless it was read into ``out``.
    """
    entry = reader.entries[name]
    layout = _layouts.layout_of(like)
    if layout is None:
        if out is None:
            raise CheckpointValueError(
                f"tensor {name!r}: this rank is not on the DTensor's mesh and has nothing to read"
            )
        return out
    box = layout.box
    if not entry.shape or box.is_rows(entry.shape):
        return _read_rows(reader, entry, box, out)
    if tuple(entry.shape) != layout.shape:
        raise CorruptCheckpointError(
            f"{reader.where}: {name!r} was saved with shape {tuple(entry.shape)}, but the "
            f"DTensor restored into it has global shape {layout.shape}; the step does not fit "
            "this model"
        )
    local = like.to_local()
    target = (
        out if out is not None else torch.empty(box.shape, dtype=local.dtype, device=local.device)
    )
    if tuple(target.shape) != box.shape:
        raise CorruptCheckpointError(
            f"{reader.where}: {name!r} does not fit its DTensor's local shard {tuple(target.shape)}"
        )
    if _layouts.reads_direct(layout, remote=reader.is_remote):
        return _read_box(reader, entry, box, target)
    _layouts.from_rows(layout, lambda rows: _read_rows(reader, entry, rows, None), target)
    return target


def _read_box(
    reader: SafetensorsReader, entry: TensorEntry, box: _layouts.Box, out: torch.Tensor
) -> torch.Tensor:
    """The elements of ``box``, read run by run from a local file into ``out``."""
    direct = fits_in_place(out, entry.dtype, box.shape)
    buffer = out if direct else torch.empty(box.shape, dtype=entry.dtype)
    offsets, run = _layouts.runs(box, entry.shape)
    itemsize = entry.nbytes // max(1, math.prod(entry.shape))
    starts = [entry.start + offset * itemsize for offset in offsets]
    reader.read_runs(starts, run * itemsize, tensor_bytes(buffer))
    if not direct:
        out.copy_(buffer)
    return out


def _read_rows(
    reader: SafetensorsReader, entry: TensorEntry, box: _layouts.Box, out: torch.Tensor | None
) -> torch.Tensor:
    """The whole rows of ``box``, read from the file into ``out`` (or a new tensor)."""
    name = entry.name
    first, rows = (box.offset[0], box.shape[0]) if entry.shape else (0, 1)
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
    """``pieces`` with their data copied into ``pool``'s reused host buffers (for async saves).

    Rows moved between ranks are already a copy of the save's own; on the CPU they are kept.
    """
    copies = pool.copy_all(
        {n: p.data for n, p in pieces.items() if p.data is not None and not _kept(p)}
    )
    return {n: replace(p, data=copies[n]) if n in copies else p for n, p in pieces.items()}


def _kept(piece: Piece) -> bool:
    return piece.private and piece.data is not None and piece.data.device.type == "cpu"
