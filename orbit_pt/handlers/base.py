"""The handler protocol: how one item of a checkpoint is written and read back.

A handler writes only inside the folder the manager gives it (``step_.../<item name>/``); the
manager owns everything else -- the temporary folder, fsync of the whole step, the metadata
file and the commit. A handler is identified on disk by its ``name``, which the step's metadata
records so that a restore without explicit handlers picks the same handler again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from orbit_pt._control.collective import Collective
from orbit_pt.errors import StateMismatchError


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
        shared_files: on save, every rank writes the step's files in place, in one folder on
            a filesystem they all see (a local or shared-filesystem root); a tensor box that is
            not whole rows may then be written run by run rather than moved to rows first.
            False for object-store roots and outside a manager.
        exclude: on restore, the fields of this item that ``restore(..., exclude=("item.field",
            ...))`` leaves out: they keep their live values. Only a :class:`FieldsHandler` is
            given any, and only fields its :meth:`FieldsHandler.saved_fields` listed.
    """

    step: int
    items: Mapping[str, Any] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    saved_world_size: int = 1
    collective: Collective | None = None
    shared_files: bool = False
    exclude: frozenset[str] = frozenset()


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


@runtime_checkable
class RangeReadingHandler(Handler, Protocol):
    """A handler whose ``restore`` reads its ``.safetensors`` files by byte range, not whole.

    Such a handler reads those files only through ``_format.safetensors.SafetensorsReader`` and
    asks ``_format.remote_files.is_file`` (not the disk) whether one is there. Restoring a step
    of an object-store root, the manager then leaves its ``.safetensors`` files in the store,
    and each rank reads only the bytes it loads (docs/object-storage.md). The built-in handlers
    are such handlers; every other handler finds all the files of its item on disk.
    """

    reads_by_range: bool
    """True when ``restore`` keeps to the rules above."""


@dataclass(frozen=True)
class SavedFields:
    """The named fields of an item as saved, and which of them cannot be restored here.

    Attributes:
        names: every field of the item, in saved order (``("step", "epoch", "rng", ...)`` for a
            :class:`orbit_pt.RecipeState`).
        per_rank: on a world size other than the one that saved the item, field -> why it
            cannot be restored on this one (its state differs between the ranks that saved it,
            or it is a data loader's position); it must be excluded. Empty on the same world
            size, where each rank restores its own state.
        item_per_rank: why the item as a whole cannot be restored on this world size (per-rank
            state outside its named fields), or None.
    """

    names: tuple[str, ...]
    per_rank: Mapping[str, str] = field(default_factory=dict)
    item_per_rank: str | None = None


@runtime_checkable
class FieldsHandler(Handler, Protocol):
    """A handler whose items are made of named fields that a restore can leave out one by one.

    ``restore(step, items, exclude=("recipe.rng",))`` names fields of such items. The manager
    calls :meth:`saved_fields` before it loads anything -- on every rank, inside the restore's
    agreement -- to check each excluded field and to refuse per-rank fields on another world
    size; then ``restore`` gets the item's excluded fields in ``context.exclude`` and leaves
    them out. The state handler is one (a field is a top-level key of the saved state).
    """

    def saved_fields(
        self, directory: Path, target: Any | None, context: HandlerContext
    ) -> SavedFields:
        """The fields of the item saved in ``directory``, to be restored into ``target``."""
        ...


def per_rank_error(
    problems: Mapping[str, str],
    exclude: Sequence[str],
    *,
    step: int,
    saved_world_size: int,
    world_size: int,
) -> StateMismatchError:
    """The error for per-rank state that cannot be restored on another world size.

    Args:
        problems: ``"item.field"`` (or ``"item"``) -> why it cannot be restored here.
        exclude: the whole ``exclude=`` that accepts them (what was excluded already, plus
            every key of ``problems``).
        step: the step being restored.
        saved_world_size: the number of ranks that saved the step.
        world_size: the number of ranks restoring it.
    """
    lines = "\n  ".join(f"{name}: {why}" for name, why in problems.items())
    spelled = ", ".join(f'"{name}"' for name in exclude)
    if len(exclude) == 1:
        spelled += ","
    error = StateMismatchError(
        f"step {step} was saved on {saved_world_size} rank(s) and is restored on {world_size}; "
        f"{len(problems)} part(s) of it hold per-rank state, which cannot be carried over to "
        f"another number of ranks:\n  {lines}\n"
        f"Restore on {saved_world_size} rank(s), or leave them out so that they keep their live "
        f"values (fresh RNG seeds, a data loader starting its data over): "
        f"restore(..., exclude=({spelled})). An object that can reshard its per-rank states "
        "may implement load_state_dict_from_ranks(states) instead (docs/elastic.md)"
    )
    # What an integration that calls restore() for its user names in its own advice.
    error.excludable = tuple(exclude)  # type: ignore[attr-defined]
    return error
