"""One optimizer state for a model split over ranks (pipeline stages), saved and restored.

Each pipeline stage has its own optimizer over its own parameters. A save writes one
``optimizer.msgpack`` with the union (rank 0 merges every stage's structure: state by parameter
name, param groups of every stage, each parameter listed once); a restore refuses a saved
parameter only when no rank's optimizer updates it. See docs/layouts.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack

from orbit_pt.handlers._mismatch import raise_mismatches
from orbit_pt.handlers._optimizer_fit import Fit
from orbit_pt.handlers.base import HandlerContext


def unpack_structure(packed: bytes) -> dict[str, Any]:
    """An encoded structure as packed by ``_codec.pack`` (tensor references left as they are)."""
    out = msgpack.unpackb(packed, raw=False, strict_map_key=False)
    assert isinstance(out, dict)
    return out


def merge_structures(packed: Sequence[bytes]) -> bytes:
    """Every rank's optimizer structure, in rank order, as one.

    State and shapes are joined by parameter name (a name on several ranks -- data-parallel
    replicas, tied weights on two stages -- is the same parameter: the first rank's is kept).
    Param groups are every rank's, a parameter listed in the first group that has it; a group
    left empty (a replica's copy of a group) is dropped.
    """
    documents = [unpack_structure(p) for p in packed]
    merged = documents[0]
    listed = {name for group in merged["param_groups"] for name in group["params"]}
    for document in documents[1:]:
        for name, value in document["state"].items():
            merged["state"].setdefault(name, value)
        merged["param_shapes"] = {**document["param_shapes"], **merged["param_shapes"]}
        for group in document["param_groups"]:
            params = [name for name in group["params"] if name not in listed]
            if params:
                merged["param_groups"].append({**group, "params": params})
                listed.update(params)
    return msgpack.packb(merged, use_bin_type=True)  # type: ignore[no-any-return]


def held_elsewhere(
    fit: Callable[[bool], Fit],
    context: HandlerContext,
    *,
    label: str,
    strict: bool,
    item: str,
    directory: Path,
) -> Fit:
    """``fit`` agreed by every rank: a saved parameter is unexpected only if no rank has it.

    On one process (or without the context's collective) this is ``fit(False)``. Otherwise
    every rank fits without refusing the saved parameters its optimizer lacks, inside one
    agreement -- a rank whose optimizer does not fit fails every rank before any rank reads --
    and the parameters no rank's optimizer updates are then refused (``strict``) or reported.
    """
    collective = context.collective
    if context.world_size == 1 or collective is None or not collective.enabled:
        return fit(False)
    plan, theirs = collective.agree(
        "orbit_pt.handler.optimizer_plan",
        lambda: fit(True),
        label=label,
        share=lambda fitted: fitted.unexpected,
    )
    nowhere = set.intersection(*(set(names) for names in theirs))
    unexpected = [name for name in plan.unexpected if name in nowhere]
    if strict:
        raise_mismatches(
            [f"{name} is in the checkpoint but not in any rank's optimizer" for name in unexpected],
            f"the optimizer state saved in {directory} does not fit item {item!r}, the "
            f"optimizers being restored ({len(unexpected)} problem(s)); nothing was loaded",
            fix="To restore the parameters both have and leave the others as they are, pass "
            f"CheckpointManager(..., handlers={{{item!r}: OptimizerHandler(strict=False)}}).",
        )
    return dataclasses.replace(plan, unexpected=unexpected)
