"""PEFT models (LoRA, ...): the adapter in PEFT's own format, never the frozen base.

A ``peft.PeftModel`` item is saved as ``PeftModel.save_pretrained`` saves it:

- ``adapter_model.safetensors``: ``peft.get_peft_model_state_dict(model, adapter_name=...)``,
  PEFT's own keys (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``: no
  adapter name) and tensors;
- ``adapter_config.json``: the adapter's ``PeftConfig`` written by its own ``save_pretrained``,
  with ``inference_mode`` set and ``base_model_name_or_path`` filled in as PEFT does;
- an adapter other than ``"default"`` in a subfolder named after it, as PEFT lays them out.

So ``PeftModel.from_pretrained(base, mgr.step_dir(step) / "model")`` loads it. The frozen base is
not written at any step: it lives where it came from (the pretrained folder or Hub id recorded
as ``base_model_name_or_path``). A restore loads only the adapter weights, in place, into the
live PeftModel, whose base the caller built (e.g. with ``from_pretrained``).

peft is never imported by orbit_pt unless such a model is saved or restored: a PeftModel exists
only once peft is imported, so detection looks at ``sys.modules``.
"""

from __future__ import annotations

import copy
import importlib
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orbit_pt._format.safetensors import SafetensorsReader
from orbit_pt._format.sharding import is_dtensor
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError
from orbit_pt.handlers._materialize import is_meta
from orbit_pt.handlers._wrappers import unwrap

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_ADAPTER = "default"
_SHOWN = 5


def peft_model(module: torch.nn.Module) -> Any | None:
    """The ``peft.PeftModel`` inside any wrappers of ``module``, or None."""
    inner = unwrap(module)
    if not type(inner).__module__.startswith("peft"):
        return None
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(inner, peft.PeftModel):
        return None
    return inner


def adapter_folder(adapter_name: str) -> str:
    """The subfolder PEFT puts an adapter in: none for ``"default"``, else its name."""
    return "" if adapter_name == DEFAULT_ADAPTER else adapter_name


def saved_name(folder: str, key: str) -> str:
    """How one adapter tensor is named across all adapters of a folder: ``[folder/]key``."""
    return f"{folder}/{key}" if folder else key


def folder_of(name: str) -> str:
    """The subfolder of a saved name (see :func:`saved_name`); '' for the default adapter."""
    return name.partition("/")[0] if "/" in name else ""


def adapter_folders(directory: Path) -> dict[str, Path]:
    """Subfolder ('' for the root) -> folder, for every adapter saved in ``directory``."""
    found = {"": directory} if (directory / ADAPTER_WEIGHTS).is_file() else {}
    if directory.is_dir():
        for sub in sorted(directory.iterdir()):
            if sub.is_dir() and (sub / ADAPTER_WEIGHTS).is_file():
                found[sub.name] = sub
    return found


def open_adapter_folders(directory: Path) -> dict[str, dict[str, SafetensorsReader]]:
    """Subfolder ('' for the default adapter) -> PEFT's key -> the validated reader."""
    out: dict[str, dict[str, SafetensorsReader]] = {}
    for folder, path in adapter_folders(directory).items():
        reader = SafetensorsReader(path / ADAPTER_WEIGHTS)
        out[folder] = dict.fromkeys(reader.entries, reader)
    return out


@dataclass(frozen=True)
class AdapterPart:
    """One adapter, ready to write.

    Attributes:
        folder: its subfolder ('' for the default adapter).
        tensors: PEFT's key -> the live tensor (shares memory with the model).
        config: a copy of its ``PeftConfig`` as ``save_pretrained`` writes it.
        auto_mapping: the ``auto_mapping`` PEFT adds for a config without a task type.
    """

    folder: str
    tensors: dict[str, torch.Tensor]
    config: Any
    auto_mapping: dict[str, str] | None


def adapter_parts(model: Any) -> list[AdapterPart]:
    """Every adapter of the PeftModel ``model``, as ``PeftModel.save_pretrained`` would write it.

    Raises:
        CheckpointValueError: a trainable parameter is in no adapter (it would be lost).
    """
    from peft import get_peft_model_state_dict

    parts: list[AdapterPart] = []
    for adapter_name, live_config in model.peft_config.items():
        tensors = dict(get_peft_model_state_dict(model, adapter_name=adapter_name))
        config = copy.deepcopy(live_config)
        if config.base_model_name_or_path is None:
            base = model.base_model if config.is_prompt_learning else model.base_model.model
            config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
        config.inference_mode = True
        auto_mapping = None
        if config.task_type is None:
            cls = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
            auto_mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
        parts.append(AdapterPart(adapter_folder(adapter_name), tensors, config, auto_mapping))
    _check_trainable_saved(model, [t for part in parts for t in part.tensors.values()])
    return parts


