"""The state handler: plain nested state and anything with ``state_dict()``/``load_state_dict()``.

On disk (in the item's folder):

- ``state.msgpack``: the structure -- dicts, lists, tuples, numbers, strings, bytes, None -- with
  each tensor replaced by a reference to its name in the safetensors file;
- ``tensors.safetensors``: every tensor, named by its path in the structure (``state/0/exp_avg``).

Nothing is pickled: an object that msgpack and safetensors cannot represent is refused at save
time with the path where it sits.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from orbit_pt._format.safetensors import DTYPE_TO_NAME, SafetensorsReader, write_safetensors
from orbit_pt._format.staging import StagingPool
from orbit_pt.errors import CheckpointTypeError, CorruptCheckpointError, StateMismatchError
from orbit_pt.handlers.base import HandlerContext

STRUCTURE_FILE = "state.msgpack"
TENSORS_FILE = "tensors.safetensors"

# msgpack extension codes used in state.msgpack (documented in docs/format.md).
_EXT_TENSOR = 1  # payload: the tensor's name in tensors.safetensors (utf-8)
_EXT_TUPLE = 2  # payload: a msgpack array of the tuple's elements
_EXT_NDARRAY = 3  # payload: like _EXT_TENSOR, restored as a numpy array
_EXT_DTYPE = 4  # payload: a torch dtype's name, e.g. "float32"

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_SAFETENSORS_METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class _TensorRef:
    name: str
    as_numpy: bool = False


def has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


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
        self._pool.begin()
        staged = {name: self._pool.copy(name, t) for name, t in tensors.items()}
        self._pool.finish()
        return _Snapshot(structure, staged)

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
        structure = _read_structure(directory / STRUCTURE_FILE)
        reader = SafetensorsReader(directory / TENSORS_FILE)
        _check_refs(structure, reader)
        if target is None:
            return _materialize(structure, reader)
        if has_state_dict(target):
            current = target.state_dict()
            _raise_mismatches(_mismatches(structure, current, reader, "", strict_keys=False))
            state = _materialize(structure, reader)
            try:
                target.load_state_dict(state)
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                raise StateMismatchError(
                    f"{type(target).__name__}.load_state_dict rejected the state saved in "
                    f"{directory}: {exc}"
                ) from exc
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
    structure = msgpack.packb(_encode(state, "", tensors), use_bin_type=True)
    return structure, tensors


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return msgpack.ExtType(_EXT_TENSOR, _add_tensor(path, value, tensors).encode())
    if isinstance(value, bool) or value is None or isinstance(value, (str, bytes, float)):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise CheckpointTypeError(
                f"the integer at {path or '<root>'} does not fit in 64 bits; store it as a string"
            )
        return int(value)
    if isinstance(value, Mapping):
        out = {}
        for key, sub in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise CheckpointTypeError(
                    f"dict key {key!r} at {path or '<root>'} is a {type(key).__name__}; only str, "
                    "int, float, bool and None keys can be stored -- convert the key"
                )
            if isinstance(key, int) and not _INT_MIN <= key <= _INT_MAX:
                raise CheckpointTypeError(
                    f"dict key {key} at {path or '<root>'} does not fit in 64 bits; use a str key"
                )
            out[key] = _encode(sub, _join(path, key), tensors)
        return out
    if isinstance(value, list):
        return [_encode(v, _join(path, i), tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):  # includes torch.Size and named tuples (restored as tuples)
        inner = [_encode(v, _join(path, i), tensors) for i, v in enumerate(value)]
        return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(inner, use_bin_type=True))
    if isinstance(value, torch.dtype):
        return msgpack.ExtType(_EXT_DTYPE, str(value).removeprefix("torch.").encode())
    if type(value).__module__ == "numpy":
        return _encode_numpy(value, path, tensors)
    raise CheckpointTypeError(
        f"the value at {path or '<root>'} is a {type(value).__module__}.{type(value).__name__}, "
        "which orbit_pt cannot store without pickle; give it a state_dict() of tensors, numbers, "
        "strings and containers, or convert it before saving"
    )


def _encode_numpy(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return _encode(value.item(), path, tensors)
    if isinstance(value, np.ndarray):
        try:
            # ascontiguousarray makes a 0-dim array 1-dim; the reshape keeps its shape.
            tensor = torch.from_numpy(np.ascontiguousarray(value).reshape(value.shape))
        except (TypeError, ValueError) as exc:  # object dtype, or a non-native byte order
            raise CheckpointTypeError(
                f"the numpy array at {path or '<root>'} has dtype {value.dtype!r}, which has no "
                "tensor equivalent; convert it before saving, e.g. with .astype(...)"
            ) from exc
        return msgpack.ExtType(_EXT_NDARRAY, _add_tensor(path, tensor, tensors).encode())
    raise CheckpointTypeError(
        f"the numpy value at {path or '<root>'} ({type(value).__name__}) is unsupported"
    )


def _add_tensor(path: str, tensor: torch.Tensor, tensors: dict[str, torch.Tensor]) -> str:
    if tensor.dtype not in DTYPE_TO_NAME:
        raise CheckpointTypeError(
            f"the tensor at {path or '<root>'} has dtype {tensor.dtype}, which safetensors "
            f"cannot store; convert it first (e.g. torch.view_as_real for complex tensors)"
        )
    name = path or "<root>"
    suffix = 1
    # Keys that join to the same path ({"a/b": x, "a": {"b": y}}) get a suffix, and so does
    # "__metadata__", the one key a safetensors header reserves for itself.
    while name in tensors or name == _SAFETENSORS_METADATA_KEY:
        name = f"{path}#{suffix}"
        suffix += 1
    tensors[name] = tensor
    return name


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _read_structure(path: Path) -> Any:
    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR:
            return _TensorRef(data.decode())
        if code == _EXT_NDARRAY:
            return _TensorRef(data.decode(), as_numpy=True)
        if code == _EXT_TUPLE:
            return tuple(msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False))
        if code == _EXT_DTYPE:
            dtype = getattr(torch, data.decode(), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown torch dtype {data.decode()!r}")
            return dtype
        raise ValueError(f"unknown msgpack extension code {code}")

    try:
        return msgpack.unpackb(path.read_bytes(), ext_hook=ext_hook, strict_map_key=False)
    # TypeError: garbage that decodes to a map with an unhashable (array) key.
    except (OSError, ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptCheckpointError(
            f"{path} is missing or not valid msgpack ({exc}); the step holding it is damaged -- "
            "restore another step"
        ) from exc


def _refs(value: Any) -> list[_TensorRef]:
    if isinstance(value, _TensorRef):
        return [value]
    if isinstance(value, Mapping):
        return [r for v in value.values() for r in _refs(v)]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs(v)]
    return []


def _check_refs(structure: Any, reader: SafetensorsReader) -> None:
    missing = [r.name for r in _refs(structure) if r.name not in reader.entries]
    if missing:
        raise CorruptCheckpointError(
            f"{reader.path} lacks tensors that {STRUCTURE_FILE} refers to: {missing[:10]}; "
            "the step is damaged -- restore another step"
        )


def _materialize(value: Any, reader: SafetensorsReader) -> Any:
    if isinstance(value, _TensorRef):
        tensor = reader.read(value.name)
        return tensor.numpy() if value.as_numpy else tensor
    if isinstance(value, dict):
        return {k: _materialize(v, reader) for k, v in value.items()}
    if isinstance(value, list):
        return [_materialize(v, reader) for v in value]
    if isinstance(value, tuple):
        return tuple(_materialize(v, reader) for v in value)
    return value


def _mismatches(
    saved: Any, target: Any, reader: SafetensorsReader, path: str, *, strict_keys: bool
) -> list[str]:
    """Every place where the saved state does not fit the live target, as readable lines."""
    where = path or "<root>"
    if strict_keys and isinstance(target, torch.Tensor) and _kind(saved) != "a tensor":
        # A live tensor (a parameter, a buffer) is loaded in place or not at all: replacing it
        # by another value would silently unbind it from whatever else holds it.
        return [f"{where}: saved {_kind(saved)}, target a tensor"]
    if isinstance(saved, _TensorRef) and isinstance(target, torch.Tensor) and not saved.as_numpy:
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
                f"{_join(path, k)}: in the target but not in the checkpoint"
                for k in target
                if k not in saved
            ]
        for key, sub in saved.items():
            if key in target:
                problems += _mismatches(
                    sub, target[key], reader, _join(path, key), strict_keys=strict_keys
                )
        return problems
    sequences = (list, tuple)
    if isinstance(saved, sequences) and isinstance(target, sequences) and len(saved) == len(target):
        return [
            problem
            for i, (s, t) in enumerate(zip(saved, target, strict=True))
            for problem in _mismatches(s, t, reader, _join(path, i), strict_keys=strict_keys)
        ]
    if strict_keys and _holds_tensor(target):
        return [f"{where}: saved {_kind(saved)}, target {_kind(target)} holding tensors"]
    return []


def _kind(value: Any) -> str:
    """A short description of a saved or live value, for mismatch messages."""
    if isinstance(value, _TensorRef):
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
    if problems:
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise StateMismatchError(
            f"the checkpoint does not fit the object being restored ({len(problems)} "
            f"problem(s)):\n  {shown}{more}\nRestore without a target to get the saved state "
            "as it is, or build the object with the shapes and dtypes it was saved with."
        )


def _load_into(saved: Any, target: Any, reader: SafetensorsReader) -> Any:
    """Load ``saved`` into ``target`` in place where the target is mutable; return the result."""
    if isinstance(saved, _TensorRef) and isinstance(target, torch.Tensor) and not saved.as_numpy:
        if target.device.type == "cpu" and target.is_contiguous():
            with torch.no_grad():
                reader.read(saved.name, out=target)
        else:
            with torch.no_grad():
                target.copy_(reader.read(saved.name))
        return target
    if isinstance(saved, dict) and isinstance(target, MutableMapping):
        for key, sub in saved.items():
            target[key] = (
                _load_into(sub, target[key], reader)
                if key in target
                else (_materialize(sub, reader))
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
    return _materialize(saved, reader)
