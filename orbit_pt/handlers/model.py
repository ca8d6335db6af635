"""The model handler: an ``nn.Module`` saved as a Hugging Face model folder.

On disk (in the item's folder), exactly what ``transformers`` writes and reads:

- ``model.safetensors``; or, when the weights exceed ``max_shard_size``,
  ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
  (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``);
- ``config.json`` (and ``generation_config.json``) when the module is a transformers model or a
  config is given; any ``extra_files`` (tokenizer files, ...).

Saving goes through a *file plan* computed from tensor names, dtypes and shapes only
(:func:`plan_files`): which file each tensor goes into, each file's header and each tensor's
byte range. Tensor bytes are then written into those ranges (``_format.sharding.write_files``).
Keeping the plan free of tensor data is what lets every rank of a sharded save agree on the files
and write only its own rows into them.

Under torch.distributed with FSDP2 (DTensor parameters sharded on dim 0) every rank writes the
rows of its own local shard into the same files (see :mod:`orbit_pt._format.sharding` and
docs/fsdp.md); the folder is byte for byte the one a single process writes. A restore reads only
the rows each rank holds, whatever the number of ranks that saved.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orbit_pt._format.safetensors import (
    DTYPE_TO_NAME,
    HEADER_METADATA,
    PlannedFile,
    SafetensorsReader,
    plan_file,
    torch_dtype_name,
)
from orbit_pt._format.sharding import (
    Piece,
    is_dtensor,
    piece_of,
    read_local,
    stage_pieces,
    write_files,
)
from orbit_pt._format.staging import StagingPool
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError, CorruptCheckpointError
from orbit_pt.handlers._mismatch import raise_mismatches
from orbit_pt.handlers.base import HandlerContext

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Module names that wrappers insert into state-dict keys: torch.compile, activation
# checkpointing and FSDP1. The checkpoint must not depend on how the model was wrapped.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
_SIZE_UNITS = {
    "GIB": 2**30,
    "MIB": 2**20,
    "KIB": 2**10,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
    "B": 1,
}


# ------------------------------------------------------------------------------- the file plan


@dataclass(frozen=True)
class FilePlan:
    """Which file each tensor goes into, and where; computed from metadata alone.

    The Hugging Face side of the plan (shard names, the index); each file's own layout is a
    :class:`~orbit_pt._format.safetensors.PlannedFile`.
    """

    files: tuple[PlannedFile, ...]

    @property
    def total_size(self) -> int:
        """Bytes of tensor data over all files (what the index's ``total_size`` records)."""
        return sum(f.data_size for f in self.files)

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name."""
        return {t.name: f.filename for f in self.files for t in f.tensors}

    def index(self) -> dict[str, Any] | None:
        """The ``model.safetensors.index.json`` document, or None for a single file."""
        if len(self.files) == 1:
            return None
        return {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}


def plan_files(
    entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], *, max_shard_size: int | None
) -> FilePlan:
    """Lay out tensors into Hugging Face safetensors files.

    Tensors keep their order; a new shard starts when the next tensor would push the current one
    past ``max_shard_size`` (a tensor larger than that gets a shard of its own), as transformers
    does. One shard is written as ``model.safetensors``; more as ``model-0000k-of-0000N``.

    Args:
        entries: ``(name, dtype, shape)`` of every tensor, in the order to write them.
        max_shard_size: the most tensor bytes per file; None for a single file.
    """
    groups: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    current = 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        if max_shard_size is not None and groups[-1] and current + size > max_shard_size:
            groups.append([])
            current = 0
        groups[-1].append((name, dtype, tuple(shape)))
        current += size
    count = len(groups)
    return FilePlan(
        tuple(
            plan_file(
                SINGLE_FILE if count == 1 else f"model-{k:05d}-of-{count:05d}.safetensors",
                group,
                HEADER_METADATA,
            )
            for k, group in enumerate(groups, start=1)
        )
    )


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like ``"2GB"`` (10**9), ``"500MB"`` or ``"1GiB"`` (2**30)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise CheckpointTypeError(
            f"max_shard_size must be an int (bytes) or a string like '2GB', got {value!r}"
        )
    if isinstance(value, int):
        number = value
    else:
        text = value.strip().upper()
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?", text)
        if match is None:
            raise CheckpointValueError(
                f"max_shard_size {value!r} is not a size; write e.g. '2GB', '500MB', '1GiB' or "
                "an int number of bytes"
            )
        number = int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"])
    if number < 1:
        raise CheckpointValueError(f"max_shard_size must be at least 1 byte, got {value!r}")
    return number


# ------------------------------------------------------------------------- names and tied weights


def canonical_name(key: str) -> str:
    """``key`` without the parts wrappers add (``_orig_mod.``, ``_checkpoint_wrapped_module.``)."""
    return ".".join(part for part in key.split(".") if part not in _WRAPPER_PARTS)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``torch.compile``'s wrapper (the one holding ``config`` and ties)."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else module


def canonical_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` under canonical names; the tensors share storage with the module."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in module.state_dict().items():
        name = canonical_name(key)
        if name in out:
            raise CheckpointValueError(
                f"state-dict keys {key!r} and another key both become {name!r} once wrapper "
                "prefixes are removed; rename one of the submodules"
            )
        out[name] = tensor
    return out


def tie_groups(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by the tensor they are (same memory, shape, strides and dtype), in order."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in state.items():
        key: tuple[Any, ...]
        if is_dtensor(tensor):
            # Global facts plus the local shard's storage: the same grouping on every rank,
            # including ranks whose shard has no rows (FSDP2 keeps those in padded storage).
            local = tensor.to_local()  # type: ignore[attr-defined]
            storage = local.untyped_storage().data_ptr()
            key = (
                ("dtensor", storage, local.storage_offset(), tuple(tensor.shape), tensor.dtype)
                if storage
                else (name,)
            )
        elif tensor.numel() == 0 or tensor.device.type == "meta":
            key = (name,)  # nothing to share; never group these
        else:
            key = (
                tensor.device,
                tensor.data_ptr(),
                tuple(tensor.shape),
                tensor.stride(),
                tensor.dtype,
            )
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def kept_name(group: Sequence[str], module: torch.nn.Module) -> str:
    """The name a tied group is saved under: the one transformers keeps.

    transformers lists the names it drops (``lm_head.weight`` when embeddings are tied) in
    ``_tied_weights_keys``; we keep the first name of the group that is not listed, which for
    any other module is the first in state-dict (registration) order.
    """
    dropped = _tied_keys(module)
    for name in group:
        if not any(_matches(pattern, name) for pattern in dropped):
            return name
    return group[0]


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(parameter)`` -> the canonical name the parameter is saved under.

    A parameter reachable under several names (tied weights) gets the name the model handler
    keeps, so optimizer state and model weights always agree on names.
    """
    by_param: dict[int, list[str]] = {}
    for key, param in module.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(canonical_name(key))
    return {pid: kept_name(names, module) for pid, names in by_param.items()}


def _tied_keys(module: torch.nn.Module) -> list[str]:
    inner = unwrap(module)
    keys = getattr(inner, "all_tied_weights_keys", None) or getattr(
        inner, "_tied_weights_keys", None
    )
    if isinstance(keys, Mapping):
        return [str(k) for k in keys]
    if isinstance(keys, (list, tuple, set, frozenset)):
        return [str(k) for k in keys]
    return []


def _matches(pattern: str, name: str) -> bool:
    if pattern == name:
        return True
    try:  # transformers 4.x lists some tied keys as regular expressions
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


# --------------------------------------------------------------------------------- the handler


@dataclass(frozen=True)
class _StagedModel:
    """What a save writes: this rank's pieces by saved name, tied name -> kept name, JSON files."""

    tensors: dict[str, Piece]
    tied: dict[str, str]
    documents: dict[str, Any]


class ModelHandler:
    """Default handler for ``torch.nn.Module``: a Hugging Face model folder.

    Args:
        max_shard_size: the most tensor bytes per safetensors file, as an int or a string like
            ``"2GB"`` (powers of 10) or ``"1GiB"`` (powers of 2); None writes one file.
        export_dtype: a floating dtype (e.g. ``torch.bfloat16``) that floating tensors are cast
            to when saved. On restore, floating tensors are cast back to the target's dtype
            (with a warning: a resume from a lower precision is not exact).
        config: a ``config.json`` document to write, overriding the module's own ``config``.
        extra_files: more files for the folder (tokenizer files, a README), as
            ``{file name: bytes or path to copy}``.
        strict: on restore, whether every key of the module must be in the checkpoint and
            every tensor of the checkpoint in the module. Shapes must match either way.

    With ``async_save``, :meth:`stage` copies the weights into host buffers that are reused from
    one save to the next, and :meth:`save` writes that copy on the background thread.
    """

    name = "model"

    def __init__(
        self,
        *,
        max_shard_size: int | str | None = "5GB",
        export_dtype: torch.dtype | None = None,
        config: Mapping[str, Any] | None = None,
        extra_files: Mapping[str, bytes | str | os.PathLike[str]] | None = None,
        strict: bool = True,
    ) -> None:
        self.max_shard_size = None if max_shard_size is None else parse_size(max_shard_size)
        if export_dtype is not None and (
            not isinstance(export_dtype, torch.dtype)
            or not export_dtype.is_floating_point
            or export_dtype not in DTYPE_TO_NAME
        ):
            raise CheckpointValueError(
                f"export_dtype must be a floating torch dtype such as torch.bfloat16, got "
                f"{export_dtype!r}"
            )
        self.export_dtype = export_dtype
        if config is not None and not isinstance(config, Mapping):
            raise CheckpointTypeError(
                f"config must be a mapping (the config.json document), got {type(config).__name__}"
            )
        self.config = dict(config) if config is not None else None
        self.extra_files = dict(extra_files or {})
        for filename in self.extra_files:
            _check_extra_name(filename)
        self.strict = strict
        self._pool = StagingPool()

    # ------------------------------------------------------------------------------------ save

    def stage(self, item: Any, context: HandlerContext) -> _StagedModel:
        """Copy the weights into reused host buffers, for a save on a background thread.

        Under FSDP2 only this rank's local shards are copied (and only the rows it writes).
        """
        staged = self._collect(_check_module(item, "save"), context)
        tensors = stage_pieces(self._pool, staged.tensors)
        return _StagedModel(tensors, staged.tied, staged.documents)

    def save(self, directory: Path, item: Any, context: HandlerContext) -> Mapping[str, Any]:
        staged = (
            item
            if isinstance(item, _StagedModel)
            else self._collect(_check_module(item, "save"), context)
        )
        tensors = staged.tensors
        plan = plan_files(
            [(n, self._file_dtype(p.dtype), p.shape) for n, p in tensors.items()],
            max_shard_size=self.max_shard_size,
        )
        write_files(
            directory,
            plan.files,
            tensors,
            rank=context.rank,
            world_size=context.world_size,
            collective=context.collective,
            what=f"the model in {directory}",
        )
        if context.rank == 0:  # the small files: once, from rank 0
            index = plan.index()
            if index is not None:
                (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
            for filename, document in staged.documents.items():
                _write_json(directory / filename, document, filename)
            for filename, content in self.extra_files.items():
                data = content if isinstance(content, bytes) else Path(content).read_bytes()
                (directory / filename).write_bytes(data)
        return {
            "format_version": 1,
            "tensors": len(tensors),
            "total_size": plan.total_size,
            "files": [f.filename for f in plan.files],
            "tied": staged.tied,
            "export_dtype": (
                None if self.export_dtype is None else torch_dtype_name(self.export_dtype)
            ),
        }

    def _collect(self, module: torch.nn.Module, context: HandlerContext) -> _StagedModel:
        """What this rank writes (one piece per tied group, still the module's own memory).

        Collective when a DTensor must be gathered (a layout that is not FSDP2's row blocks):
        every rank collects the same tensors in the same order.
        """
        state = canonical_state(module)
        tensors: dict[str, Piece] = {}
        tied: dict[str, str] = {}
        for group in tie_groups(state):
            keep = kept_name(group, module)
            _check_savable(keep, state[keep])
            tensors[keep] = piece_of(keep, state[keep], rank=context.rank)
            tied.update({name: keep for name in group if name != keep})
        return _StagedModel(tensors, tied, self._documents(module))

    def _file_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.export_dtype is not None and dtype.is_floating_point:
            return self.export_dtype
        return dtype

    def _documents(self, module: torch.nn.Module) -> dict[str, Any]:
        """``config.json`` and ``generation_config.json`` contents, by file name."""
        inner = unwrap(module)
        documents: dict[str, Any] = {}
        if self.config is not None:
            documents[CONFIG_FILE] = self.config
        else:
            config = getattr(inner, "config", None)
            if callable(getattr(config, "to_dict", None)):
                document = dict(config.to_dict())  # type: ignore[union-attr]
                # What save_pretrained records, so from_pretrained picks the class and dtype.
                if not document.get("architectures"):
                    document["architectures"] = [type(inner).__name__]
                dtype_key = "torch_dtype" if "torch_dtype" in document else "dtype"
                document[dtype_key] = torch_dtype_name(self.export_dtype or _float_dtype(inner))
                documents[CONFIG_FILE] = document
        generation = getattr(inner, "generation_config", None)
        if callable(getattr(generation, "to_dict", None)):
            documents[GENERATION_CONFIG_FILE] = generation.to_dict()  # type: ignore[union-attr]
        return documents

    # --------------------------------------------------------------------------------- restore

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        readers = open_model_folder(directory)
        if target is None:
            return {name: reader.read(name) for name, reader in readers.items()}
        module = _check_module(target, "restore")
        state = canonical_state(module)
        loads, casts = self._plan_restore(directory, state, readers)
        if casts:
            logger.warning(
                "restoring %d tensor(s) of %s with a cast between floating dtypes (e.g. %s); "
                "the checkpoint was saved with export_dtype or the model's dtype changed, so "
                "the restored values are rounded",
                len(casts),
                directory,
                casts[0],
            )
        with torch.no_grad():
            for name, tensor in loads:
                if is_dtensor(tensor):
                    # Only the rows this rank holds, straight into its local shard.
                    read_local(readers[name], name, tensor, out=tensor.to_local())  # type: ignore[attr-defined]
                else:
                    readers[name].read_into(name, tensor)
        return module

    def _plan_restore(
        self,
        directory: Path,
        state: Mapping[str, torch.Tensor],
        readers: Mapping[str, SafetensorsReader],
    ) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
        """What to read into which tensor; every problem is raised at once, before any read."""
        missing: list[str] = []
        mismatched: list[str] = []
        casts: list[str] = []
        loads: list[tuple[str, torch.Tensor]] = []
        covered: set[str] = set()
        for group in tie_groups(state):
            covered.update(group)
            # Any name of a tied group fills all of it: they are one tensor in memory.
            present = [name for name in group if name in readers]
            if not present:
                missing.extend(group)
                continue
            name = present[0]
            tensor = state[name]
            entry = readers[name].entries[name]
            same_kind = entry.dtype.is_floating_point and tensor.is_floating_point()
            if tuple(tensor.shape) != entry.shape or (
                entry.dtype != tensor.dtype and not same_kind
            ):
                mismatched.append(
                    f"{name}: checkpoint {torch_dtype_name(entry.dtype)} {list(entry.shape)}, "
                    f"model {torch_dtype_name(tensor.dtype)} {list(tensor.shape)}"
                )
                continue
            if entry.dtype != tensor.dtype:
                casts.append(
                    f"{name}: {torch_dtype_name(entry.dtype)} -> {torch_dtype_name(tensor.dtype)}"
                )
            loads.append((name, tensor))
        unexpected = [name for name in readers if name not in covered]
        problems = [f"mismatched {line}" for line in mismatched]
        if self.strict:
            problems += [f"missing from the checkpoint: {name}" for name in missing]
            problems += [f"unexpected (not in the model): {name}" for name in unexpected]
        raise_mismatches(
            problems,
            f"the model saved in {directory} does not fit the module being restored "
            f"({len(mismatched)} mismatched, {len(missing)} missing, {len(unexpected)} "
            "unexpected key(s)); nothing was loaded",
            fix="Build the module with the config it was saved with, or restore with "
            "ModelHandler(strict=False) to skip missing and unexpected keys.",
        )
        return loads, casts


# ----------------------------------------------------------------------------- reading a folder


def open_model_folder(directory: Path) -> dict[str, SafetensorsReader]:
    """Tensor name -> the validated reader of the file holding it.

    Reads ``model.safetensors.index.json`` when present, else ``model.safetensors``. The index
    and the shards must agree exactly: a tensor listed in the index but absent from its file, or
    present in a file but not listed, is a damaged folder rather than a partial load.
    """
    index_path = directory / INDEX_FILE
    single_path = directory / SINGLE_FILE
    if not index_path.exists():
        if not single_path.exists():
            raise CorruptCheckpointError(
                f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}; it is not a model "
                "folder, or the step is damaged -- restore another step"
            )
        reader = SafetensorsReader(single_path)
        return dict.fromkeys(reader.entries, reader)
    weight_map = _read_index(index_path)
    unreferenced = sorted(
        p.name
        for p in directory.iterdir()
        if _SHARD_NAME.fullmatch(p.name) and p.name not in weight_map.values()
    )
    if unreferenced:
        raise _bad_index(index_path, f"it places no tensor in {unreferenced}")
    readers: dict[str, SafetensorsReader] = {}
    for filename in sorted(set(weight_map.values())):
        if not (directory / filename).is_file():
            raise _bad_index(index_path, f"it lists {filename}, which is missing")
        readers[filename] = SafetensorsReader(directory / filename)
    out: dict[str, SafetensorsReader] = {}
    for name, filename in weight_map.items():
        if name not in readers[filename].entries:
            raise _bad_index(index_path, f"it places {name!r} in {filename}, which lacks it")
        out[name] = readers[filename]
    for filename, reader in readers.items():
        unlisted = [n for n in reader.entries if weight_map.get(n) != filename]
        if unlisted:
            raise _bad_index(
                index_path, f"{filename} holds {unlisted[:5]}, which the index does not place there"
            )
    return out


def _read_index(path: Path) -> dict[str, str]:
    try:
        document = json.loads(path.read_bytes())
        weight_map = document["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _bad_index(path, f"it is not a valid index: {exc}") from exc
    for name, filename in weight_map.items():
        if (
            not isinstance(filename, str)
            or Path(filename).name != filename
            or not filename.endswith(".safetensors")
        ):
            raise _bad_index(
                path, f"{name!r} maps to {filename!r}, not a safetensors file in the folder"
            )
    return weight_map


def _bad_index(path: Path, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is damaged ({reason}); nothing was loaded -- restore another step"
    )


# ------------------------------------------------------------------------------------- helpers


def _check_module(item: Any, action: str) -> torch.nn.Module:
    if not isinstance(item, torch.nn.Module):
        raise CheckpointTypeError(
            f"ModelHandler can only {action} a torch.nn.Module, got {type(item).__name__}; use "
            "the state handler for other objects"
        )
    return item


def _check_savable(name: str, tensor: torch.Tensor) -> None:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise CheckpointTypeError(
            f"model tensor {name!r} is not a dense tensor ({tensor.layout}); only dense tensors "
            "can be written to safetensors -- call .to_dense() or dequantize it first"
        )
    if tensor.device.type == "meta":
        raise CheckpointValueError(
            f"model tensor {name!r} is on the meta device and has no data; materialize the "
            "module (e.g. to_empty + init) before saving it"
        )


def _check_extra_name(filename: object) -> None:
    reserved = {SINGLE_FILE, INDEX_FILE}
    if (
        not isinstance(filename, str)
        or not filename
        or Path(filename).name != filename
        or filename.startswith(".")
        or filename in reserved
        or _SHARD_NAME.fullmatch(filename)
    ):
        raise CheckpointValueError(
            f"extra_files key {filename!r} must be a plain file name (no folders, no leading "
            "'.') that is not one of the model's own safetensors or index files"
        )


def _write_json(path: Path, document: Mapping[str, Any], what: str) -> None:
    try:
        text = json.dumps(document, indent=2, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointTypeError(f"{what} cannot be written as JSON to {path}: {exc}") from exc
    path.write_text(text + "\n")


def _float_dtype(module: torch.nn.Module) -> torch.dtype:
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32
