"""The state handler: plain nested state and anything with ``state_dict()``/``load_state_dict()``.

On disk (in the item's folder):

- ``state.msgpack``: the structure -- dicts, lists, tuples, numbers, strings, bytes, None -- with
  each tensor replaced by a reference to its name in the safetensors file;
- ``tensors.safetensors``: every tensor, named by its path in the structure (``state/0/exp_avg``).

Nothing is pickled: an object that msgpack and safetensors cannot represent is refused at save
time with the path where it sits. The encoding is :mod:`orbit_pt.handlers._codec`'s, which the
optimizer handler shares.

Under torch.distributed each rank saves its own copy into ``rank_XXXXX/``. The top-level keys of
a saved mapping are the item's *fields* (a :class:`orbit_pt.RecipeState`'s ``step``, ``rng``,
``dataloader``...): ``restore(..., exclude=("recipe.rng",))`` leaves one out, and on another world
size each field is restored from rank 0 when every rank saved it alike, and refused by name
when it is per rank (docs/elastic.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orbit_pt._format.safetensors import SafetensorsReader, tensor_bytes, write_safetensors
from orbit_pt._format.staging import StagingPool
from orbit_pt.errors import CheckpointValueError, CorruptCheckpointError
from orbit_pt.handlers._codec import (
    TensorRef,
    check_refs,
    encode,
    has_state_dict,
    join_path,
    materialize,
    pack,
    read_structure,
)
from orbit_pt.handlers._mismatch import load_state_dict, raise_mismatches
from orbit_pt.handlers.base import HandlerContext, SavedFields, per_rank_error

STRUCTURE_FILE = "state.msgpack"
TENSORS_FILE = "tensors.safetensors"


class StateHandler:
    """Default handler for plain dicts and objects with ``state_dict()``/``load_state_dict()``.

    Schedulers, GradScaler, ``StatefulDataLoader`` and user objects all work, as long as their
    state is made of tensors, numpy arrays, numbers, strings, bytes, None and containers.

    It is a :class:`~orbit_pt.handlers.base.FieldsHandler`: the fields of an item are the
    top-level string keys of its saved state that do not start with ``"_"``.
    """

    name = "state"
    # From an object-store root its .safetensors files are read by range (RangeReadingHandler).
    reads_by_range = True

    def __init__(self) -> None:
        self._pool = StagingPool()

    def stage(self, item: Any, context: HandlerContext) -> _Snapshot:
        """Encode the structure now and copy every tensor into reused host buffers."""
        structure, tensors = _encode_item(item)
        return _Snapshot(structure, self._pool.copy_all(tensors))

    def save(self, directory: Path, item: Any, context: HandlerContext) -> Mapping[str, Any]:
        if isinstance(item, _Snapshot):
            structure, tensors = item.structure, item.tensors
        else:
            structure, tensors = _encode_item(item)
        if context.world_size > 1:
            # Each rank keeps its own copy: RNG and data position differ between ranks, and
            # state that is the same on every rank is recognised as such at restore.
            directory = directory / rank_dir_name(context.rank)
            directory.mkdir()
        (directory / STRUCTURE_FILE).write_bytes(structure)
        write_safetensors(directory / TENSORS_FILE, tensors)
        return {
            "format_version": 1,
            "tensors": len(tensors),
            "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        }

    def saved_fields(
        self, directory: Path, target: Any | None, context: HandlerContext
    ) -> SavedFields:
        """The top-level keys of the saved state (``"_"``-prefixed ones are not fields), and,
        on another world size, which of them hold per-rank state (see :func:`_plan_restore`)."""
        return _plan_restore(directory, target, context).fields

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        plan = _plan_restore(directory, target, context)
        excluded = context.exclude
        unknown = sorted(excluded - set(plan.fields.names))
        if unknown:
            raise CheckpointValueError(
                f"exclude names field(s) {unknown} of the state in {directory}, which it does not "
                f"hold; its fields are {list(plan.fields.names)}"
            )
        if plan.source is None:  # the target reshards every rank's state itself
            states = [materialize(_without(s.structure, excluded), s.reader) for s in plan.ranks]
            assert target is not None
            target.load_state_dict_from_ranks(states)
            return target
        item = directory.name  # the manager names each item's folder after the item
        blocked = {
            f"{item}.{name}": why
            for name, why in plan.fields.per_rank.items()
            if name not in excluded
        }
        if plan.fields.item_per_rank is not None:
            blocked = {item: plan.fields.item_per_rank}
        if blocked:
            raise per_rank_error(
                blocked,
                [*(f"{item}.{name}" for name in sorted(excluded)), *blocked],
                step=context.step,
                saved_world_size=context.saved_world_size,
                world_size=context.world_size,
            )
        structure = _without(plan.source.structure, excluded)
        reader = plan.source.reader
        if target is None:
            return materialize(structure, reader)
        if has_state_dict(target):
            current = target.state_dict()
            _raise_mismatches(_mismatches(structure, current, reader, "", strict_keys=False))
            _load_state(target, materialize(structure, reader), current, excluded, directory)
            return target
        live = target
        if excluded and isinstance(target, Mapping):
            live = {key: value for key, value in target.items() if key not in excluded}
        _raise_mismatches(_mismatches(structure, live, reader, "", strict_keys=True))
        return _load_into(structure, target, reader)


def rank_dir_name(rank: int) -> str:
    """The folder of one rank's state when the item was saved by several ranks."""
    return f"rank_{rank:05d}"


