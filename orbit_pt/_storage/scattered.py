"""Saving to an object store from ranks that share no folder: each rank uploads its own bytes.

When the ranks of a save run on several machines, each rank writes its part of the step into a
private local folder (``<mirror>/.orbit-ranks/rank_NNNNN/``): its own files whole (its state
item's ``rank_NNNNN/``), and, for a file several ranks write in ranges (FSDP rows), a sparse
copy holding only its ranges. Nobody ever holds the whole file. Then:

1. every rank reports its files (size, checksum, the ranges it wrote, their CRCs) in the write
   agreement; rank 0 builds the step's metadata from the reports (no file is read back) and an
   :class:`UploadPlan`: a file that one rank wrote whole is uploaded by that rank; a file
   written in ranges is one multipart upload whose parts are cut by ``parts.plan_parts``;
2. rank 0 starts the multipart uploads and sends every rank the plan and the upload ids;
3. agreement ``upload``: every rank uploads its whole files and its direct parts straight from
   its folder, and puts the short runs that belong to another rank's mixed part as small
   *staging* objects (``<step>/_orbit_parts/...``);
4. agreement ``upload.mixed``: each mixed part's sender reads its own runs and the staging
   objects and sends the part;
5. rank 0 completes the uploads (each object's size is checked), deletes the staging objects
   and puts the commit marker, as on one machine.

A failure anywhere fails the save on every rank; rank 0 then aborts the uploads and removes the
step's objects, so nothing is committed and nothing is left.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orbit_pt._storage.parts import Part, plan_parts, runs_of
from orbit_pt._storage.remote import RemoteRoot, each_in_parallel
from orbit_pt.errors import CheckpointError

RANKS_DIR = ".orbit-ranks"
STAGING_DIR = "_orbit_parts"  # inside a step's prefix; names starting with "_" are orbit_pt's


def private_root(mirror: Path, rank: int) -> Path:
    """Where ``rank`` writes its part of a step when the ranks share no folder."""
    return mirror / RANKS_DIR / f"rank_{rank:05d}"


@dataclass
class UploadPlan:
    """Who uploads what of one step (JSON-able through :meth:`to_json`).

    Attributes:
        whole: file -> the rank that uploads it whole from its folder.
        split: file -> (size, parts) for a file uploaded in parts by the ranks that wrote them.
        upload_ids: file -> the id of its multipart upload (set by rank 0 before uploading).
    """

    whole: dict[str, int] = field(default_factory=dict)
    split: dict[str, tuple[int, list[Part]]] = field(default_factory=dict)
    upload_ids: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "whole": self.whole,
            "split": {
                rel: [size, [p.to_json() for p in parts]]
                for rel, (size, parts) in self.split.items()
            },
            "upload_ids": self.upload_ids,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> UploadPlan:
        return cls(
            whole={rel: int(rank) for rel, rank in doc["whole"].items()},
            split={
                rel: (int(size), [Part.from_json(p) for p in parts])
                for rel, (size, parts) in doc["split"].items()
            },
            upload_ids=dict(doc["upload_ids"]),
        )

    @property
    def has_mixed_parts(self) -> bool:
        return any(p.mixed for _, parts in self.split.values() for p in parts)


def plan_upload(
    holders: Mapping[str, Sequence[int]],
    sizes: Mapping[str, int],
    ranges: Mapping[str, Mapping[int, Sequence[Sequence[int]]]],
) -> UploadPlan:
    """The plan for files held by ``holders`` (file -> ranks that have it in their folder).

    ``ranges`` holds, for each file written in ranges, every rank's ``[start, end)`` intervals
    (already checked to tile the file exactly once).
    """
    plan = UploadPlan()
    for rel in sorted(holders):
        by_rank = {r: ivs for r, ivs in ranges.get(rel, {}).items() if ivs}
        if len(by_rank) > 1:
            plan.split[rel] = (sizes[rel], plan_parts(sizes[rel], runs_of(by_rank)))
        else:
            plan.whole[rel] = min(by_rank) if by_rank else min(holders[rel])
    return plan


def staging_key(remote: RemoteRoot, step: int, rel: str, part: int, rank: int) -> str:
    return remote.step_key(step, f"{STAGING_DIR}/{rel}/{part:05d}.{rank:05d}")


def upload_own(
    remote: RemoteRoot, step: int, folder: Path, plan: UploadPlan, rank: int
) -> list[list[Any]]:
    """This rank's share of step 3: whole files, direct parts, staging objects.

    Returns ``[file, part record]`` for every part sent (for rank 0 to complete the uploads).
    """
    store = remote.store
    records: list[list[Any]] = []
    mine = [rel for rel, owner in plan.whole.items() if owner == rank]
    each_in_parallel(lambda rel: remote.upload_file(step, rel, folder / rel), mine)
    for rel, (_, parts) in plan.split.items():
        path = folder / rel
        direct = [p for p in parts if p.uploader == rank and not p.mixed]
        if direct:
            key = remote.step_key(step, rel)
            jobs = [(p.number, _reader(path, [(p.start, p.end)])) for p in direct]
            sent = store.upload_parts(key, plan.upload_ids[rel], jobs)
            records += [[rel, record] for record in sent]
        handed = [p for p in parts if p.mixed and p.uploader != rank and _holds(p, rank)]
        for p in handed:
            runs = [(s, e) for s, e, r in p.pieces if r == rank]
            store.put(staging_key(remote, step, rel, p.number, rank), _reader(path, runs)())
    return records


def upload_mixed(
    remote: RemoteRoot, step: int, folder: Path, plan: UploadPlan, rank: int
) -> list[list[Any]]:
    """This rank's share of step 4: the mixed parts it sends, from its runs and the staging
    objects of the others."""
    store = remote.store
    records: list[list[Any]] = []
    for rel, (_, parts) in plan.split.items():
        mine = [p for p in parts if p.mixed and p.uploader == rank]
        if not mine:
            continue
        jobs = [(p.number, _assembler(remote, step, rel, folder / rel, p, rank)) for p in mine]
        sent = store.upload_parts(remote.step_key(step, rel), plan.upload_ids[rel], jobs)
        records += [[rel, record] for record in sent]
    return records


def complete(remote: RemoteRoot, step: int, plan: UploadPlan, records: Sequence[Any]) -> None:
    """Rank 0, step 5 (before the marker): complete every upload, remove the staging objects."""
    by_file: dict[str, list[Mapping[str, Any]]] = {}
    for rel, record in records:
        by_file.setdefault(rel, []).append(record)

    def finish(rel: str) -> None:
        size, parts = plan.split[rel]
        sent = by_file.get(rel, [])
        if sorted(int(r["PartNumber"]) for r in sent) != [p.number for p in parts]:
            raise CheckpointError(
                f"{rel}: parts {sorted(int(r['PartNumber']) for r in sent)} were sent, "
                f"{[p.number for p in parts]} planned"
            )
        remote.store.complete_upload(remote.step_key(step, rel), plan.upload_ids[rel], sent, size)

    each_in_parallel(finish, sorted(plan.split))
    if plan.has_mixed_parts:
        staged = remote.store.list(remote.step_key(step, STAGING_DIR) + "/")
        remote.store.delete([info.key for info in staged])


def abort(remote: RemoteRoot, step: int, plan: UploadPlan) -> None:
    """Rank 0, after a failure: abort the uploads it started (never raises)."""
    for rel, upload_id in plan.upload_ids.items():
        remote.store.abort_upload(remote.step_key(step, rel), upload_id)


def _holds(part: Part, rank: int) -> bool:
    return any(r == rank for _, _, r in part.pieces)


def _reader(path: Path, runs: Sequence[tuple[int, int]]) -> Callable[[], bytes]:
    """Reads the runs ``[start, end)`` of ``path``, concatenated (when called)."""

    def read() -> bytes:
        with open(path, "rb", buffering=0) as f:
            chunks = [_pread(f.fileno(), start, end, path) for start, end in runs]
        return b"".join(chunks)

    return read


def _assembler(
    remote: RemoteRoot, step: int, rel: str, path: Path, part: Part, rank: int
) -> Callable[[], bytes]:
    """Builds a mixed part: this rank's runs from its file, the others' from staging."""

    def assemble() -> bytes:
        others = sorted({r for _, _, r in part.pieces if r != rank})
        staged = {
            r: remote.store.get(staging_key(remote, step, rel, part.number, r)) for r in others
        }
        cursor = dict.fromkeys(others, 0)
        chunks = []
        with open(path, "rb", buffering=0) as f:
            for start, end, owner in part.pieces:
                if owner == rank:
                    chunks.append(_pread(f.fileno(), start, end, path))
                    continue
                at = cursor[owner]
                chunk = staged[owner][at : at + end - start]
                if len(chunk) != end - start:
                    raise CheckpointError(
                        f"{rel}: the staging object of rank {owner} for part {part.number} is "
                        "shorter than planned"
                    )
                chunks.append(chunk)
                cursor[owner] = at + end - start
        data = b"".join(chunks)
        if len(data) != part.end - part.start:
            raise CheckpointError(f"{rel}: part {part.number} assembled to {len(data)} bytes")
        return data

    return assemble


def _pread(fd: int, start: int, end: int, path: Path) -> bytes:
    data = os.pread(fd, end - start, start)
    if len(data) != end - start:
        raise OSError(f"{path} ended at {start + len(data)} bytes, expected {end}")
    return data
