"""Where a DTensor's local shard lies in the full tensor, and turning any layout into rows.

A safetensors file stores a tensor row-major, so a block of whole rows is one byte range that
one rank can write or read with one call. FSDP2's ``Shard(0)`` shards are such blocks; tensor
parallelism's ``Shard(1)``, a 2-D ``(Shard(0), Shard(1))`` or an expert-parallel ``Shard(2)`` are
not. Within each *replica group* (the ranks that share a coordinate on every replicated mesh
dimension, and between them hold every element once) :func:`to_rows` moves each rank's box to
an even split of the rows by point-to-point sends, and :func:`from_rows` moves rows back into
boxes. A rank sends and receives at most its own shard, so nothing is ever gathered.
See docs/layouts.md.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from orbit_pt.errors import CheckpointValueError

try:  # torch.distributed is optional in some torch builds
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    # FSDP x TP shards one dimension twice (_StridedShard): the local shard is still one box.
    SHARDS: tuple[type, ...] = (Shard, _StridedShard)
except ImportError:  # pragma: no cover - builds without torch.distributed
    Replicate = Shard = None  # type: ignore[assignment,misc]
    SHARDS = ()


@dataclass(frozen=True)
class Box:
    """A block of the full tensor: ``offset`` and ``shape`` per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_rows(self, full: Sequence[int]) -> bool:
        """Whether the box is whole rows of ``full`` (one byte range of a row-major file)."""
        return tuple(self.shape[1:]) == tuple(full[1:]) and not any(self.offset[1:])

    def meet(self, other: Box) -> Box | None:
        """The intersection of two boxes, or None when they share no element."""
        starts = [max(a, b) for a, b in zip(self.offset, other.offset, strict=True)]
        ends = [
            min(a + n, b + m)
            for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape, strict=True)
        ]
        if any(e <= s for s, e in zip(starts, ends, strict=True)):
            return None
        return Box(tuple(starts), tuple(e - s for s, e in zip(starts, ends, strict=True)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds ``outer``."""
        return tuple(
            slice(o - p, o - p + n)
            for o, n, p in zip(self.offset, self.shape, outer.offset, strict=True)
        )


@dataclass(frozen=True)
class Layout:
    """A DTensor's sharding, as this rank sees it.

    Attributes:
        shape: the global shape.
        group: the global ranks of this rank's replica group, in a fixed order.
        boxes: each member's box, in the order of ``group``.
        index: this rank's position in ``group``.
        writes: whether this rank's replica group is the one that writes (coordinate 0 on
            every replicated mesh dimension).
        mesh_ranks: every global rank of the tensor's mesh (who holds the tensor at all).
    """

    shape: tuple[int, ...]
    group: tuple[int, ...]
    boxes: tuple[Box, ...]
    index: int
    writes: bool
    mesh_ranks: tuple[int, ...]

    @property
    def box(self) -> Box:
        return self.boxes[self.index]

    def rows(self) -> tuple[Box, ...]:
        """The even split of whole rows over the group's members (torch.chunk's sizes)."""
        full = self.shape
        count = len(self.group)
        if not full:
            return tuple(Box((), ()) for _ in range(count))
        step = -(-full[0] // count) if full[0] else 0
        out = []
        for k in range(count):
            first = min(full[0], k * step)
            last = min(full[0], (k + 1) * step)
            out.append(Box((first, *(0 for _ in full[1:])), (last - first, *full[1:])))
        return tuple(out)


def layout_of(tensor: Any) -> Layout | None:
    """The layout of a DTensor, or None when this rank is not on its mesh.

    Raises CheckpointValueError for placements that are not shards or replicas (a ``Partial``
    DTensor must be reduced by its owner first: ``redistribute(..., Replicate())``).
    """
    return _layout(tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape))


# A model's layers share a few (mesh, placements, shape) triples; working each member's box out
# costs milliseconds, and a save or restore asks for every tensor's layout more than once.
@functools.lru_cache(maxsize=4096)
def _layout(mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...]) -> Layout | None:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    for placement in placements:
        if not isinstance(placement, (*SHARDS, Replicate)):
            raise CheckpointValueError(
                f"a DTensor with placements {placements} cannot be saved: {placement} is "
                "neither a shard nor a replica (a Partial holds unreduced sums); reduce it "
                "first, e.g. tensor.redistribute(mesh, [Replicate()]), or save it after the "
                "optimizer step"
            )
    ranks = mesh.mesh
    mesh_shape = tuple(ranks.shape)
    sharded = [d for d, p in enumerate(placements) if isinstance(p, SHARDS)]
    replicated = [d for d, p in enumerate(placements) if not isinstance(p, SHARDS)]
    group: list[int] = []
    boxes: list[Box] = []
    index = -1
    for varied in itertools.product(*(range(mesh_shape[d]) for d in sharded)):
        point = list(coordinate)
        for d, c in zip(sharded, varied, strict=True):
            point[d] = c
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, point, placements)
        if point == list(coordinate):
            index = len(group)
        group.append(int(ranks[tuple(point)].item()))
        boxes.append(Box(tuple(int(o) for o in offset), tuple(int(n) for n in local)))
    return Layout(
        shape=shape,
        group=tuple(group),
        boxes=tuple(boxes),
        index=index,
        writes=all(coordinate[d] == 0 for d in replicated),
        mesh_ranks=tuple(int(r) for r in ranks.flatten().tolist()),
    )


# How much a round of a move sends at most, per rank: a move runs in rounds of row slabs, so
# that its buffers stay a fraction of the shard (at least 4 rounds once a share is 1 MiB).
ROUND_BYTES = 16 * 2**20


def slabs(layout: Layout, itemsize: int) -> list[tuple[Box, ...]]:
    """Each round's slab of every member's row share (the same on every member)."""
    shares = layout.rows()
    if not layout.shape:
        return [shares]
    most = max(box.shape[0] for box in shares)
    share_bytes = most * math.prod(layout.shape[1:]) * itemsize
    count = max(-(-share_bytes // ROUND_BYTES), 4 if share_bytes >= 2**20 else 1)
    count = max(1, min(count, most))
    out = []
    for k in range(count):
        round_boxes = []
        for box in shares:
            step = -(-box.shape[0] // count)
            first = box.offset[0] + min(box.shape[0], k * step)
            last = box.offset[0] + min(box.shape[0], (k + 1) * step)
            round_boxes.append(Box((first, *box.offset[1:]), (last - first, *box.shape[1:])))
        out.append(tuple(round_boxes))
    return out


# A box that is not whole rows is a run of contiguous elements per index of its leading
# dimensions. From a file on this machine's disk, runs of at least this many elements are read
# straight into the rank's shard (one pread per run, through the page cache the node's tensor
# parallel ranks share); shorter runs, and ranged requests to object storage, cost less as
# whole rows read once by their owner and moved between ranks (:func:`from_rows`). A save into
# files all ranks share writes such boxes run by run the same way (no moves, :func:`in_long_runs`).
MIN_DIRECT_RUN = 1024


def _last_partial(box: Box, full: Sequence[int]) -> int:
    """The last dimension the box does not span (-1 for the whole tensor)."""
    return max((d for d in range(len(full)) if box.shape[d] != full[d]), default=-1)


def run_length(box: Box, full: Sequence[int]) -> int:
    """How many elements of the box lie contiguous in the row-major ``full`` tensor."""
    last = _last_partial(box, full)
    return box.numel() if last < 0 else box.shape[last] * math.prod(full[last + 1 :])


def runs(box: Box, full: Sequence[int]) -> tuple[list[int], int]:
    """The element offsets in the row-major ``full`` tensor of the box's contiguous runs, in
    the box's own row-major order, and the length of each run."""
    last = _last_partial(box, full)
    run = run_length(box, full)
    if last < 0 or box.numel() == 0:
        return ([0] if box.numel() else []), run
    strides = [math.prod(full[d + 1 :]) for d in range(len(full))]
    base = sum(o * st for o, st in zip(box.offset, strides, strict=True))
    offsets = [base]
    for d in range(last - 1, -1, -1):  # each leading dimension repeats the runs within it
        offsets = [o + i * strides[d] for i in range(box.shape[d]) for o in offsets]
    return offsets, run


