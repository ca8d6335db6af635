"""The msgpack encoding of nested state, shared by the state and optimizer handlers.

A structure -- dicts, lists, tuples, numbers, strings, bytes, None, torch dtypes -- is stored as
msgpack, with each tensor and numpy array replaced by a reference to its name in a companion
safetensors file (the extension codes are documented in docs/format.md). Nothing is pickled: a
value that neither format can represent is refused at save time with the path where it sits.

Saving: :func:`encode` the state (collecting its tensors), then :func:`pack` it. Restoring:
:func:`read_structure`, :func:`check_refs` against the safetensors reader, then
:func:`materialize` (or read the :class:`TensorRef`\\ s into live tensors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from orbit_pt._format.safetensors import DTYPE_TO_NAME, SafetensorsReader, torch_dtype_name
from orbit_pt.errors import CheckpointTypeError, CorruptCheckpointError

# msgpack extension codes (documented in docs/format.md).
_EXT_TENSOR = 1  # payload: the tensor's name in the safetensors file (utf-8)
_EXT_TUPLE = 2  # payload: a msgpack array of the tuple's elements
_EXT_NDARRAY = 3  # payload: like _EXT_TENSOR, restored as a numpy array
_EXT_DTYPE = 4  # payload: a torch dtype's name, e.g. "float32"

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_SAFETENSORS_METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a read structure: its name in the safetensors file.

    Attributes:
        name: the tensor's name in the safetensors file.
        as_numpy: it was saved from a numpy array, and is restored as one.
    """

    name: str
    as_numpy: bool = False


def join_path(path: str, key: Any) -> str:
    """The path of ``key`` below ``path`` (``state/0/exp_avg``): tensor names, messages."""
    return f"{path}/{key}" if path else str(key)


# ------------------------------------------------------------------------------------ encoding


def encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` ready for :func:`pack`, each tensor moved into ``tensors`` under its path.

    Args:
        value: the state to encode.
        path: where ``value`` sits ("" for the root); it prefixes its tensors' names.
        tensors: receives every tensor (numpy arrays as tensors), by name.
    """
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
            out[key] = encode(sub, join_path(path, key), tensors)
        return out
    if isinstance(value, list):
        return [encode(v, join_path(path, i), tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):  # includes torch.Size and named tuples (restored as tuples)
        inner = [encode(v, join_path(path, i), tensors) for i, v in enumerate(value)]
        return msgpack.ExtType(_EXT_TUPLE, pack(inner))
    if isinstance(value, torch.dtype):
        return msgpack.ExtType(_EXT_DTYPE, torch_dtype_name(value).encode())
    if type(value).__module__ == "numpy":
        return _encode_numpy(value, path, tensors)
    hint = loader_hint(value)
    raise CheckpointTypeError(
        f"the value at {path or '<root>'} is a {type(value).__module__}.{type(value).__name__}, "
        "which orbit_pt cannot store without pickle; "
        + (
            hint
            or "give it a state_dict() of tensors, numbers, strings and containers, or convert "
            "it before saving"
        )
    )


def loader_hint(value: Any) -> str:
    """What to do instead of saving ``value``, when it is a plain DataLoader or its iterator."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    if not isinstance(value, (DataLoader, _BaseDataLoaderIter)) or has_state_dict(value):
        return ""
    return (
        "a torch.utils.data.DataLoader has no state to save. Use "
        "torchdata.stateful_dataloader.StatefulDataLoader (a drop-in replacement with "
        "state_dict()/load_state_dict()), or keep the loader out of the checkpoint: record the "
        "number of batches consumed in the recipe and skip that many after resume, with a "
        "seeded sampler (docs/handlers.md, 'Data loaders')"
    )


def has_state_dict(obj: Any) -> bool:
    """Whether ``obj`` is stateful: it has both ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def pack(encoded: Any) -> bytes:
    """The msgpack bytes of an :func:`encode`\\ d value (or of a dict holding several)."""
    return msgpack.packb(encoded, use_bin_type=True)  # type: ignore[no-any-return]


def _encode_numpy(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return encode(value.item(), path, tensors)
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


# ------------------------------------------------------------------------------------ decoding


def read_structure(path: Path) -> Any:
    """The structure stored in the msgpack file ``path``, tensors as :class:`TensorRef`."""

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR:
            return TensorRef(data.decode())
        if code == _EXT_NDARRAY:
            return TensorRef(data.decode(), as_numpy=True)
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


def check_refs(structure: Any, reader: SafetensorsReader, structure_file: str) -> None:
    """Refuse a ``structure`` (read from ``structure_file``) naming tensors the reader lacks."""
    missing = [r.name for r in _refs(structure) if r.name not in reader.entries]
    if missing:
        raise CorruptCheckpointError(
            f"{reader.path} lacks tensors that {structure_file} refers to: {missing[:10]}; "
            "the step is damaged -- restore another step"
        )


def materialize(value: Any, reader: SafetensorsReader) -> Any:
    """``value`` with every :class:`TensorRef` read from ``reader`` as a new CPU tensor."""
    if isinstance(value, TensorRef):
        tensor = reader.read(value.name)
        return tensor.numpy() if value.as_numpy else tensor
    if isinstance(value, dict):
        return {k: materialize(v, reader) for k, v in value.items()}
    if isinstance(value, list):
        return [materialize(v, reader) for v in value]
    if isinstance(value, tuple):
        return tuple(materialize(v, reader) for v in value)
    return value


def _refs(value: Any) -> list[TensorRef]:
    if isinstance(value, TensorRef):
        return [value]
    if isinstance(value, Mapping):
        return [r for v in value.values() for r in _refs(v)]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs(v)]
    return []
