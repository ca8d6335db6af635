"""The handler protocol: how one item of a checkpoint is written and read back.

A handler writes only inside the folder the manager gives it (``step_.../<item name>/``); the
manager owns everything else -- the temporary folder, fsync of the whole step, the metadata
file and the commit. A handler is identified on disk by its ``name``, which the step's metadata
records so that a restore without explicit handlers picks the same handler again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from orbit_pt._control.collective import Collective


@dataclass(frozen=True)
class HandlerContext:
    """What a handler may need to know beyond its own item.

    Attributes:
        step: the step being saved or restored.
        items: every item of this save or restore, by name. The optimizer handler uses it to find
            the model whose parameter names key the optimizer state.
        rank: this process's rank (0 on one process).
        world_size: the number of ranks taking part (1 on one process).
        saved_world_size: on restore, the number of ranks that wrote the step.
        collective: under torch.distributed, the manager's control group (gloo) that the
            step's own agreement runs on; a handler that must coordinate ranks inside ``save``
            (the model and optimizer handlers: rank 0 creates the files, then every rank writes
            its rows) calls ``collective.run_everywhere(tag, fn)``, which is a barrier that
            also agrees on failures (``tag``: a constant string, the same on every rank).
            None on one process, and when a handler is called outside a manager.
    """

    step: int
    items: Mapping[str, Any] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    saved_world_size: int = 1
    collective: Collective | None = None


@runtime_checkable
class Handler(Protocol):
    """Saves and restores one kind of item.

    ``name`` is stored in the step's metadata; keep it stable across versions, and bump
    ``info["format_version"]`` (returned by ``save``) when the layout inside the folder changes.
    """

    name: str

    def save(self, directory: Path, item: Any, context: HandlerContext) -> Mapping[str, Any]:
        """Write ``item`` into the existing, empty ``directory``.

        Files need not be fsynced: the manager fsyncs the whole step before it commits.

        Returns:
            JSON-serialisable information about the item (tensor count, format version, ...),
            stored in the step's metadata under the item's name.
        """
        ...

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        """Read the item saved in ``directory``.

        With a ``target`` (the live object), load into it in place and return it; without, return
        the saved state as plain Python values and CPU tensors. Raise
        :class:`orbit_pt.StateMismatchError` when the target does not fit what was saved.
        """
        ...


@runtime_checkable
class StagingHandler(Handler, Protocol):
    """A handler that supports async saves by splitting ``save`` in two.

    ``stage`` runs in the training thread and must copy everything ``save`` will need into host
    memory -- reusing its buffers from one call to the next, so that memory does not grow --
    and return that snapshot; the manager then calls ``save(directory, snapshot, context)`` on a
    background thread, so ``save`` must accept a snapshot in place of the live item. Once
    ``stage`` returns, the training loop may change the item freely.
    """

    def stage(self, item: Any, context: HandlerContext) -> Any:
        """Snapshot ``item`` into host memory; the result is passed to ``save`` later."""
        ...