def in_long_runs(layout: Layout) -> bool:
    """Whether every member's box lies in the file as runs of at least :data:`MIN_DIRECT_RUN`
    elements (the same answer on every member: it depends only on the group's boxes)."""
    if not layout.shape:
        return False
    return all(
        run_length(box, layout.shape) >= MIN_DIRECT_RUN for box in layout.boxes if box.numel()
    )


def reads_direct(layout: Layout, *, remote: bool) -> bool:
    """Whether every member of the replica group reads its box of a file straight into its
    shard (no moves), rather than :func:`from_rows` (collective: the same answer on every
    member, since it depends only on the group's boxes and the kind of storage)."""
    return not remote and in_long_runs(layout)


def to_rows(layout: Layout, local: torch.Tensor) -> tuple[Box, torch.Tensor]:
    """This rank's even share of whole rows, moved from every member's box.

    Call it on every member of ``layout.group``, for the same tensors in the same order.
    """
    share = layout.rows()[layout.index]
    out = torch.empty(share.shape, dtype=local.dtype, device=local.device)
    for slab in slabs(layout, local.element_size()):
        mine = slab[layout.index]
        into = out[mine.within(share)] if layout.shape else out
        _exchange(layout.group, layout.index, layout.boxes, slab, local, into)
    return share, out


def from_rows(layout: Layout, read: Callable[[Box], torch.Tensor], out: torch.Tensor) -> None:
    """Fill ``out`` (this rank's box) from every member's even share of whole rows.

    ``read(rows)`` returns the rows of a slab of this rank's share (read from the file), one
    slab per round, so a rank never holds more than a slab of rows besides ``out``. Call it on
    every member of ``layout.group``, for the same tensors in the same order.
    """
    for slab in slabs(layout, out.element_size()):
        source = read(slab[layout.index]).to(out.device, out.dtype)
        _exchange(layout.group, layout.index, slab, layout.boxes, source, out)


def _exchange(
    group: Sequence[int],
    me: int,
    have: Sequence[Box],
    want: Sequence[Box],
    source: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Move the elements each member has (``have``) to the member that wants them (``want``).

    One batch of point-to-point sends and receives on the default process group: each rank
    sends each peer the part of its box that peer wants, and receives what it wants from each
    peer. Buffers are at most this rank's ``have`` plus its ``want``.
    """
    ops = []
    received: list[tuple[Box, torch.Tensor]] = []
    mine = have[me]
    target = want[me]
    for peer, wanted in enumerate(want):
        part = mine.meet(wanted)
        if part is None:
            continue
        if peer == me:
            out[part.within(target)].copy_(source[part.within(mine)])
        else:
            data = source[part.within(mine)].contiguous()
            ops.append(dist.P2POp(dist.isend, data, group[peer]))
    for peer, held in enumerate(have):
        part = held.meet(target)
        if part is None or peer == me:
            continue
        buffer = torch.empty(part.shape, dtype=out.dtype, device=out.device)
        ops.append(dist.P2POp(dist.irecv, buffer, group[peer]))
        received.append((part, buffer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for part, buffer in received:
        out[part.within(target)].copy_(buffer)
