"""The msgpack encoding of nested state, shared by the state and optimizer handlers.

A structure -- dicts, lists, tuples, numbers, strings, bytes, None, torch dtypes -- is stored as
msgpack, with each tensor and numpy array replaced by a reference to its name in a companion
safetensors file (the extension codes are documented in docs/format.md). Nothing is pickled: a
value that neither format can represent is refused at save time with the path where it sits.

Saving: :func:`encode` the state (collecting its tensors), then :func:`pack` it. Restoring:
:func:`read_structure`, :func:`check_refs` against the safetensors reader, then
:func:`materialize` (or read the :class:`TensorRef`\\ s into live tensors).

Limits (docs/format.md, "Reading limits"): a structure nests at most :data:`MAX_DEPTH` levels of
dicts, lists and tuples. Saving refuses a deeper one, and reading refuses a file that nests
deeper than :data:`READ_MAX_DEPTH`, without recursion: a file is unpacked with its extension
payloads left opaque, and walked with an explicit stack. Every walk of a restored structure
(the handlers' ``materialize``, mismatch checks, in-place loads) may then recurse safely.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from orbit_pt._format import safe_open as _safe_open
from orbit_pt._format.safetensors import DTYPE_TO_NAME, SafetensorsReader, torch_dtype_name
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError, CorruptCheckpointError

# msgpack extension codes (documented in docs/format.md).
_EXT_TENSOR = 1  # payload: the tensor's name in the safetensors file (utf-8)
_EXT_TUPLE = 2  # payload: a msgpack array of the tuple's elements
_EXT_NDARRAY = 3  # payload: like _EXT_TENSOR, restored as a numpy array
_EXT_DTYPE = 4  # payload: a torch dtype's name, e.g. "float32"

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_SAFETENSORS_METADATA_KEY = "__metadata__"

MAX_DEPTH = 100
"""The deepest structure :func:`encode` accepts: dicts, lists and tuples nested this many levels
(real state nests a handful). Deeper is refused at save, never written as a step that cannot
be restored."""
READ_MAX_DEPTH = MAX_DEPTH + 4
"""The deepest structure :func:`read_structure` accepts: :data:`MAX_DEPTH`, plus room for the
few levels a handler wraps around the state it encodes (the optimizer's ``{"state": ...}``)."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a read structure: its name in the safetensors file.

    Attributes:
        name: the tensor's name in the safetensors file.
        as_numpy: it was saved from a numpy array, and is restored as one.
    """

    name: str
    as_numpy: bool = False


# What msgpack unpacks leaves and keys into (exact types: it makes no subclasses), and the
# leaves _ext_hook makes.
_LEAF_TYPES = frozenset({type(None), bool, int, float, str, bytes, TensorRef, torch.dtype})
_KEY_TYPES = frozenset({type(None), bool, int, float, str})


def join_path(path: str, key: Any) -> str:
    """The path of ``key`` below ``path`` (``state/0/exp_avg``): tensor names, messages."""
    return f"{path}/{key}" if path else str(key)


# ------------------------------------------------------------------------------------ encoding


def encode(value: Any, path: str, tensors: dict[str, torch.Tensor], *, depth: int = 0) -> Any:
    """``value`` ready for :func:`pack`, each tensor moved into ``tensors`` under its path.

    Args:
        value: the state to encode.
        path: where ``value`` sits ("" for the root); it prefixes its tensors' names.
        tensors: receives every tensor (numpy arrays as tensors), by name.
        depth: how many dicts, lists and tuples enclose ``value`` (at most :data:`MAX_DEPTH`).
    """
    if isinstance(value, torch.Tensor):
        return msgpack.ExtType(_EXT_TENSOR, _add_tensor(path, value, tensors).encode())
    if isinstance(value, str):
        return _check_text(value, path)
    if isinstance(value, bool) or value is None or isinstance(value, (bytes, float)):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise CheckpointTypeError(
                f"the integer at {path or '<root>'} does not fit in 64 bits; store it as a string"
            )
        return int(value)
    if isinstance(value, (Mapping, list, tuple)):
        depth = _deeper(depth, path)
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
            if isinstance(key, str):
                _check_text(key, path, what="dict key")
            out[key] = encode(sub, join_path(path, key), tensors, depth=depth)
        return out
    if isinstance(value, list):
        return [encode(v, join_path(path, i), tensors, depth=depth) for i, v in enumerate(value)]
    if isinstance(value, tuple):  # includes torch.Size and named tuples (restored as tuples)
        inner = [encode(v, join_path(path, i), tensors, depth=depth) for i, v in enumerate(value)]
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


def _deeper(depth: int, path: str) -> int:
    """The depth inside a container at ``depth``; refused past :data:`MAX_DEPTH`."""
    if depth >= MAX_DEPTH:
        shown = path if len(path) <= 80 else f"{path[:40]}...{path[-30:]}"
        raise CheckpointValueError(
            f"the state is nested more than {MAX_DEPTH} levels deep at {shown or '<root>'} (dicts, "
            "lists and tuples inside each other, or a container that contains itself); orbit_pt "
            f"stores at most {MAX_DEPTH} levels, so that every saved step can be restored -- "
            "flatten it, e.g. into a dict keyed by path"
        )
    return depth + 1


def _check_text(text: str, path: str, *, what: str = "string") -> str:
    """``text``, which must be encodable as UTF-8 (a lone surrogate is not)."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise CheckpointValueError(
                f"the {what} {text[:40]!r} at {path or '<root>'} is not valid Unicode "
                f"({exc.reason} at position {exc.start}), so it cannot be stored as UTF-8; fix "
                "it, or store it as bytes (e.g. text.encode('utf-8', 'surrogatepass'))"
            ) from None
    return text


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
    """The structure stored in the msgpack file ``path``, tensors as :class:`TensorRef`.

    Bounded: the file is read whole (as a regular file, see ``_format.safe_open``), msgpack's
    own lengths cannot exceed its size, and nesting past :data:`READ_MAX_DEPTH` is refused.

    Raises:
        CorruptCheckpointError: naming ``path``, for anything that is not a structure
            :func:`encode` could have written.
    """
    try:
        data = _safe_open.read_bytes(path)  # a FIFO, a link in a step: refused, naming path
    except OSError as exc:
        raise CorruptCheckpointError(
            f"{path} cannot be read ({exc}); the step holding it is damaged -- restore another step"
        ) from exc
    try:
        return decode(data)
    # TypeError: garbage that decodes to a map with an unhashable (array) key.
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptCheckpointError(
            f"{path} is not valid msgpack, or not a structure orbit_pt writes ({exc}); the step "
            "holding it is damaged -- restore another step"
        ) from exc


