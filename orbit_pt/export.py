"""Export the model of a step as a standalone Hugging Face model folder.

    from orbit_pt.export import export_model

    export_model("runs/exp1/checkpoints", 1000, "exports/exp1-1000", dtype=torch.bfloat16)
    transformers.AutoModelForCausalLM.from_pretrained("exports/exp1-1000")

The model item of a step already is a Hugging Face folder; exporting copies it out of the
checkpoint root -- weights, index, ``config.json`` and every other non-tensor file of the item
(generation config, tokenizer files) -- optionally casting floating tensors to another dtype, so
that it can be shipped, or the checkpoint pruned, independently. The folder is written under a
temporary name beside ``out``, fsynced, and renamed into place: it appears whole or not at all.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

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
    CheckpointValueError,
    CorruptCheckpointError,
    ItemNotFoundError,
    StepAlreadyExistsError,
)
from orbit_pt.handlers._peft import ADAPTER_CONFIG
from orbit_pt.handlers.model import CONFIG_FILE, INDEX_FILE, open_model_folder
from orbit_pt.metadata import StepMetadata
from orbit_pt.verify import verify_step

__all__ = ["EXPORT_DTYPES", "ExportResult", "export_model"]

EXPORT_DTYPES: Mapping[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
"""The ``dtype`` names ``orbit-pt export --dtype`` accepts."""


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
        dtype: the dtype floating tensors were cast to, or None when they were copied as saved.
    """

    step: int
    item: str
    out: Path
    files: tuple[str, ...]
    tensors: int
    tensor_bytes: int
    dtype: str | None


def export_model(
    root: str | os.PathLike[str],
    step: int,
    out: str | os.PathLike[str],
    *,
    item: str | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = True,
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

    Returns:
        What was written.

    Raises:
        StepNotFoundError: nothing under ``root`` has the name of ``step``.
        CorruptCheckpointError: ``step`` is not a committed step (a folder without valid
            metadata, a link, ...), or ``verify`` found the item damaged; nothing was written.
        ItemNotFoundError: the step has no model item (or not ``item``).
        StepAlreadyExistsError: ``out`` exists and is not an empty folder.
        CheckpointValueError: ``dtype`` is not a floating dtype.
    """
    root, out = Path(root), Path(out)
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
    if (source / ADAPTER_CONFIG).is_file():
        # Its tensors are a LoRA adapter's, not a model's: copied as a model folder they would
        # load as a model with random weights.
        raise CheckpointValueError(
            f"item {name!r} of step {step} in {root} is a PEFT adapter, not a whole model; load "
            "it with peft.PeftModel.from_pretrained(base_model, step_dir / "
            f"{name!r}) and merge_and_unload() it (exporting a merged model is not built yet)"
        )
    readers = open_model_folder(source)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.orbit-export-tmp"
    out.parent.mkdir(parents=True, exist_ok=True)
    with _fs.staged_folder(tmp, out):
        written, tensor_bytes = _write(source, tmp, readers, dtype)
    return ExportResult(
        step=step,
        item=name,
        out=out,
        files=tuple(written),
        tensors=len(readers),
        tensor_bytes=tensor_bytes,
        dtype=None if dtype is None else torch_dtype_name(dtype),
    )


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
) -> tuple[list[str], int]:
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
        index = json.loads((source / INDEX_FILE).read_bytes())
        index.setdefault("metadata", {})["total_size"] = tensor_bytes
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(INDEX_FILE)
    for rel in _fs.iter_files(source):
        if rel.as_posix() in weights:
            continue
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel.as_posix() == CONFIG_FILE and dtype is not None:
            config = json.loads((source / rel).read_bytes())
            key = "torch_dtype" if "torch_dtype" in config else "dtype"
            config[key] = torch_dtype_name(dtype)
            (tmp / rel).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(source / rel, tmp / rel)
        written.append(rel.as_posix())
    return sorted(written), tensor_bytes
