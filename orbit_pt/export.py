"""Export the model of a step as a standalone Hugging Face model folder.

    from orbit_pt.export import export_model

    export_model("runs/exp1/checkpoints", 1000, "exports/exp1-1000", dtype=torch.bfloat16)
    transformers.AutoModelForCausalLM.from_pretrained("exports/exp1-1000")

The model item of a step already is a Hugging Face folder; exporting copies it out of the
checkpoint root -- weights, index, ``config.json`` and every other non-tensor file of the item
(generation config, tokenizer files) -- optionally casting floating tensors to another dtype, so
that it can be shipped, or the checkpoint pruned, independently. The folder is written under a
temporary name beside ``out``, fsynced, and renamed into place: it appears whole or not at all.

A PEFT item holds only an adapter, not a model. With ``merge_adapter=True`` the adapter is merged
into its base model (the local folder ``adapter_config.json`` names, or ``base``) with PEFT's
``merge_and_unload``, and the merged model is written as the model handler writes any model:

    export_model("runs/lora/checkpoints", 1000, "exports/lora-1000", merge_adapter=True)
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from orbit_pt._format import safe_open
from orbit_pt._format.safe_open import read_json_object
from orbit_pt._format.safetensors import (
    HEADER_METADATA,
    SafetensorsReader,
    torch_dtype_name,
    write_safetensors,
)
from orbit_pt._storage import fs as _fs
from orbit_pt._storage import layout as _layout
from orbit_pt._storage import root as _root
from orbit_pt.errors import (
    CheckpointError,
    CheckpointValueError,
    CorruptCheckpointError,
    ItemNotFoundError,
    StepAlreadyExistsError,
)
from orbit_pt.handlers import _peft
from orbit_pt.handlers._hf_config import GENERATION_CONFIG_FILE
from orbit_pt.handlers.base import HandlerContext
from orbit_pt.handlers.model import CONFIG_FILE, INDEX_FILE, ModelHandler, open_model_folder
from orbit_pt.metadata import StepMetadata
from orbit_pt.verify import verify_step

logger = logging.getLogger(__name__)

__all__ = ["EXPORT_DTYPES", "ExportResult", "export_model"]

EXPORT_DTYPES: Mapping[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
"""The ``dtype`` names ``orbit-pt export --dtype`` accepts."""


_T = TypeVar("_T")


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_model` wrote.

    Attributes:
        step: the exported step.
        item: the model item exported.
        out: the folder written.
        files: the files written, relative to ``out``.
        tensors: the number of tensors.
        tensor_bytes: the bytes of tensor data written.
        dtype: the dtype floating tensors were cast to, or None when they were copied as saved
            (for a merged adapter: kept in the dtype the base model loads in).
        adapter: the PEFT adapter merged into its base, or None when none was.
        base: the base model folder the adapter was merged into, or None.
        left_out: what the step held that the export did not carry, each with why: code
            files and ``config.json``'s ``auto_map`` (an export never carries code).
    """

    step: int
    item: str
    out: Path
    files: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    dtype: str | None
    adapter: str | None = None
    base: Path | None = None
    left_out: tuple[str, ...] = ()