def read_optimizer_structure(path: Path) -> dict[str, Any]:
    """:func:`read_structure` of an optimizer handler's ``optimizer.msgpack``, its layout checked.

    The handler indexes into the structure (``state``, ``param_groups[i]["params"]``,
    ``param_shapes``); a forged file whose layout differs is refused here, naming the file and
    the field, rather than failing inside the restore with a KeyError.
    """
    structure = read_structure(path)
    problem = optimizer_layout_problem(structure)
    if problem:
        raise CorruptCheckpointError(
            f"{path} is not an optimizer's saved state ({problem}); the step holding it is "
            "damaged -- restore another step"
        )
    return structure  # type: ignore[no-any-return]


def optimizer_layout_problem(structure: Any) -> str:
    """What is wrong with the layout of a decoded ``optimizer.msgpack``; "" when nothing is."""
    if not isinstance(structure, dict):
        return f"it holds a {type(structure).__name__}, not a map"
    state, groups = structure.get("state"), structure.get("param_groups")
    shapes, name = structure.get("param_shapes", {}), structure.get("optimizer_class", "")
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        return "'state' is not a map of parameter names"
    if not isinstance(groups, list) or not all(
        isinstance(g, dict)
        and isinstance(g.get("params"), list)
        and all(isinstance(n, str) for n in g["params"])
        for g in groups
    ):
        return "'param_groups' is not a list of groups, each with a list of parameter names"
    if not isinstance(shapes, dict) or not all(
        isinstance(shape, (list, tuple)) and all(_is_dim(d) for d in shape)
        for shape in shapes.values()
    ):
        return "'param_shapes' is not a map of shapes"
    if not isinstance(name, str):
        return "'optimizer_class' is not a string"
    return ""


def _is_dim(value: Any) -> bool:
    return type(value) is int and value >= 0


