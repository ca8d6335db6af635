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

The concepts around the folder live in their own modules: names without wrapper parts
(:mod:`._wrappers`), tied weights (:mod:`._ties`), ``config.json`` only when the weights fit it
(:mod:`._hf_config`), the Hub layout of transformers models whose experts are fused in memory
(:mod:`._hub_layout`), restoring into a meta-device model (:mod:`._materialize`) and PEFT
adapters in PEFT's own format (:mod:`._peft`). See docs/models.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from orbit_pt._format import layouts as _layouts
from orbit_pt._format.remote_files import for_each, is_file, names_in
from orbit_pt._format.safe_open import read_json_object
from orbit_pt._format.safetensors import (
    DTYPE_TO_NAME,
    HEADER_METADATA,
    PlannedFile,
    SafetensorsReader,
    check_storable,
    dtype_name,
    plan_file,
    torch_dtype_name,
)
from orbit_pt._format.sharding import (
    Piece,
    is_dtensor,
    needs_exchange,
    piece_of,
    read_local,
    row_block,
    settle_union,
    stage_pieces,
    write_files,
)
from orbit_pt._format.staging import StagingPool
from orbit_pt._storage.layout import is_code_file
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError, CorruptCheckpointError
from orbit_pt.handlers import _peft
from orbit_pt.handlers._hf_config import CONFIG_FILE as CONFIG_FILE
from orbit_pt.handlers._hf_config import GENERATION_CONFIG_FILE, model_documents
from orbit_pt.handlers._hub_layout import HubLayout, hub_layout, hub_pieces
from orbit_pt.handlers._materialize import (
    check_materializable,
    is_meta,
    materialize,
    target_device,
)
from orbit_pt.handlers._mismatch import raise_mismatches
from orbit_pt.handlers._model_parts import as_module
from orbit_pt.handlers._ties import kept_name as kept_name
from orbit_pt.handlers._ties import parameter_names as parameter_names
from orbit_pt.handlers._ties import tie_groups
from orbit_pt.handlers._wrappers import canonical_name as canonical_name
from orbit_pt.handlers._wrappers import canonical_state as canonical_state
from orbit_pt.handlers._wrappers import unwrap as unwrap
from orbit_pt.handlers._wrappers import wrapper_hint
from orbit_pt.handlers.base import HandlerContext

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
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


# --------------------------------------------------------------------------------- the handler


@dataclass(frozen=True)
class _StagedModel:
    """What a save writes: this rank's pieces by saved name, tied name -> kept name, JSON files.

    For a PEFT model, ``adapters`` holds each adapter's config (its tensors are in ``tensors``,
    named ``[subfolder/]key``) and ``tied``/``documents`` are empty.
    """

    tensors: dict[str, Piece]
    tied: dict[str, str]
    documents: dict[str, Any]
    adapters: tuple[_peft.AdapterPart, ...] = ()


