"""Loading a pretrained Hugging Face model folder into a model that already exists.

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    load_pretrained(model, path)  # each rank reads only its own rows of every tensor

A fine-tune starts from base weights. ``from_pretrained`` on every rank, then sharding, holds
the whole model on every rank first; :func:`load_pretrained` reads the folder straight into the
model as it is -- plain, or FSDP2-sharded, even still on the meta device -- so a rank holds its
own shard and one tensor's worth of read buffer, never the model. It is a model restore
(:class:`~orbit_pt.handlers.ModelHandler` reading a folder it did not write), so it accepts
exactly the folders a checkpoint's ``model/`` item is: ``model.safetensors``, or shards listed
in ``model.safetensors.index.json``. See docs/pretrained.md.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from orbit_pt._control.collective import Collective
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError
from orbit_pt.handlers._model_parts import as_module
from orbit_pt.handlers._peft import adapter_folders, peft_model
from orbit_pt.handlers.base import HandlerContext
from orbit_pt.handlers.model import INDEX_FILE, SINGLE_FILE, ModelHandler

logger = logging.getLogger(__name__)

__all__ = ["load_pretrained"]

# Weights in pickle formats: never read (unpickling can run code), but named in the error.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# "org/name" or "name": what a Hugging Face Hub id looks like (and a relative path may too).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_SHOWN = 5

_Model = TypeVar("_Model", bound="torch.nn.Module | Sequence[torch.nn.Module]")


def load_pretrained(
    model: _Model,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
) -> _Model:
    """Load the weights of a local Hugging Face model folder into ``model``, in place.

    ``model`` may be a list of parts of one model that keep its global names (torchtitan's
    ``model_parts``: pipeline stages; each rank reads what its parts hold). It may be a plain
    module, a wrapped one (DDP, ``torch.compile``, ...), or an FSDP2
    (``fully_shard``) / DTensor model, whose every rank reads only the rows of each tensor that
    it holds, straight from the files into its local shard. Peak memory on a rank is its shard
    plus one tensor's (local rows') read buffer, never the whole model. Under
    torch.distributed every rank calls it (as every rank builds the model): the data is read
    with no communication, and one agreement at the end makes a failure on any rank raise on
    every rank (naming it).

    Floating tensors are cast to the dtype of the model's tensor (``torch.Tensor.copy_``:
    bf16/fp16 -> fp32 is exact; fp32 -> bf16/fp16 rounds to nearest even), so the loaded model
    holds what ``from_pretrained(path, dtype=<the model's dtype>)`` holds; other dtypes and
    every shape must match. Tied weights stay tied: a tied group is filled from whichever of
    its names the folder holds (transformers writes only one).

    A model on the meta device (built under ``with torch.device("meta")``, sharded or not) is
    first given memory on ``device`` -- the parameter objects are kept, so an optimizer built
    over them stays valid -- and its non-persistent buffers (the rotary ``inv_freq``) are
    recomputed by the model's own ``_init_weights``, as ``from_pretrained`` does; the folder
    must then fill every other tensor, even with ``strict=False``. Only transformers models
    can be recomputed so; another module with non-persistent buffers is refused before
    anything changes.

    A folder of PEFT adapters (``adapter_model.safetensors``) loads into a ``peft.PeftModel``
    (its adapter weights only, as a restore does); base weights load into the base model
    before it is wrapped.

    Never downloads: ``path`` must be a local folder (fetch a Hub model first, e.g. with
    ``huggingface-cli download ORG/NAME --local-dir DIR``). Pickle weights
    (``pytorch_model.bin``) are never read.

    Args:
        model: the module to load into; changed in place.
        path: a local Hugging Face model folder: ``model.safetensors``, or
            ``model.safetensors.index.json`` and the shards it lists (as ``save_pretrained``
            and orbit_pt's checkpoints write them), in any floating dtype.
        strict: whether every tensor of the model must be in the folder and every tensor of
            the folder in the model (shapes must match either way). With ``strict=False`` the
            model's tensors that the folder lacks keep their values, and tensors of the folder
            that the model lacks are skipped, without a report.
        device: where a model on the meta device gets memory. None: the device of the model's
            tensors that are not on meta; else its FSDP2 mesh's device (the current CUDA
            device on a CUDA mesh); else the CPU. Ignored when nothing is on meta.

    Returns:
        ``model`` itself, loaded (so ``model = load_pretrained(build(), path)`` reads well).

    Raises:
        CheckpointTypeError: ``model`` is not an ``nn.Module``, or ``path`` is not a path, or
            a whole model's folder is loaded into a ``peft.PeftModel`` (or adapters into a
            plain model).
        CheckpointValueError: ``path`` is not a local folder (a Hub id, a file, nothing), or
            holds no safetensors model (e.g. only ``pytorch_model.bin``), or the meta model
            cannot be materialised; nothing was loaded.
        StateMismatchError: the model does not fit the folder (missing, unexpected or
            mismatched keys, each listed); nothing was loaded.
        CorruptCheckpointError: the index and the shards disagree, or a file is damaged.
    """
    module = as_module(model)  # a list of pipeline-stage parts loads as their union
    if module is None:
        raise CheckpointTypeError(
            "load_pretrained loads into a torch.nn.Module (or a list of parts of one model), "
            f"got {type(model).__name__}"
        )
    distributed = dist.is_available() and dist.is_initialized()
    started = time.perf_counter()

    def load(collective: Collective | None = None) -> Path:
        folder = _model_folder(path)
        if peft_model(module) is not None and _holds_model(folder):
            raise CheckpointTypeError(
                f"{folder} holds a whole model, and the target is a peft.PeftModel, whose base "
                "layers have other names (q_proj.base_layer.weight, ...); load the base "
                "weights before wrapping: load_pretrained(base, path), then "
                "peft.get_peft_model(base, config). (A folder of PEFT adapters loads into a "
                "PeftModel as it is.)"
            )
        # The folder was written by one process; FSDP2 rows are found from each DTensor's own
        # mesh, whatever wrote the files.
        context = HandlerContext(
            step=0,
            rank=dist.get_rank() if distributed else 0,
            world_size=dist.get_world_size() if distributed else 1,
            saved_world_size=1,
            # Agrees on the plan before any rank moves rows to a peer (tensor parallelism),
            # and on which keys no rank holds (pipeline stages each hold some).
            collective=collective,
        )
        ModelHandler(strict=strict, device=device).restore(folder, module, context)
        return folder

    if distributed:
        # One agreement: a rank that fails (a bad path, an unreadable shard, a model that does
        # not fit) fails every rank here, instead of leaving its peers to hang in the next
        # collective.
        collective = Collective()
        try:
            folder = collective.run_everywhere(
                "orbit_pt.load_pretrained",
                lambda: load(collective),
                label=f"loading {os.fspath(path)}",
            )
        finally:
            collective.close()
    else:
        folder = load()
    logger.info(
        "loaded the pretrained weights of %s into %s in %.1f s",
        folder,
        type(model).__name__,
        time.perf_counter() - started,
    )
    return model


def _holds_model(folder: Path) -> bool:
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


def _model_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder holding a safetensors model, or an error that says what to do."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointTypeError(
            f"path must be a local folder (str or os.PathLike), got {type(path).__name__}"
        )
    folder = Path(path).expanduser()
    if folder.is_file():
        raise CheckpointValueError(
            f"{str(path)!r} is a file; load_pretrained takes the model folder that holds "
            f"{SINGLE_FILE} (or {INDEX_FILE} and its shards): pass {str(folder.parent)!r}"
        )
    if not folder.is_dir():
        if isinstance(path, str) and _HUB_ID.fullmatch(path) and not path.startswith("."):
            raise CheckpointValueError(
                f"{path!r} is not a local folder, and load_pretrained never downloads; if it "
                "is a Hugging Face Hub id, download it first (huggingface-cli download "
                f"{path} --local-dir DIR, or huggingface_hub.snapshot_download({path!r})) and "
                "pass that folder"
            )
        raise CheckpointValueError(
            f"{str(path)!r} does not exist; pass a local Hugging Face model folder"
        )
    if _holds_model(folder):
        return folder
    if adapter_folders(folder):
        return folder  # PEFT adapters: the handler loads them into a PeftModel, or says why not
    names = sorted(p.name for p in folder.iterdir())
    pickles = [n for n in names if n.endswith(_PICKLE_SUFFIXES)]
    if pickles:
        raise CheckpointValueError(
            f"{folder} holds weights only as pickle files {pickles[:_SHOWN]}, which orbit_pt "
            "never reads (loading a pickle can run arbitrary code). Convert the folder once, "
            "where you trust its source: transformers.AutoModelForCausalLM.from_pretrained("
            f"{str(folder)!r}).save_pretrained(OUT) (any AutoModel class that fits) writes "
            f"{SINGLE_FILE} and config.json into OUT; load OUT"
        )
    others = [n for n in names if n.endswith(".safetensors")]
    if others:
        raise CheckpointValueError(
            f"{folder} holds {others[:_SHOWN]} but neither {SINGLE_FILE} nor {INDEX_FILE}; "
            "load_pretrained reads the Hugging Face layout only. Rename a single file to "
            f"{SINGLE_FILE}, or write {INDEX_FILE} for the shards, or re-save it with "
            "save_pretrained"
        )
    nested = folder / "model"
    if (nested / SINGLE_FILE).is_file() or (nested / INDEX_FILE).is_file():
        raise CheckpointValueError(
            f"{folder} holds no model files, but its model/ subfolder does (a checkpoint "
            f"step?); pass {str(nested)!r}"
        )
    raise CheckpointValueError(
        f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}; it is not a Hugging Face "
        "model folder (it holds: " + (", ".join(names[:_SHOWN]) or "nothing") + ")"
    )
