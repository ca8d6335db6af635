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

peft is never imported by orbit_pt unless such a model is saved or restored, or an adapter is
merged for an export: a PeftModel exists only once peft is imported, so detection looks at
``sys.modules``.

For ``orbit-pt export --merge-adapter`` this module also picks the adapter of a step
(:func:`select_adapter`), finds its base model folder (:func:`base_folder`; never downloaded),
loads it as the class the adapter was trained on (:func:`load_base`) and merges the adapter into
it (:func:`merged_model`).
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orbit_pt._format.remote_files import is_file
from orbit_pt._format.safe_open import read_json_object
from orbit_pt._format.safetensors import SafetensorsReader
from orbit_pt._format.sharding import is_dtensor
from orbit_pt.errors import (
    CheckpointError,
    CheckpointTypeError,
    CheckpointValueError,
    ItemNotFoundError,
)
from orbit_pt.handlers._materialize import is_meta
from orbit_pt.handlers._wrappers import unwrap

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_ADAPTER = "default"
_SHOWN = 5

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""The tokenizer files of a base folder that a merged export carries along."""

# PEFT's task types -> the transformers auto class it builds the base with (AutoPeftModel's map).
_TASK_CLASSES = {
    "CAUSAL_LM": "AutoModelForCausalLM",
    "SEQ_CLS": "AutoModelForSequenceClassification",
    "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM",
    "TOKEN_CLS": "AutoModelForTokenClassification",
    "QUESTION_ANS": "AutoModelForQuestionAnswering",
    "FEATURE_EXTRACTION": "AutoModel",
}


def peft_model(module: torch.nn.Module) -> Any | None:
    """The ``peft.PeftModel`` inside any wrappers of ``module``, or None."""
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    # isinstance, not the class's module: fully_shard swaps in a subclass made by torch
    # (FSDPPeftModel...), whose __module__ is torch's.
    inner = unwrap(module)
    return inner if isinstance(inner, peft.PeftModel) else None


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
    # is_file: a step restored from object storage reads its weights by range, not from disk.
    found = {"": directory} if is_file(directory / ADAPTER_WEIGHTS) else {}
    if directory.is_dir():
        for sub in sorted(directory.iterdir()):
            if sub.is_dir() and is_file(sub / ADAPTER_WEIGHTS):
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


def select_adapter(directory: Path, adapter_name: str | None = None) -> tuple[str, Path]:
    """The name and folder of one adapter saved in ``directory``.

    Args:
        directory: an item folder holding adapters (``mgr.step_dir(step) / item``).
        adapter_name: the adapter wanted; None picks ``"default"``, or the only adapter saved.

    Raises:
        ItemNotFoundError: no adapter of that name is saved (the message lists those that are).
        CheckpointValueError: ``adapter_name`` is None and several adapters but no
            ``"default"`` are saved.
    """
    found = {
        folder or DEFAULT_ADAPTER: path
        for folder, path in adapter_folders(directory).items()
        if (path / ADAPTER_CONFIG).is_file()
    }
    if not found:
        raise CheckpointValueError(
            f"{directory} holds no adapter with both {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}; "
            "PEFT cannot load it, so it cannot be merged"
        )
    if adapter_name is None:
        if DEFAULT_ADAPTER in found:
            return DEFAULT_ADAPTER, found[DEFAULT_ADAPTER]
        if len(found) == 1:
            return next(iter(found.items()))
        raise CheckpointValueError(
            f"{directory} holds the adapters {sorted(found)} and none is named "
            f"{DEFAULT_ADAPTER!r}; choose one with adapter_name=NAME (--adapter NAME)"
        )
    if adapter_name not in found:
        raise ItemNotFoundError(
            f"{directory} holds no adapter named {adapter_name!r}; its adapters are "
            f"{sorted(found) or 'none'} -- pass one of them as adapter_name (--adapter NAME)"
        )
    return adapter_name, found[adapter_name]


def base_folder(adapter_dir: Path, base: str | os.PathLike[str] | None = None) -> Path:
    """The local folder of the base model the adapter in ``adapter_dir`` was trained on.

    ``base`` when given, else ``base_model_name_or_path`` of its ``adapter_config.json``. Nothing
    is ever downloaded: a Hub id, or a folder that is gone, is an error that says to pass the
    folder explicitly.

    Raises:
        CheckpointValueError: no such local folder, or it is not a Hugging Face model folder.
    """
    config_path = adapter_dir / ADAPTER_CONFIG
    if base is not None:
        path, origin = Path(base).expanduser(), f"base={str(base)!r}"
    else:
        recorded = read_json_object(config_path).get("base_model_name_or_path")
        if not recorded:
            raise CheckpointValueError(
                f"{config_path} names no base model (base_model_name_or_path is null: the base "
                "was built from a config, not loaded from a folder); pass the base model's "
                "folder: base=PATH (orbit-pt export --base PATH)"
            )
        path = Path(str(recorded)).expanduser()
        origin = f"the adapter's base model {recorded!r} (base_model_name_or_path in {config_path})"
        if not path.is_dir():
            raise CheckpointValueError(
                f"{origin} is not a local folder, and orbit_pt never downloads a model; pass the "
                "folder of that base model: base=PATH (orbit-pt export --base PATH), e.g. after "
                f"`hf download {recorded} --local-dir PATH`"
            )
    if not path.is_dir():
        raise CheckpointValueError(
            f"{origin} is not a folder; pass the folder of the base model the adapter was "
            "trained on (its config.json and weights)"
        )
    if not (path / "config.json").is_file():
        raise CheckpointValueError(
            f"{origin}: {path} has no config.json, so it is not a Hugging Face model folder; "
            "pass the folder of the base model the adapter was trained on (base=PATH, "
            "orbit-pt export --base PATH)"
        )
    return path


def load_base(base: Path, adapter_dir: Path) -> torch.nn.Module:
    """The base model in folder ``base``, as the class the adapter in ``adapter_dir`` adapts.

    The class is the one PEFT's ``AutoPeftModel`` would build: the auto class of the adapter's
    ``task_type``, else the ``auto_mapping`` class PEFT records for a config without one, else
    ``architectures[0]`` of the base's ``config.json``. It is loaded with ``from_pretrained``'s
    defaults (its own dtype in transformers 5) and ``local_files_only``.

    Raises:
        CheckpointError: transformers is not installed.
        CheckpointValueError: no class could be found for the base.
    """
    transformers = _require("transformers", "loading the base model to merge an adapter into")
    config = read_json_object(adapter_dir / ADAPTER_CONFIG)
    cls = _base_class(transformers, config, base)
    model = cls.from_pretrained(str(base), local_files_only=True)
    if not isinstance(model, torch.nn.Module):  # pragma: no cover - transformers' contract
        raise CheckpointTypeError(f"{cls.__name__}.from_pretrained returned {type(model)}")
    return model


def merged_model(adapter_dir: str | Path, base_model: torch.nn.Module) -> torch.nn.Module:
    """``base_model`` with the adapter saved in ``adapter_dir`` merged into its weights.

    For an export of a fine-tuned model as a plain transformers folder: the result is the base
    model's class with ``W + scale * B @ A`` in place of each adapted weight (PEFT's
    ``merge_and_unload``). ``base_model`` itself is changed: the adapter is merged into it.

    Args:
        adapter_dir: a folder holding ``adapter_model.safetensors`` and ``adapter_config.json``
            (``mgr.step_dir(step) / item``, or its subfolder for an adapter not named
            ``"default"``).
        base_model: the frozen base the adapter was trained on, with its weights loaded.

    Raises:
        CheckpointError: peft is not installed.
    """
    peft = _require("peft", "merging a PEFT adapter into its base model")
    adapted = peft.PeftModel.from_pretrained(base_model, str(adapter_dir))
    merged = adapted.merge_and_unload()
    if not isinstance(merged, torch.nn.Module):  # pragma: no cover - PEFT's contract
        raise CheckpointTypeError(f"merge_and_unload returned {type(merged).__name__}")
    return merged


# ------------------------------------------------------------------------------------- helpers


def _require(module: str, purpose: str) -> Any:
    """Import the optional dependency ``module``, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CheckpointError(
            f"{purpose} needs {module}, which is not installed: pip install {module}"
        ) from exc


def _base_class(transformers: Any, adapter_config: Mapping[str, Any], base: Path) -> Any:
    task_type = adapter_config.get("task_type")
    if task_type in _TASK_CLASSES:
        return getattr(transformers, _TASK_CLASSES[task_type])
    mapping = adapter_config.get("auto_mapping") or {}
    name, library = mapping.get("base_model_class"), str(mapping.get("parent_library", ""))
    if name and (library == "transformers" or library.startswith("transformers.")):
        found = getattr(importlib.import_module(library), name, None)
        if found is not None:
            return found
    architectures = json.loads((base / "config.json").read_bytes()).get("architectures") or []
    found = getattr(transformers, architectures[0], None) if architectures else None
    if found is None:
        raise CheckpointValueError(
            f"cannot tell which transformers class to load the base model in {base} as: the "
            f"adapter's task_type is {task_type!r}, its auto_mapping names {name!r} and the "
            f"base's config.json lists architectures {architectures}; load it yourself and "
            "merge with orbit_pt.handlers._peft.merged_model(adapter_folder, base_model)"
        )
    return found


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
