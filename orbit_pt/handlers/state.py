"""The state handler: plain nested state and anything with ``state_dict()``/``load_state_dict()``.

On disk (in the item's folder):

- ``state.msgpack``: the structure -- dicts, lists, tuples, numbers, strings, bytes, None -- with
  each tensor replaced by a reference to its name in the safetensors file;
- ``tensors.safetensors``: every tensor, named by its path in the structure (``state/0/exp_avg``).

Nothing is pickled: an object that msgpack and safetensors cannot represent is refused at save
time with the path where it sits. The encoding is :mod:`orbit_pt.handlers._codec`'s, which the
optimizer handler shares.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orbit_pt._format.safetensors import SafetensorsReader, write_safetensors
from orbit_pt._format.staging import StagingPool
from orbit_pt.errors import CorruptCheckpointError, StateMismatchError
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
from orbit_pt.handlers.base import HandlerContext

STRUCTURE_FILE = "state.msgpack"
TENSORS_FILE = "tensors.safetensors"


class StateHandler:
    """Default handler for plain dicts and objects with ``state_dict()``/``load_state_dict()``.

    Schedulers, GradScaler, ``StatefulDataLoader`` and user objects all work, as long as their
    state is made of tensors, numpy arrays, numbers, strings, bytes, None and containers.
    """

    name = "state"

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

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        if not (directory / STRUCTURE_FILE).exists():
            rank_dir = _rank_dir_for_restore(directory, target, context)
            if rank_dir is None:  # the target took every rank's state itself
                return target
            directory = rank_dir
        structure = read_structure(directory / STRUCTURE_FILE)
        reader = SafetensorsReader(directory / TENSORS_FILE)
        check_refs(structure, reader, STRUCTURE_FILE)
        if target is None:
            return materialize(structure, reader)
        if has_state_dict(target):
            current = target.state_dict()
            _raise_mismatches(_mismatches(structure, current, reader, "", strict_keys=False))
            load_state_dict(target, materialize(structure, reader), directory)
            return target
        _raise_mismatches(_mismatches(structure, target, reader, "", strict_keys=True))
        return _load_into(structure, target, reader)


def rank_dir_name(rank: int) -> str:
    """The folder of one rank's state when the item was saved by several ranks."""
    return f"rank_{rank:05d}"


def _rank_dir_for_restore(directory: Path, target: Any, context: HandlerContext) -> Path | None:
    """Which rank's saved state this rank restores (None: the target resharded it itself).

    On the world size it was saved with, each rank restores its own. On another world size,
    state that every rank saved identically (an LR scheduler, a step counter) is restored from
    rank 0; state that differs between ranks (RNG, data position) is an error, unless the
    target implements ``load_state_dict_from_ranks(states)`` to reshard it itself.
    """
    saved = context.saved_world_size
    dirs = [directory / rank_dir_name(r) for r in range(saved)]
    missing = [d for d in dirs if not (d / STRUCTURE_FILE).is_file()]
    if missing:
        raise CorruptCheckpointError(
            f"{directory} should hold the state of {saved} ranks, but {missing[0]} is missing; "
            "the step is damaged -- restore another step"
        )
    if saved == context.world_size:
        return dirs[context.rank]
    reshard = getattr(target, "load_state_dict_from_ranks", None)
    if callable(reshard):
        reshard([StateHandler().restore(d, None, context) for d in dirs])
        return None
    if all(_same_files(dirs[0], d) for d in dirs[1:]):
        return dirs[0]
    raise StateMismatchError(
        f"{directory} holds per-rank state that differs between the {saved} ranks that saved "
        f"it, so it cannot be restored on {context.world_size} rank(s). Restore it on "
        f"{saved} ranks, leave this item out of restore(), or give the object a "
        "load_state_dict_from_ranks(states) method that reshards the list of per-rank states"
    )


def _same_files(a: Path, b: Path) -> bool:
    return all(
        (a / name).read_bytes() == (b / name).read_bytes()
        for name in (STRUCTURE_FILE, TENSORS_FILE)
    )


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