def decode(data: bytes, *, max_depth: int = READ_MAX_DEPTH) -> Any:
    """The structure packed in ``data`` (see :func:`read_structure`), decoded without recursion.

    msgpack unpacks the bytes, decoding tensor references and dtypes as it goes but leaving a
    tuple's payload packed (no callback recurses through the C stack); an explicit stack then
    walks the containers, unpacks each tuple's payload the same way, one level deeper, and
    counts the depth. Lists and dicts made only of scalars are passed over at C speed.

    Raises:
        ValueError: not a structure :func:`encode` writes (unknown extension, bad key, too deep).
    """
    holder: list[Any] = [_unpack(data)]
    tuples: list[tuple[Any, Any, list[Any]]] = []  # (container, key, list): becomes a tuple
    stack: list[tuple[Any, int]] = [(holder, 0)]
    while stack:
        container, depth = stack.pop()
        if isinstance(container, dict):
            if not _KEY_TYPES.issuperset(map(type, container)):
                bad = next(k for k in container if type(k) not in _KEY_TYPES)
                raise ValueError(f"a map has a key of type {type(bad).__name__}: {bad!r:.60}")
            if _LEAF_TYPES.issuperset(map(type, container.values())):
                continue
            pairs: Any = container.items()
        else:
            if _LEAF_TYPES.issuperset(map(type, container)):
                continue
            pairs = enumerate(container)
        for key, value in pairs:
            kind = type(value)
            if kind in _LEAF_TYPES:
                continue
            if kind is list or kind is dict:
                _check_depth(depth + 1, max_depth)
                stack.append((value, depth + 1))
            elif kind is _PackedTuple:
                _check_depth(depth + 1, max_depth)
                inner = _unpack(value.data)
                if type(inner) is not list:
                    raise ValueError(f"a tuple's payload is a {type(inner).__name__}, not an array")
                container[key] = inner  # replacing a value keeps a dict's size: safe mid-loop
                tuples.append((container, key, inner))
                stack.append((inner, depth + 1))
            else:  # msgpack's Timestamp (extension -1): never written by encode
                raise ValueError(f"unexpected msgpack value of type {kind.__name__}")
    # Innermost first: a tuple's elements are final before it is made.
    for container, key, inner in reversed(tuples):
        container[key] = tuple(inner)
    return holder[0]


class _PackedTuple:
    """A tuple's payload, still packed: :func:`decode` unpacks it from its own loop."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _unpack(data: bytes) -> Any:
    # msgpack bounds every length by len(data) and nesting by its own fixed stack (a
    # StackError, a ValueError); _ext_hook returns at once, never unpacking anything itself.
    return msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)


def _check_depth(depth: int, max_depth: int) -> None:
    if depth > max_depth:
        raise ValueError(
            f"it nests deeper than {max_depth} levels of maps, arrays and tuples, more than "
            "orbit_pt ever writes"
        )


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TENSOR:
        return TensorRef(data.decode())
    if code == _EXT_NDARRAY:
        return TensorRef(data.decode(), as_numpy=True)
    if code == _EXT_TUPLE:
        return _PackedTuple(data)
    if code == _EXT_DTYPE:
        name = data.decode()
        dtype = _dtypes_by_name().get(name)
        if dtype is None:
            raise ValueError(f"unknown torch dtype {name[:40]!r}")
        return dtype
    raise ValueError(f"unknown msgpack extension code {code}")


@functools.cache
def _dtypes_by_name() -> dict[str, torch.dtype]:
    """Every torch dtype by the name :func:`encode` writes: a lookup, never a ``getattr`` on
    ``torch`` (whose module ``__getattr__`` imports submodules)."""
    return {
        torch_dtype_name(value): value
        for value in vars(torch).values()
        if isinstance(value, torch.dtype)
    }


def check_refs(structure: Any, reader: SafetensorsReader, structure_file: str) -> None:
    """Refuse a ``structure`` (read from ``structure_file``, a name in the reader's folder)
    naming tensors the reader lacks."""
    missing = [r.name for r in _refs(structure) if r.name not in reader.entries]
    if missing:
        raise CorruptCheckpointError(
            f"{reader.path.parent / structure_file} refers to tensors that {reader.path} lacks: "
            f"{missing[:10]}; the step is damaged -- restore another step"
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