@dataclass(frozen=True)
class _Saved:
    """One saved copy of the state: its structure and the tensors it refers to."""

    structure: Any
    reader: SafetensorsReader


@dataclass(frozen=True)
class _RestorePlan:
    """What a rank restores: ``source``, or (None) ``ranks`` for a target that reshards them."""

    source: _Saved | None
    ranks: list[_Saved]
    fields: SavedFields


def _read(directory: Path) -> _Saved:
    structure = read_structure(directory / STRUCTURE_FILE)
    reader = SafetensorsReader(directory / TENSORS_FILE)
    check_refs(structure, reader, STRUCTURE_FILE)
    return _Saved(structure, reader)


def _plan_restore(directory: Path, target: Any, context: HandlerContext) -> _RestorePlan:
    """Which saved state this rank restores, and what cannot be restored on this world size.

    On the world size it was saved with, each rank restores its own. On another world size,
    state that every rank saved identically (an LR scheduler, a step counter) is restored from
    rank 0; state that differs between the ranks (RNG, data position) cannot be, nor can a
    data loader's position even when every rank saved the same one (it counts batches of this
    rank's share of the data, and the shares change with the number of ranks). When the saved
    state is a mapping this is decided per field (top-level key), so that the per-rank fields
    can be excluded and the others restored; otherwise for the whole item. A target that
    implements ``load_state_dict_from_ranks(states)`` is given every rank's state to reshard.
    """
    if (directory / STRUCTURE_FILE).is_file():
        saved = [_read(directory)]  # saved by one process: every rank restores it
    else:
        dirs = [directory / rank_dir_name(r) for r in range(context.saved_world_size)]
        missing = [d for d in dirs if not (d / STRUCTURE_FILE).is_file()]
        if missing:
            raise CorruptCheckpointError(
                f"{directory} should hold the state of {context.saved_world_size} ranks, but "
                f"{missing[0]} is missing; the step is damaged -- restore another step"
            )
        if context.saved_world_size == context.world_size:
            own = _read(dirs[context.rank])
            return _RestorePlan(own, [own], SavedFields(_field_names([own])))
        saved = [_read(d) for d in dirs]
        if callable(getattr(target, "load_state_dict_from_ranks", None)):
            return _RestorePlan(None, saved, SavedFields(_field_names(saved)))
    names = _field_names(saved)
    if context.saved_world_size == context.world_size:
        return _RestorePlan(saved[0], saved, SavedFields(names))
    return _RestorePlan(saved[0], saved, _per_rank_fields(saved, names, target))


