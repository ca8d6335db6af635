"""Which rank checks which file's checksum in a verifying restore under torch.distributed.

A verifying restore reads every byte of the files it checks. Before 0.2 every rank checked every
file: N ranks read the step N times over (N full downloads from an object store, each into the
rank's mirror) to load 1/N of it each under FSDP2. The large files (the ``.safetensors`` that
handlers read by range) are now split between the ranks: each is checked once, in full, by one
rank, and the restore is one agreement, so a checksum that fails on any rank fails the restore
on every rank before anything is loaded. The others read their bytes of it as in a restore
without ``verify``: from the same file on a shared filesystem, or by range from the same
object in the store -- bytes that the checking rank has just read in full.

The split is computed by every rank from the step's metadata alone, so the ranks agree on it
without a message.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping


def assign(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """file -> the rank that checks it: largest files first, each to the least loaded rank.

    Deterministic (ties go to the lower rank, files of equal size in name order), so every
    rank computes the same assignment from the same metadata.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [(0, rank) for rank in range(world_size)]  # (bytes assigned, rank): a min-heap
    out: dict[str, int] = {}
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        assigned, rank = heapq.heappop(load)
        out[rel] = rank
        heapq.heappush(load, (assigned + sizes[rel], rank))
    return out
