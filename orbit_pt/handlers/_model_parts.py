"""A list of modules that are parts of one model (torchtitan's ``model_parts``) seen as one.

Pipeline stages that keep the model's global names (and virtual stages: several parts on one
rank) are merged into one view tree whose ``state_dict`` has every part's tensors under their
global names; the leaves are the parts' own modules. See docs/layouts.md.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence
from typing import Any

import torch

from orbit_pt.errors import CheckpointValueError


def parts_of(item: Any) -> list[torch.nn.Module] | None:
    """The modules of ``item`` when it is a non-empty list or tuple of modules, else None."""
    modules = isinstance(item, (list, tuple)) and item
    if modules and all(isinstance(part, torch.nn.Module) for part in item):
        return list(item)
    return None


def as_module(item: Any) -> torch.nn.Module | None:
    """``item`` as one module: itself, the merged view of its parts, or None."""
    if isinstance(item, torch.nn.Module):
        return item
    parts = parts_of(item)
    return None if parts is None else merged(parts)


def merged(parts: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One module tree showing every part's submodules, parameters and buffers.

    Where parts hold the same submodule path with different objects (the root, ``model``,
    ``model.layers``), the view is a shallow copy of the first part's module (same class,
    config and hooks) with the union of their children; where only one part holds a path,
    the view holds that part's own module. A name held by two parts as different tensors is an
    error: it would be saved twice with no way to tell which is right.
    """
    return _merge(list(parts), "")


def _merge(modules: list[torch.nn.Module], path: str) -> torch.nn.Module:
    distinct = list({id(module): module for module in modules}.values())
    first = distinct[0]
    if len(distinct) == 1:
        return first
    classes = {type(module).__name__ for module in distinct}
    if len(classes) > 1:
        raise CheckpointValueError(
            f"the model parts hold different modules at {path or 'their root'} "
            f"({sorted(classes)}); parts of one model must keep its global names and modules "
            "(as torchtitan's pipeline stages do), so that their union is the model"
        )
    view = copy.copy(first)  # shares the first part's attributes; the dicts below are its own
    children: dict[str, list[torch.nn.Module]] = {}
    for module in distinct:
        for name, child in module._modules.items():
            if child is not None:
                children.setdefault(name, []).append(child)
    transient = set().union(*(module._non_persistent_buffers_set for module in distinct))
    parameters = _union([module._parameters for module in distinct], path, "parameter")
    buffers = _union([module._buffers for module in distinct], path, "buffer", transient)
    view.__dict__["_modules"] = {
        name: _merge(held, f"{path}.{name}" if path else name) for name, held in children.items()
    }
    view.__dict__["_parameters"] = parameters
    view.__dict__["_buffers"] = buffers
    view.__dict__["_non_persistent_buffers_set"] = transient
    return view


def _union(
    held: list[dict[str, Any]], path: str, kind: str, transient: Collection[str] = ()
) -> dict[str, Any]:
    """The tensors of several parts' modules at one path; non-persistent buffers (each part's
    own rotary ``inv_freq``, never saved): the first part's."""
    out: dict[str, Any] = {}
    for tensors in held:
        for name, tensor in tensors.items():
            seen = out.get(name)
            if tensor is None or seen is tensor or (seen is not None and name in transient):
                out.setdefault(name, tensor)
            elif seen is None:
                out[name] = tensor
            else:
                raise CheckpointValueError(
                    f"two model parts hold {kind} {path + '.' if path else ''}{name} as different "
                    "tensors; each tensor of a model must be in one part (tied weights: the same "
                    "object)"
                )
    return out