def _per_rank_fields(saved: list[_Saved], names: tuple[str, ...], target: Any) -> SavedFields:
    """Which fields of the state saved by ``saved``'s ranks are per rank (see _plan_restore)."""
    differs = f"holds per-rank state that differs between the {len(saved)} ranks that saved it"
    loader = "is a data loader's position, which is per rank (it counts this rank's share)"
    if _is_loader(target):
        return SavedFields(names, item_per_rank=loader)
    if not all(isinstance(s.structure, dict) for s in saved):
        same = all(_same(saved[0].structure, saved[0], s.structure, s) for s in saved[1:])
        return SavedFields(names, item_per_rank=None if same else differs)
    keys = dict.fromkeys(key for s in saved for key in s.structure)
    differing = [key for key in keys if not _same_in_every_rank(key, saved)]
    if any(key not in names for key in differing):  # outside the named fields
        return SavedFields(names, item_per_rank=differs)
    per_rank = dict.fromkeys(differing, differs)
    for name in names:
        if name not in per_rank and _is_loader(_live_field(target, name)):
            per_rank[name] = loader
    return SavedFields(names, per_rank=per_rank)


def _field_names(saved: list[_Saved]) -> tuple[str, ...]:
    """The named fields of the saved state: its top-level string keys not starting with "_"."""
    names: dict[str, None] = {}
    for copy in saved:
        if isinstance(copy.structure, dict):
            names.update(
                (key, None)
                for key in copy.structure
                if isinstance(key, str) and key and not key.startswith("_")
            )
    return tuple(names)


def _same_in_every_rank(key: Any, saved: list[_Saved]) -> bool:
    first = saved[0]
    if key not in first.structure:
        return False
    return all(
        key in s.structure and _same(first.structure[key], first, s.structure[key], s)
        for s in saved[1:]
    )


def _same(a: Any, in_a: _Saved, b: Any, in_b: _Saved) -> bool:
    """Whether two ranks saved the same value (tensors compared byte for byte; NaN == NaN)."""
    if isinstance(a, TensorRef) or isinstance(b, TensorRef):
        if not (isinstance(a, TensorRef) and isinstance(b, TensorRef)) or a.as_numpy != b.as_numpy:
            return False
        entry_a, entry_b = in_a.reader.entries[a.name], in_b.reader.entries[b.name]
        if entry_a.dtype != entry_b.dtype or entry_a.shape != entry_b.shape:
            return False
        return tensor_bytes(in_a.reader.read(a.name)) == tensor_bytes(in_b.reader.read(b.name))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], in_a, b[k], in_b) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, in_a, y, in_b) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and bool(a == b)


def _is_loader(value: Any) -> bool:
    return isinstance(value, torch.utils.data.DataLoader)


def _live_field(target: Any, name: str) -> Any:
    """The live value of field ``name`` of the target, or None."""
    if isinstance(target, Mapping):
        return target.get(name)
    if target is None or isinstance(target, torch.Tensor):
        return None
    return getattr(target, name, None)


def _without(structure: Any, excluded: frozenset[str]) -> Any:
    if not excluded or not isinstance(structure, dict):
        return structure
    return {key: value for key, value in structure.items() if key not in excluded}


def _load_state(
    target: Any, state: Any, current: Any, excluded: frozenset[str], directory: Path
) -> None:
    """Load ``state`` (which lacks the excluded fields) into a stateful target.

    An object that can leave fields as they are implements
    ``load_state_dict_excluding(state, excluded)`` (:class:`orbit_pt.RecipeState` does); any
    other gets ``load_state_dict`` with each excluded field taken from its own current
    ``state_dict()``, so that those fields keep their live values.
    """
    partial = getattr(target, "load_state_dict_excluding", None)
    if excluded and callable(partial):
        partial(state, excluded)
        return
    if excluded and isinstance(current, Mapping):
        state = {**state, **{key: current[key] for key in excluded if key in current}}
    load_state_dict(target, state, directory)


