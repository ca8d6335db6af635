"""Tied weights: one tensor reachable under several names is written once, under one name.

transformers ties the input embedding and the output head (``lm_head.weight`` is
``model.embed_tokens.weight``) and writes the tensor once, under the name it does not list in
``_tied_weights_keys``. The model handler does the same, and a restore fills every name of a
group from whichever one the checkpoint holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from orbit_pt._format.sharding import is_dtensor
from orbit_pt.handlers._wrappers import key_namer, unwrap


def tie_groups(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by the tensor they are (same memory, shape, strides and dtype), in order.

    Tensors on the meta device have no memory: they are grouped by object identity, which
    groups tied weights when ``state`` holds the module's own parameter objects
    (``state_dict(keep_vars=True)``).
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in state.items():
        key: tuple[Any, ...]
        if is_dtensor(tensor):
            # Global facts plus the local shard's storage: the same grouping on every rank,
            # including ranks whose shard has no rows (FSDP2 keeps those in padded storage).
            local = tensor.to_local()  # type: ignore[attr-defined]
            storage = 0 if local.is_meta else local.untyped_storage().data_ptr()
            if local.is_meta:
                key = ("meta", id(tensor))
            elif storage:
                key = (
                    "dtensor",
                    storage,
                    local.storage_offset(),
                    tuple(tensor.shape),
                    tensor.dtype,
                )
            else:
                key = (name,)
        elif tensor.device.type == "meta":
            key = ("meta", id(tensor))
        elif tensor.numel() == 0:
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
    keeps, so optimizer state and model weights always agree on names. Wrapper parts (DDP's
    ``module.``, ``_orig_mod.``, ...) are never part of a name.
    """
    name = key_namer(module)
    by_param: dict[int, list[str]] = {}
    for key, param in module.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name(key))
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