def write_config(directory: Path, part: AdapterPart) -> None:
    """``adapter_config.json`` of ``part``, written by PEFT's own ``PeftConfig.save_pretrained``."""
    part.config.save_pretrained(str(directory), auto_mapping_dict=part.auto_mapping)


def restore_targets(
    model: Any, present: Mapping[str, Iterable[str]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Subfolder -> PEFT's key -> the live tensor it is read into, for every adapter of ``model``.

    The adapter's own weights always; the embedding layers PEFT saves alongside when it decides
    to (``save_embedding_layers="auto"``) only if the checkpoint has them (``present``: the keys
    saved in each subfolder), so a restore needs no look-up of the base model.

    Raises:
        CheckpointTypeError: PEFT's state of an adapter is a copy, not the model's memory.
        CheckpointValueError: a tensor of the model is on the meta device.
    """
    from peft import get_peft_model_state_dict

    _refuse_meta(model)
    live = _storages(model.state_dict().values())
    out: dict[str, dict[str, torch.Tensor]] = {}
    for adapter_name in model.peft_config:
        folder = adapter_folder(adapter_name)
        state = dict(
            get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)
        )
        if set(present.get(folder, ())) - set(state):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "could not identify embedding layer(s)"
                state.update(
                    get_peft_model_state_dict(
                        model, adapter_name=adapter_name, save_embedding_layers=True
                    )
                )
        for key, tensor in state.items():
            if tensor.numel() and _storage(tensor) not in live:
                raise CheckpointTypeError(
                    f"PEFT's state of adapter {adapter_name!r} holds {key!r} as a copy, not as "
                    "the model's own tensor, so orbit_pt cannot restore it in place; load this "
                    "adapter with PeftModel.load_adapter(mgr.step_dir(step) / item) instead"
                )
        out[folder] = state
    return out


def merged_model(adapter_dir: str | Path, base_model: torch.nn.Module) -> torch.nn.Module:
    """``base_model`` with the adapter saved in ``adapter_dir`` merged into its weights.

    For an export of a fine-tuned model as a plain transformers folder: the result is the base
    model's class with ``W + scale * B @ A`` in place of each adapted weight (PEFT's
    ``merge_and_unload``). ``base_model`` itself is changed: the adapter is merged into it.

    Args:
        adapter_dir: a folder holding ``adapter_model.safetensors`` and ``adapter_config.json``
            (``mgr.step_dir(step) / item``).
        base_model: the frozen base the adapter was trained on, with its weights loaded.
    """
    peft = importlib.import_module("peft")
    adapted = peft.PeftModel.from_pretrained(base_model, str(adapter_dir))
    merged = adapted.merge_and_unload()
    if not isinstance(merged, torch.nn.Module):  # pragma: no cover - PEFT's contract
        raise CheckpointTypeError(f"merge_and_unload returned {type(merged).__name__}")
    return merged


# ------------------------------------------------------------------------------------- helpers


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
    return int(local.untyped_storage().data_ptr())


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {_storage(t) for t in tensors if t.numel()}


def _check_trainable_saved(model: Any, saved: list[torch.Tensor]) -> None:
    kept = _storages(saved)
    lost = [
        name
        for name, param in model.named_parameters()
        if param.requires_grad and param.numel() and _storage(param) not in kept
    ]
    if lost:
        raise CheckpointValueError(
            f"the PeftModel trains {len(lost)} parameter(s) that are in no adapter, e.g. "
            f"{lost[:_SHOWN]}; a checkpoint holds only the adapters, so their training would be "
            "lost. List those modules in the PEFT config's modules_to_save (PEFT then saves "
            "them with the adapter), or freeze them with requires_grad_(False)"
        )


def _refuse_meta(model: Any) -> None:
    meta = [name for name, tensor in model.state_dict(keep_vars=True).items() if is_meta(tensor)]
    if meta:
        raise CheckpointValueError(
            f"the PeftModel has {len(meta)} tensor(s) on the meta device, e.g. {meta[:_SHOWN]}; "
            "a PEFT checkpoint holds only the adapters, so the base weights must be loaded "
            "first (e.g. AutoModelForCausalLM.from_pretrained) and the adapter built with "
            "real weights (get_peft_model(..., low_cpu_mem_usage=False)) before the restore"
        )