@dataclass(frozen=True)
class _Snapshot:
    """An item staged for a background save: its msgpack bytes and host copies of its tensors."""

    structure: bytes
    tensors: dict[str, torch.Tensor]


def _encode_item(item: Any) -> tuple[bytes, dict[str, torch.Tensor]]:
    state = item.state_dict() if has_state_dict(item) else item
    tensors: dict[str, torch.Tensor] = {}
    return pack(encode(state, "", tensors)), tensors


def _mismatches(
    saved: Any, target: Any, reader: SafetensorsReader, path: str, *, strict_keys: bool
) -> list[str]:
    """Every place where the saved state does not fit the live target, as readable lines."""
    where = path or "<root>"
    if strict_keys and isinstance(target, torch.Tensor) and _kind(saved) != "a tensor":
        # A live tensor (a parameter, a buffer) is loaded in place or not at all: replacing it
        # by another value would silently unbind it from whatever else holds it.
        return [f"{where}: saved {_kind(saved)}, target a tensor"]
    if isinstance(saved, TensorRef) and isinstance(target, torch.Tensor) and not saved.as_numpy:
        entry = reader.entries[saved.name]
        if tuple(target.shape) != entry.shape or target.dtype != entry.dtype:
            return [
                f"{where}: saved {entry.dtype} {list(entry.shape)}, "
                f"target {target.dtype} {list(target.shape)}"
            ]
        return []
    if isinstance(saved, dict) and isinstance(target, Mapping):
        problems = []
        if strict_keys:
            problems += [
                f"{join_path(path, k)}: in the target but not in the checkpoint"
                for k in target
                if k not in saved
            ]
        for key, sub in saved.items():
            if key in target:
                problems += _mismatches(
                    sub, target[key], reader, join_path(path, key), strict_keys=strict_keys
                )
        return problems
    sequences = (list, tuple)
    if isinstance(saved, sequences) and isinstance(target, sequences) and len(saved) == len(target):
        return [
            problem
            for i, (s, t) in enumerate(zip(saved, target, strict=True))
            for problem in _mismatches(s, t, reader, join_path(path, i), strict_keys=strict_keys)
        ]
    if strict_keys and _holds_tensor(target):
        return [f"{where}: saved {_kind(saved)}, target {_kind(target)} holding tensors"]
    return []


def _kind(value: Any) -> str:
    """A short description of a saved or live value, for mismatch messages."""
    if isinstance(value, TensorRef):
        return "a numpy array" if value.as_numpy else "a tensor"
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, (list, tuple, Mapping)):
        return f"a {type(value).__name__} of {len(value)} element(s)"
    return f"a {type(value).__name__}"


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _raise_mismatches(problems: list[str]) -> None:
    raise_mismatches(
        problems,
        f"the checkpoint does not fit the object being restored ({len(problems)} problem(s))",
        fix="Restore without a target to get the saved state as it is, or build the object "
        "with the shapes and dtypes it was saved with.",
    )


def _load_into(saved: Any, target: Any, reader: SafetensorsReader) -> Any:
    """Load ``saved`` into ``target`` in place where the target is mutable; return the result."""
    if isinstance(saved, TensorRef) and isinstance(target, torch.Tensor) and not saved.as_numpy:
        with torch.no_grad():  # _mismatches made sure that shape and dtype agree
            return reader.read_into(saved.name, target)
    if isinstance(saved, dict) and isinstance(target, MutableMapping):
        for key, sub in saved.items():
            target[key] = (
                _load_into(sub, target[key], reader) if key in target else materialize(sub, reader)
            )
        return target
    sequences = (list, tuple)
    if isinstance(saved, sequences) and isinstance(target, sequences) and len(saved) == len(target):
        loaded = [_load_into(s, t, reader) for s, t in zip(saved, target, strict=True)]
        if isinstance(saved, tuple):
            return tuple(loaded)  # a new tuple, holding the target's own tensors
        if isinstance(target, list):
            target[:] = loaded
            return target
        return loaded
    return materialize(saved, reader)
