"""A step saved by another number of ranks than the run restoring it: what the integrations
leave out, said once in one form."""

from __future__ import annotations

import logging

from orbit_pt.manager import CheckpointManager

RNG_LEFT_OUT = (
    "the RNG is not restored (it is per rank), so the run goes on with other random numbers"
)


def saved_by_this_world(
    mgr: CheckpointManager, step: int, world: int, left_out: str, log: logging.Logger
) -> bool:
    """Whether ``step`` was saved by ``world`` ranks; if not, log a warning that ``left_out``
    (what the caller then does not restore, and what follows) applies."""
    saved = mgr.metadata(step).world_size
    if saved == world:
        return True
    log.warning(
        "step %d was saved by %d rank(s), this run has %d: %s", step, saved, world, left_out
    )
    return False