class ModelHandler:
    """Default handler for ``torch.nn.Module``: a Hugging Face model folder.

    Wrappers (DDP, DataParallel, ``torch.compile``, activation checkpointing, FSDP1) leave no
    trace in the names; a ``peft.PeftModel`` is saved as its adapters in PEFT's own format; a
    module on the meta device is materialised before a restore reads into it. See
    docs/models.md.

    Args:
        max_shard_size: the most tensor bytes per safetensors file, as an int or a string like
            ``"2GB"`` (powers of 10) or ``"1GiB"`` (powers of 2); None writes one file.
        export_dtype: a floating dtype (e.g. ``torch.bfloat16``) that floating tensors are cast
            to when saved. On restore, floating tensors are cast back to the target's dtype
            (logged: a widening cast is exact, a narrowing one rounds with a WARNING; either
            way a resume from a lower precision is not bitwise).
        config: a ``config.json`` document to write, overriding the module's own ``config``
            (written as given, without the check that the weights fit it).
        extra_files: more files for the folder (tokenizer files, a README), as
            ``{file name: bytes or path to copy}``.
        strict: on restore, whether every key of the module must be in the checkpoint and
            every tensor of the checkpoint in the module. Shapes must match either way.
        device: where a restore materialises a module built on the meta device. None: the
            device of the module's other tensors, else its FSDP2 mesh's device, else the CPU.

    With ``async_save``, :meth:`stage` copies the weights into host buffers that are reused from
    one save to the next, and :meth:`save` writes that copy on the background thread.
    """

    name = "model"
    # From an object-store root its .safetensors files are read by range (RangeReadingHandler).
    reads_by_range = True

    def __init__(
        self,
        *,
        max_shard_size: int | str | None = "5GB",
        export_dtype: torch.dtype | None = None,
        config: Mapping[str, Any] | None = None,
        extra_files: Mapping[str, bytes | str | os.PathLike[str]] | None = None,
        strict: bool = True,
        device: torch.device | str | None = None,
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
        try:
            self.device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise CheckpointValueError(
                f"device must be a torch.device or a string like 'cpu' or 'cuda:0', got {device!r}"
            ) from exc
        self._pool = StagingPool()
        self._announced_adapters = False

    # ------------------------------------------------------------------------------------ save

    def stage(self, item: Any, context: HandlerContext) -> _StagedModel:
        """Copy the weights into reused host buffers, for a save on a background thread.

        Under FSDP2 only this rank's local shards are copied (and only the rows it writes).
        """
        staged = self._collect(_check_module(item, "save"), context)
        return replace(staged, tensors=stage_pieces(self._pool, staged.tensors))

    def save(self, directory: Path, item: Any, context: HandlerContext) -> Mapping[str, Any]:
        staged = (
            item
            if isinstance(item, _StagedModel)
            else self._collect(_check_module(item, "save"), context)
        )
        if staged.adapters:
            return self._save_adapters(directory, staged, context)
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
            self._write_extra_files(directory)
        return {
            "format_version": 1,
            "tensors": len(tensors),
            "total_size": plan.total_size,
            "files": [f.filename for f in plan.files],
            "tied": staged.tied,
            "export_dtype": self._export_dtype_name(),
        }

    def _save_adapters(
        self, directory: Path, staged: _StagedModel, context: HandlerContext
    ) -> Mapping[str, Any]:
        """Each adapter as ``[subfolder/]adapter_model.safetensors`` + ``adapter_config.json``."""
        files: list[str] = []
        total = 0
        for part in staged.adapters:
            folder = directory / part.folder
            folder.mkdir(exist_ok=True)
            prefix = f"{part.folder}/" if part.folder else ""
            pieces = {
                name[len(prefix) :]: piece
                for name, piece in staged.tensors.items()
                if _peft.folder_of(name) == part.folder
            }
            planned = plan_file(
                _peft.ADAPTER_WEIGHTS,
                [(k, self._file_dtype(p.dtype), p.shape) for k, p in pieces.items()],
                HEADER_METADATA,
            )
            write_files(
                folder,
                [planned],
                pieces,
                rank=context.rank,
                world_size=context.world_size,
                collective=context.collective,
                what=f"the adapter in {folder}",
            )
            if context.rank == 0:
                _peft.write_config(folder, part)
            files.append(prefix + _peft.ADAPTER_WEIGHTS)
            total += planned.data_size
        if context.rank == 0:
            self._write_extra_files(directory)
        return {
            "format_version": 1,
            "format": "peft",
            "adapters": [part.folder for part in staged.adapters],
            "tensors": len(staged.tensors),
            "total_size": total,
            "files": files,
            "tied": {},
            "export_dtype": self._export_dtype_name(),
        }

    def _collect(self, module: torch.nn.Module, context: HandlerContext) -> _StagedModel:
        """What this rank writes (one piece per tied group, still the module's own memory).

        Collective (:func:`~orbit_pt._format.sharding.settle_union`): every rank calls it for the
        same item, at the same point.
        """
        peft_model = _peft.peft_model(module)
        if peft_model is not None:
            return self._collect_adapters(peft_model, context)
        state = canonical_state(module)
        kept: dict[str, torch.Tensor] = {}
        tied: dict[str, str] = {}
        for group in tie_groups(state):
            keep = kept_name(group, module)
            _check_savable(keep, state[keep])
            kept[keep] = state[keep]
            tied.update({name: keep for name in group if name != keep})
        layout = hub_layout(module, kept)
        if layout is None:
            tensors = {name: piece_of(name, t, rank=context.rank) for name, t in kept.items()}
        else:
            tensors = hub_pieces(layout, kept, rank=context.rank)
            tied = {name: layout.renamed.get(keep, keep) for name, keep in tied.items()}
        # The config check needs every stage's names and shapes under pipeline stages: they
        # ride on the tensors agreement (gathered only when the ranks hold different tensors).
        shapes = {name: list(tensor.shape) for name, tensor in state.items()}
        tensors, stages = self._settle(
            tensors, context, extra={"shapes": shapes, "saved": sorted(kept)}
        )
        saved = set(kept)
        for stage in stages or ():
            shapes.update(stage["shapes"])
            saved.update(stage["saved"])
        documents = (
            self._documents(module, shapes, frozenset(saved), context.step)
            if context.rank == 0  # the only rank that writes them
            else {}
        )
        return _StagedModel(tensors, tied, documents)

    def _settle(
        self, tensors: Mapping[str, Piece], context: HandlerContext, extra: Any = None
    ) -> tuple[dict[str, Piece], list[Any] | None]:
        """Every rank's tensors agreed (their union under pipeline stages), each with one
        writer; and every rank's ``extra`` on rank 0 when the ranks differ."""
        return settle_union(
            tensors,
            rank=context.rank,
            world_size=context.world_size,
            collective=context.collective,
            what=f"the model of step {context.step}",
            extra=extra,
            in_place=context.shared_files,
        )

    def _collect_adapters(self, model: Any, context: HandlerContext) -> _StagedModel:
        parts = _peft.adapter_parts(model)
        tensors: dict[str, Piece] = {}
        for part in parts:
            for key, tensor in part.tensors.items():
                name = _peft.saved_name(part.folder, key)
                _check_savable(name, tensor)
                tensors[name] = piece_of(name, tensor, rank=context.rank)
        if context.rank == 0 and not self._announced_adapters:
            self._announced_adapters = True
            bases = sorted({str(part.config.base_model_name_or_path) for part in parts})
            logger.info(
                "step %d: saving the PEFT model as its adapter(s) %s only, in PEFT's format; "
                "the frozen base is not in the checkpoint (adapter_config.json names it: "
                "base_model_name_or_path=%s): keep it where it is",
                context.step,
                [part.folder or _peft.DEFAULT_ADAPTER for part in parts],
                bases,
            )
        adapters = tuple(replace(part, tensors={}) for part in parts)  # drop the live tensors
        return _StagedModel(self._settle(tensors, context)[0], {}, {}, adapters)

    def _file_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.export_dtype is not None and dtype.is_floating_point:
            return self.export_dtype
        return dtype

    def _export_dtype_name(self) -> str | None:
        return None if self.export_dtype is None else torch_dtype_name(self.export_dtype)

    def _write_extra_files(self, directory: Path) -> None:
        for filename, content in self.extra_files.items():
            data = content if isinstance(content, bytes) else Path(content).read_bytes()
            (directory / filename).write_bytes(data)

    def _documents(
        self,
        module: torch.nn.Module,
        shapes: Mapping[str, Sequence[int]],
        saved: frozenset[str],
        step: int,
    ) -> dict[str, Any]:
        """``config.json`` and ``generation_config.json`` contents, by file name."""
        dtype = self.export_dtype or _float_dtype(module)
        if self.config is None:
            return model_documents(module, shapes=shapes, saved=saved, dtype=dtype, step=step)
        documents: dict[str, Any] = {CONFIG_FILE: self.config}
        generation = getattr(unwrap(module), "generation_config", None)
        if callable(getattr(generation, "to_dict", None)):
            documents[GENERATION_CONFIG_FILE] = generation.to_dict()  # type: ignore[union-attr]
        return documents

    # --------------------------------------------------------------------------------- restore

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        if _peft.adapter_folders(directory) and not _has_model_files(directory):
            return self._restore_adapters(directory, target, context)
        readers = open_model_folder(directory)
        if target is None:
            return {name: reader.read(name) for name, reader in readers.items()}
        module = _check_module(target, "restore")
        meta = any(is_meta(t) for t in (*module.parameters(), *module.buffers()))
        state = canonical_state(module, keep_vars=meta)
        layout = _layout_of(module, state)
        plan = self._plan_restore(directory, state, readers, layout, context)  # refuse first
        if meta:
            self._materialize(module, directory, state, plan.filled)
            state = canonical_state(module)
            plan = self._plan_restore(directory, state, readers, layout, context)
        self._read(directory, plan, readers, layout)
        return target  # the module, or the list of model parts

    def _restore_adapters(
        self, directory: Path, target: Any | None, context: HandlerContext
    ) -> Any:
        """PEFT adapters: only their weights, in place, into the live PeftModel's adapters."""
        saved = _peft.open_adapter_folders(directory)
        if target is None:
            return {
                _peft.saved_name(folder, key): reader.read(key)
                for folder, readers in saved.items()
                for key, reader in readers.items()
            }
        module = _check_module(target, "restore")
        peft_model = _peft.peft_model(module)
        if peft_model is None:
            raise CheckpointTypeError(
                f"{directory} holds PEFT adapter(s) (adapter-only: the frozen base is not in "
                f"it), and the target is a plain {type(unwrap(module)).__name__}; build the base "
                "model, wrap it with peft.get_peft_model(base, config) and restore into that "
                f"PeftModel, or load it with peft.PeftModel.from_pretrained(base, "
                f"{str(directory)!r})"
            )
        targets = _peft.restore_targets(peft_model, {f: list(r) for f, r in saved.items()})
        extra = sorted(set(saved) - set(targets))
        if extra and self.strict:
            raise_mismatches(
                [f"unexpected adapter (not in the model): {folder}" for folder in extra],
                f"the adapters saved in {directory} do not fit the PeftModel being restored; "
                "nothing was loaded",
                fix="Add those adapters to the model (model.add_adapter(name, config)) first, "
                "or restore with ModelHandler(strict=False) to skip them.",
            )
        plans = [  # every adapter planned before any is read: all or nothing
            (
                folder,
                self._plan_restore(directory / folder, state, saved.get(folder, {}), None, context),
            )
            for folder, state in targets.items()
        ]
        for folder, plan in plans:
            self._read(directory / folder, plan, saved.get(folder, {}), None)
        return module

    def _read(
        self,
        directory: Path,
        plan: _RestorePlan,
        readers: Mapping[str, SafetensorsReader],
        layout: HubLayout | None,
    ) -> None:
        """Read each planned tensor into the live one (a DTensor: only this rank's rows)."""
        if plan.casts:
            logger.warning(
                "restoring %d tensor(s) of %s with a cast between floating dtypes (e.g. %s); "
                "the checkpoint was saved with export_dtype or the model's dtype changed, so "
                "the restored values are rounded",
                len(plan.casts),
                directory,
                plan.casts[0],
            )
        if plan.widened:
            logger.info(
                "restoring %d tensor(s) of %s into a wider floating dtype (e.g. %s): exact, but "
                "the values are those of the lower precision saved (export_dtype, or a bf16 "
                "pretrained folder), so a resume from them is not bitwise",
                len(plan.widened),
                directory,
                plan.widened[0],
            )

        def load(planned: tuple[str, torch.Tensor]) -> None:
            name, tensor = planned
            if is_dtensor(tensor):
                # Only the rows this rank holds, straight into its local shard.
                read_local(readers[name], name, tensor, out=tensor.to_local())  # type: ignore[attr-defined]
            else:
                readers[name].read_into(name, tensor)

        remote = any(reader.is_remote for reader in readers.values())
        # Layouts that move rows between ranks: in plan order, on this thread, never in the
        # pool (the same order on every rank of the replica group).
        moved = [p for p in plan.loads if needs_exchange(p[1], remote=remote)]
        loads = [p for p in plan.loads if not needs_exchange(p[1], remote=remote)]
        if remote:  # in file order: each run of small tensors is then fetched once
            loads = sorted(
                loads, key=lambda planned: _file_position(readers[planned[0]], planned[0])
            )
        with torch.no_grad():
            for_each(loads, load, remote=remote)
            for planned in moved:
                load(planned)
            if plan.converted:
                assert layout is not None
                _read_converted(layout, plan.converted, readers)

    def _materialize(
        self,
        module: torch.nn.Module,
        directory: Path,
        state: Mapping[str, torch.Tensor],
        loaded: Iterable[str],
    ) -> None:
        """Give a meta-device module memory, once sure the checkpoint fills all of it."""
        loaded = set(loaded)
        unfilled = [
            name
            for group in tie_groups(state)
            if not loaded.intersection(group)
            for name in group
            if is_meta(state[name])
        ]
        what = f"restoring {directory}"
        if unfilled:
            raise CheckpointValueError(
                f"{what}: the module is on the meta device and the checkpoint has no values for "
                f"{len(unfilled)} of its tensors (e.g. {unfilled[:5]}), which would be left "
                "with no data; nothing was loaded. Restore with strict=True into the module the "
                "step was saved from, or materialise and initialise the module yourself first"
            )
        transient = check_materializable(module, what)
        device = target_device(module, self.device)
        logger.info(
            "%s: the module is on the meta device; materialising it on %s, then reading the "
            "checkpoint into it (%d non-persistent buffer(s) recomputed)",
            what,
            device,
            len(transient),
        )
        materialize(module, device, transient, what)

    def _plan_restore(
        self,
        directory: Path,
        state: Mapping[str, torch.Tensor],
        readers: Mapping[str, SafetensorsReader],
        layout: HubLayout | None,
        context: HandlerContext,
    ) -> _RestorePlan:
        """What to read into which tensor; every problem is raised at once, before any read.

        Under torch.distributed (with the context's collective) the ranks agree here: a rank
        whose model does not fit fails every rank before any rank reads, and a tensor of the
        folder is unexpected only when *no* rank's model has it (pipeline stages each hold
        some of the tensors).

        A tensor is read under its own name when the folder has it (orbit_pt's folders before
        the Hub layout, and every model whose layout is its state dict); otherwise, for a
        transformers model, from the Hub tensors its layout says it converts to.
        """
        missing: list[str] = []
        mismatched: list[str] = []
        plan = _RestorePlan()
        consumed: set[str] = set()

        def check(
            file_name: str,
            entry_shape: tuple[int, ...],
            entry_dtype: torch.dtype,
            shape: tuple[int, ...],
            dtype: torch.dtype,
        ) -> bool:
            same_kind = entry_dtype.is_floating_point and dtype.is_floating_point
            if entry_shape != shape or (entry_dtype != dtype and not same_kind):
                mismatched.append(
                    f"{file_name}: checkpoint {torch_dtype_name(entry_dtype)} "
                    f"{list(entry_shape)}, model {torch_dtype_name(dtype)} {list(shape)}"
                )
                return False
            if entry_dtype != dtype:
                line = f"{file_name}: {torch_dtype_name(entry_dtype)} -> {torch_dtype_name(dtype)}"
                (plan.widened if _widens(entry_dtype, dtype) else plan.casts).append(line)
            return True

        for group in tie_groups(state):
            # Any name of a tied group fills all of it: they are one tensor in memory.
            present = [name for name in group if name in readers]
            if present:
                name = present[0]
                tensor = state[name]
                entry = readers[name].entries[name]
                consumed.add(name)
                if check(name, entry.shape, entry.dtype, tuple(tensor.shape), tensor.dtype):
                    plan.loads.append((name, tensor))
                    plan.filled.update(group)
                continue
            hub = _hub_source(layout, group, readers)
            if hub is None:
                missing.extend(group)
                continue
            key, names = hub
            tensor = state[key]
            consumed.update(names)
            assert layout is not None
            fits = [
                check(
                    n,
                    readers[n].entries[n].shape,
                    readers[n].entries[n].dtype,
                    layout.shapes[n],
                    tensor.dtype,
                )
                for n in names
            ]
            if all(fits):
                if key in layout.renamed:
                    plan.loads.append((names[0], tensor))
                else:
                    plan.converted.append((key, tensor))
                plan.filled.update(group)
        unexpected = [name for name in readers if name not in consumed]
        summary = (
            f"the model saved in {directory} does not fit the module being restored "
            f"({len(mismatched)} mismatched, {len(missing)} missing, %d unexpected key(s)); "
            "nothing was loaded"
        )
        fix = wrapper_hint(missing, unexpected) or (
            "Build the module with the config it was saved with, or restore with "
            "ModelHandler(strict=False) to skip missing and unexpected keys."
        )

        def problems(unexpected: Sequence[str]) -> list[str]:
            lines = [f"mismatched {line}" for line in mismatched]
            if self.strict:
                lines += [f"missing from the checkpoint: {name}" for name in missing]
                lines += [f"unexpected (not in the model): {name}" for name in unexpected]
            return lines

        collective = context.collective
        if context.world_size > 1 and collective is not None and collective.enabled:
            _, theirs = collective.agree(
                "orbit_pt.handler.restore_plan",
                lambda: raise_mismatches(problems(()), summary % 0, fix=fix),
                label=f"planning the restore of {directory.name}",
                share=lambda _: unexpected,
            )
            nowhere = set.intersection(*(set(names) for names in theirs))
            unexpected = [name for name in unexpected if name in nowhere]
        raise_mismatches(problems(unexpected), summary % len(unexpected), fix=fix)
        return plan


@dataclass
class _RestorePlan:
    """What a restore reads: by name into a tensor, or converted from the Hub layout.

    Attributes:
        loads: (name in the folder, live tensor) read as they are.
        converted: (in-memory name, live tensor) made from Hub tensors (MoE experts).
        casts: one line per tensor read with a rounding cast between floating dtypes.
        widened: one line per tensor read into a wider floating dtype (exact).
        filled: the in-memory names that get values (for a meta-device module).
    """

    loads: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    converted: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    casts: list[str] = field(default_factory=list)
    widened: list[str] = field(default_factory=list)
    filled: set[str] = field(default_factory=set)


def _widens(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of floating ``source`` is exactly a value of ``target`` (no rounding).

    bf16 and fp16 each fit fp32 and fp64, and fp32 fits fp64; bf16 and fp16 do not fit each
    other (range against precision).
    """
    exact = {
        torch.bfloat16: {torch.float32, torch.float64},
        torch.float16: {torch.float32, torch.float64},
        torch.float32: {torch.float64},
    }
    return target in exact.get(source, set())


def _layout_of(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> HubLayout | None:
    """The Hub layout of ``module`` for its saved names (one per tied group), or None."""
    kept = {
        kept_name(group, module): state[kept_name(group, module)] for group in tie_groups(state)
    }
    return hub_layout(module, kept)


def _hub_source(
    layout: HubLayout | None, group: Sequence[str], readers: Mapping[str, SafetensorsReader]
) -> tuple[str, list[str]] | None:
    """(in-memory name, Hub names in the folder) that fill tied ``group``; None if absent."""
    if layout is None:
        return None
    for key in group:
        if key in layout.renamed or key in layout.rows or key in layout.joint:
            names = layout.hub_names(key)
            if names and all(name in readers for name in names):
                return key, names
    return None


def _read_converted(
    layout: HubLayout,
    converted: Sequence[tuple[str, torch.Tensor]],
    readers: Mapping[str, SafetensorsReader],
) -> None:
    """Fill tensors whose Hub tensors convert to them (experts by rows; joint ones whole)."""

    def read(name: str) -> torch.Tensor:
        return readers[name].read(name)

    joint: dict[str, torch.Tensor] | None = None
    for key, tensor in converted:
        block = row_block(tensor) if is_dtensor(tensor) else None
        if key in layout.rows and (block is not None or not is_dtensor(tensor)):
            first, count = (block[0], block[1]) if block is not None else (0, tensor.shape[0])
            if count:
                out = tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
                out.copy_(layout.rows_from_hub(key, read, first, count))
            continue
        if key in layout.rows:  # a DTensor (the plain case is whole rows above)
            shard = _layouts.layout_of(tensor)
            if shard is not None:
                # Experts sharded on another dimension too (EP x TP): this rank reads its even
                # share of whole experts, a slab at a time, and moves them into the boxes.
                def experts(rows: _layouts.Box, key: str = key) -> torch.Tensor:
                    if not rows.shape[0]:
                        return torch.empty(rows.shape)
                    return layout.rows_from_hub(key, read, rows.offset[0], rows.shape[0])

                _layouts.from_rows(shard, experts, tensor.to_local())  # type: ignore[attr-defined]
            continue
        if joint is None:
            joint = layout.joint_from_hub(read)
        full = joint[key]
        if is_dtensor(tensor):
            from torch.distributed.tensor import distribute_tensor

            dtensor: Any = tensor
            local = distribute_tensor(
                full.to(tensor.dtype), dtensor.device_mesh, dtensor.placements, src_data_rank=None
            ).to_local()
            dtensor.to_local().copy_(local)
        else:
            tensor.copy_(full)


# ----------------------------------------------------------------------------- reading a folder


def open_model_folder(directory: Path) -> dict[str, SafetensorsReader]:
    """Tensor name -> the validated reader of the file holding it.

    Reads ``model.safetensors.index.json`` when present, else ``model.safetensors``. The index
    and the shards must agree exactly: a tensor listed in the index but absent from its file, or
    present in a file but not listed, is a damaged folder rather than a partial load.

    A folder of PEFT adapters gives the default adapter's tensors under PEFT's keys (empty if
    there is none); every adapter's file is checked (see :func:`._peft.open_adapter_folders`).
    """
    index_path = directory / INDEX_FILE
    single_path = directory / SINGLE_FILE
    if not index_path.exists():
        # A step restored from object storage reads its weights by range: they are not on disk.
        if not is_file(single_path) and _peft.adapter_folders(directory):
            return _peft.open_adapter_folders(directory).get("", {})
        if not is_file(single_path):
            raise CorruptCheckpointError(
                f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}; it is not a model "
                "folder, or the step is damaged -- restore another step"
            )
        reader = SafetensorsReader(single_path)
        return dict.fromkeys(reader.entries, reader)
    weight_map = _read_index(index_path)
    unreferenced = sorted(
        name
        for name in names_in(directory)
        if _SHARD_NAME.fullmatch(name) and name not in weight_map.values()
    )
    if unreferenced:
        raise _bad_index(index_path, f"it places no tensor in {unreferenced}")
    readers: dict[str, SafetensorsReader] = {}
    for filename in sorted(set(weight_map.values())):
        if not is_file(directory / filename):
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
        document = read_json_object(path)  # a regular file; bounded size and nesting
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


def _has_model_files(directory: Path) -> bool:
    return is_file(directory / SINGLE_FILE) or (directory / INDEX_FILE).exists()


def _check_module(item: Any, action: str) -> torch.nn.Module:
    """``item`` as one module: itself, or the merged view of a list of model parts."""
    module = as_module(item)
    if module is None:
        raise CheckpointTypeError(
            f"ModelHandler can only {action} a torch.nn.Module or a list of modules that are "
            f"parts of one model (torchtitan's model_parts), got {type(item).__name__}; use "
            "the state handler for other objects"
        )
    return module


def _check_savable(name: str, tensor: torch.Tensor) -> None:
    """Here, before any agreement, so that only this rank fails: a tensor without dense
    bytes, or of a dtype safetensors cannot store."""
    check_storable(name, tensor)
    try:
        dtype_name(tensor.dtype)
    except CheckpointTypeError as exc:
        raise CheckpointTypeError(f"model tensor {name!r}: {exc}") from None


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
    if is_code_file(filename):
        raise CheckpointValueError(
            f"extra_files key {filename!r} is code: steps hold no code, since "
            "from_pretrained(trust_remote_code=True) runs the modeling files a folder carries "
            "and anyone who can write the root could swap them; ship the model's code as a "
            "package (or copy it next to an exported folder yourself)"
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


def _file_position(reader: SafetensorsReader, name: str) -> tuple[str, int]:
    """Where tensor ``name`` lies: its file, and its offset in it."""
    return reader.where, reader.entries[name].start