def _confined_to_root(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``fn(root, ...)`` reading nothing through links below ``root`` (also unverified)."""

    @functools.wraps(fn)
    def run(root: str | os.PathLike[str], *args: Any, **kwargs: Any) -> _T:
        with safe_open.confined(Path(root)):
            return fn(root, *args, **kwargs)

    return run


@_confined_to_root
def export_model(
    root: str | os.PathLike[str],
    step: int,
    out: str | os.PathLike[str],
    *,
    item: str | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = True,
    merge_adapter: bool = False,
    base: str | os.PathLike[str] | None = None,
    adapter_name: str | None = None,
) -> ExportResult:
    """Write the model item of ``step`` as a standalone Hugging Face model folder at ``out``.

    Args:
        root: the checkpoint root.
        step: a committed step.
        out: the folder to create; it must not exist, or be an empty folder.
        item: the item to export; by default the one item saved by the model handler (or the
            one named ``model`` when there are several).
        dtype: cast floating tensors to this dtype (e.g. ``torch.bfloat16``); ``config.json``
            records it. None copies the weights byte for byte.
        verify: check the item's files (sizes, checksums, headers) before exporting.
        merge_adapter: the item is a PEFT adapter: load its base model, merge the adapter into
            it (``merge_and_unload``) and write the merged model. Needs peft and transformers.
        base: the base model's local folder; by default the ``base_model_name_or_path`` that
            ``adapter_config.json`` records (never downloaded). Only with ``merge_adapter``.
        adapter_name: the adapter to merge when the item holds several; by default
            ``"default"``, or the only one. Only with ``merge_adapter``.

    Returns:
        What was written.

    Raises:
        StepNotFoundError: nothing under ``root`` has the name of ``step``.
        CorruptCheckpointError: ``step`` is not a committed step (a folder without valid
            metadata, a link, ...), or ``verify`` found the item damaged; nothing was written.
        ItemNotFoundError: the step has no model item (or not ``item``).
        StepAlreadyExistsError: ``out`` exists and is not an empty folder.
        CheckpointValueError: ``dtype`` is not a floating dtype; the item is a PEFT adapter and
            ``merge_adapter`` is False, or it is a whole model and ``merge_adapter`` is True;
            ``base``/``adapter_name`` without ``merge_adapter``; the base model is not a local
            folder (pass ``base``).
        ItemNotFoundError: no adapter is named ``adapter_name`` (the message lists them).
        CheckpointError: merging needs peft or transformers, and it is not installed; or
            loading the base or merging failed (a base that does not fit the adapter); the
            cause is chained.
    """
    root, out = Path(root), Path(out)
    if not merge_adapter and (base is not None or adapter_name is not None):
        given = "base" if base is not None else "adapter_name"
        raise CheckpointValueError(
            f"{given} is used only to merge a PEFT adapter; pass merge_adapter=True "
            "(orbit-pt export --merge-adapter) with it, or leave it out"
        )
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise CheckpointValueError(
            f"dtype must be a floating torch dtype such as torch.bfloat16, got {dtype!r}"
        )
    entry = _root.committed_entry(root, step)
    assert entry.meta is not None
    name = _model_item(entry.meta, step, item)
    if verify:
        report = verify_step(root, step)
        relevant = [
            p
            for p in report.problems
            if p.path == name or p.path.startswith(f"{name}/") or p.path == _layout.METADATA_FILE
        ]
        if relevant:
            listed = "; ".join(str(p) for p in relevant[:10])
            raise CorruptCheckpointError(
                f"item {name!r} of step {step} in {root} is damaged ({listed}); nothing was "
                "exported -- export another step"
            )
    _check_out(out)
    source = entry.path / name
    is_adapter = bool(_peft.adapter_folders(source))
    if is_adapter and not merge_adapter:
        # Its tensors are a LoRA adapter's, not a model's: copied as a model folder they would
        # load as a model with random weights.
        raise CheckpointValueError(
            f"item {name!r} of step {step} in {root} is a PEFT adapter, not a whole model; "
            "export it merged into its base model with merge_adapter=True (orbit-pt export "
            "--merge-adapter), or load it with peft.PeftModel.from_pretrained(base_model, "
            f"step_dir / {name!r})"
        )
    if merge_adapter and not is_adapter:
        raise CheckpointValueError(
            f"item {name!r} of step {step} in {root} is a whole model, not a PEFT adapter: "
            "there is nothing to merge; export it without merge_adapter (--merge-adapter)"
        )
    if merge_adapter:
        return _export_merged(source, step, name, out, dtype, base, adapter_name)
    readers = open_model_folder(source)
    tmp = _tmp_beside(out)
    left_out: list[str] = []
    with _fs.staged_folder(tmp, out):
        written, tensor_bytes = _write(source, tmp, readers, dtype, left_out)
    for line in left_out:
        logger.warning("export of step %d: %s", step, line)
    return ExportResult(
        step=step,
        item=name,
        out=out,
        files=tuple(written),
        tensors=len(readers),
        tensor_bytes=tensor_bytes,
        dtype=None if dtype is None else torch_dtype_name(dtype),
        left_out=tuple(left_out),
    )


def _export_merged(
    source: Path,
    step: int,
    item: str,
    out: Path,
    dtype: torch.dtype | None,
    base: str | os.PathLike[str] | None,
    adapter_name: str | None,
) -> ExportResult:
    """Merge one adapter of ``source`` into its base and write the merged model at ``out``."""
    adapter, adapter_dir = _peft.select_adapter(source, adapter_name)
    base_dir = _peft.base_folder(adapter_dir, base)
    # All in memory before anything is written: a failure to load or merge leaves no folder.
    try:
        merged = _peft.merged_model(adapter_dir, _peft.load_base(base_dir, adapter_dir))
    except CheckpointError:
        raise
    except Exception as exc:  # transformers' or PEFT's own error, e.g. a base of another shape
        raise CheckpointError(
            f"merging adapter {adapter!r} of item {item!r} of step {step} into the base model "
            f"in {base_dir} failed ({type(exc).__name__}: {exc}); check that the base is the "
            "model the adapter was trained on (pass it as base=PATH, --base PATH)"
        ) from exc
    handler = ModelHandler(export_dtype=dtype, extra_files=_companion_files(source, base_dir))
    tmp = _tmp_beside(out)
    with _fs.staged_folder(tmp, out):
        # The folder a training step writes for a plain model: from_pretrained loads it.
        info = handler.save(tmp, merged, HandlerContext(step=step))
        written = sorted(rel.as_posix() for rel in _fs.iter_files(tmp))
    return ExportResult(
        step=step,
        item=item,
        out=out,
        files=tuple(written),
        tensors=int(info["tensors"]),
        tensor_bytes=int(info["total_size"]),
        dtype=None if dtype is None else torch_dtype_name(dtype),
        adapter=adapter,
        base=base_dir,
    )


def _companion_files(source: Path, base: Path) -> dict[str, Path]:
    """The files besides weights and configs a merged export carries, by name.

    The base folder's tokenizer files, then the item's own plain files (a tokenizer saved with
    the adapter through ``ModelHandler(extra_files=...)``), which win: fine-tuning may add tokens.
    """
    files = {name: base / name for name in _peft.TOKENIZER_FILES if (base / name).is_file()}
    written = {_peft.ADAPTER_CONFIG, CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE}
    for path in sorted(source.iterdir()):
        skip = (
            path.name in written
            or path.suffix == ".safetensors"
            or path.name[0] == "."
            or _layout.is_code_file(path.name)
        )
        if path.is_file() and not skip:
            files[path.name] = path
    return files


def _tmp_beside(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.orbit-export-tmp"


def _model_item(meta: StepMetadata, step: int, item: str | None) -> str:
    models = sorted(name for name, info in meta.items.items() if info.handler == "model")
    if item is not None:
        if item not in meta.items:
            raise ItemNotFoundError(
                f"step {step} has no item {item!r}; it holds {sorted(meta.items)}"
            )
        if meta.items[item].handler != "model":
            raise ItemNotFoundError(
                f"item {item!r} of step {step} was saved by handler "
                f"{meta.items[item].handler!r}, not as a model; model items: {models or 'none'}"
            )
        return item
    if len(models) == 1:
        return models[0]
    if "model" in models:
        return "model"
    if not models:
        raise ItemNotFoundError(
            f"step {step} holds no item saved by the model handler (items: "
            f"{sorted(meta.items)}); only nn.Module items can be exported"
        )
    raise ItemNotFoundError(
        f"step {step} holds several model items {models}; choose one (--item NAME)"
    )


def _check_out(out: Path) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise StepAlreadyExistsError(f"{out} exists and is not a folder; choose another OUT")
    if out.is_dir() and any(out.iterdir()):
        raise StepAlreadyExistsError(
            f"{out} is not empty; export writes a new folder -- choose another OUT or empty it"
        )


def _write(
    source: Path,
    tmp: Path,
    readers: Mapping[str, SafetensorsReader],
    dtype: torch.dtype | None,
    left_out: list[str],
) -> tuple[list[str], int]:
    """Copy (or cast) ``source``'s files into ``tmp``; what is not carried goes in ``left_out``.

    Never code: a ``modeling_*.py`` with an ``auto_map`` naming it is what
    ``from_pretrained(trust_remote_code=True)`` imports, and a step in a shared root may hold
    one that nobody trained with. The folder then loads through its ``model_type`` or the
    caller's own model class.
    """
    by_file: dict[Path, SafetensorsReader] = {r.path: r for r in readers.values()}
    weights = {path.name for path in by_file} | {INDEX_FILE}
    written: list[str] = []
    tensor_bytes = 0
    sizes: dict[str, int] = {}
    for path, reader in sorted(by_file.items()):
        if dtype is None:
            shutil.copyfile(path, tmp / path.name)
            sizes[path.name] = sum(e.nbytes for e in reader.entries.values())
        else:
            # One source file at a time: memory holds one shard, never the whole model.
            tensors = {
                name: t.to(dtype) if t.is_floating_point() else t
                for name, t in reader.read_all().items()
            }
            write_safetensors(tmp / path.name, tensors, {**reader.metadata, **HEADER_METADATA})
            sizes[path.name] = sum(t.numel() * t.element_size() for t in tensors.values())
        tensor_bytes += sizes[path.name]
        written.append(path.name)
    if (source / INDEX_FILE).is_file():
        index = read_json_object(source / INDEX_FILE)  # bounded size and nesting
        index.setdefault("metadata", {})["total_size"] = tensor_bytes
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(INDEX_FILE)
    for rel in _fs.iter_files(source):
        if rel.as_posix() in weights:
            continue
        if _layout.is_code_file(rel.as_posix()):
            left_out.append(f"{rel.as_posix()} left out: an export carries no code")
            continue
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        config = read_json_object(source / rel) if rel.as_posix() == CONFIG_FILE else None
        if config is not None and ("auto_map" in config or dtype is not None):
            if config.pop("auto_map", None) is not None:
                left_out.append(
                    f"auto_map left out of {CONFIG_FILE}: it names code for "
                    "trust_remote_code, which an export does not carry"
                )
            if dtype is not None:
                key = "torch_dtype" if "torch_dtype" in config else "dtype"
                config[key] = torch_dtype_name(dtype)
            (tmp / rel).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(source / rel, tmp / rel)
        written.append(rel.as_posix())
    return sorted(written), tensor_bytes
