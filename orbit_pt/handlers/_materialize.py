"""Restoring into a model built on the meta device: give its tensors memory, then load.

A model built under ``with torch.device("meta")`` (to skip a random init that the checkpoint
overwrites anyway, or to shard it with FSDP2 before any weight exists) has no data. A restore
into it must not return with tensors still on meta, nor with tensors that hold whatever the
allocator left there. So, before reading:

1. every parameter and buffer on meta gets memory on one device (:func:`target_device`):
   the whole module with ``module.to_empty(device=...)`` when everything is on meta (FSDP2
   included: its DTensor local shards get memory, and FSDP2 re-registers them), else tensor by
   tensor. Both keep each parameter object (``torch.utils.swap_tensors``), so tied weights stay
   tied and an optimizer built over the meta parameters still holds the model's parameters;
2. non-persistent buffers (rotary ``inv_freq``, ...) are not in a checkpoint, so they are
   recomputed: for transformers models, by the model's own ``_init_weights`` on the submodule
   that owns them (what ``from_pretrained`` does). Other modules are refused before anything
   changes, naming the buffers, because orbit_pt cannot know how to compute them;
3. then the restore reads every weight as usual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from orbit_pt._format.sharding import is_dtensor
from orbit_pt.errors import CheckpointValueError

_SHOWN = 5


def is_meta(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or, for a DTensor, its local shard) has no data: it is on meta."""
    if is_dtensor(tensor):
        return bool(tensor.to_local().is_meta)  # type: ignore[attr-defined]
    return bool(tensor.is_meta)


@dataclass(frozen=True)
class _Transient:
    """A non-persistent buffer: where it lives, and the initializer that recomputes it."""

    path: str
    owner: torch.nn.Module
    name: str
    init: Callable[[torch.nn.Module], object] | None


def _transient_on_meta(module: torch.nn.Module) -> list[_Transient]:
    modules = dict(module.named_modules())
    out: list[_Transient] = []
    for path, owner in modules.items():
        for name in sorted(owner._non_persistent_buffers_set):
            buffer = owner._buffers.get(name)
            if buffer is not None and is_meta(buffer):
                full = f"{path}.{name}" if path else name
                out.append(_Transient(full, owner, name, _initializer(path, modules)))
    return out


def _initializer(
    path: str, modules: Mapping[str, torch.nn.Module]
) -> Callable[[torch.nn.Module], object] | None:
    """The nearest ``_init_weights`` above ``path`` (transformers' per-module initializer)."""
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        ancestor = modules.get(".".join(parts[:depth]))
        init = getattr(ancestor, "_init_weights", None)
        if callable(init) and getattr(ancestor, "config", None) is not None:
            return init  # type: ignore[no-any-return]
    return None


def _tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def target_device(module: torch.nn.Module, requested: torch.device | None) -> torch.device:
    """Where meta tensors get memory.

    ``requested`` (``ModelHandler(device=...)``) when given; else the device of the module's
    tensors that are not on meta, when they share one; else, for an FSDP2 model, its mesh's
    device (the current CUDA device on a CUDA mesh); else the CPU.
    """
    if requested is not None:
        return requested
    devices: set[torch.device] = set()
    mesh_types: set[str] = set()
    for tensor in _tensors(module):
        local = tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
        if is_dtensor(tensor):
            mesh_types.add(str(tensor.device_mesh.device_type))  # type: ignore[attr-defined]
        if not local.is_meta:
            devices.add(local.device)
    if len(devices) > 1:
        raise CheckpointValueError(
            f"the module has tensors on the meta device and the rest on several devices "
            f"({sorted(map(str, devices))}); say where the meta tensors go with "
            "ModelHandler(device=...)"
        )
    if devices:
        return devices.pop()
    if mesh_types == {"cuda"} and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if len(mesh_types) == 1 and mesh_types != {"cuda"}:
        return torch.device(mesh_types.pop())
    return torch.device("cpu")


def check_materializable(module: torch.nn.Module, what: str) -> list[_Transient]:
    """Refuse, before anything changes, a meta module whose transient buffers cannot be rebuilt.

    Returns the non-persistent buffers on meta, each with the initializer that recomputes it.
    """
    transient = _transient_on_meta(module)
    orphans = [t.path for t in transient if t.init is None]
    if orphans:
        raise CheckpointValueError(
            f"{what}: the module is on the meta device, and its non-persistent buffers "
            f"{orphans[:_SHOWN]} are not in any checkpoint; orbit_pt recomputes those only for "
            "transformers models (with the model's _init_weights). Materialise the module "
            "yourself before the restore: module.to_empty(device=...), then recompute those "
            "buffers (e.g. the rotary inv_freq)"
        )
    meta = [t for t in _tensors(module) if is_meta(t)]
    if any(is_dtensor(t) for t in meta) and len(meta) != sum(1 for _ in _tensors(module)):
        raise CheckpointValueError(
            f"{what}: the FSDP2 module has some tensors on the meta device and some not; "
            "orbit_pt materialises an FSDP2 module only when all of it is on meta. Call "
            "module.to_empty(device=...) yourself first, or build it all on meta"
        )
    return transient


def materialize(
    module: torch.nn.Module, device: torch.device, transient: list[_Transient], what: str
) -> None:
    """Give every meta tensor of ``module`` memory on ``device`` and recompute ``transient``.

    Call :func:`check_materializable` first; afterwards every persistent tensor that was on meta
    holds garbage until the checkpoint is read into it.
    """
    tensors = list(_tensors(module))
    if all(is_meta(t) for t in tensors):
        _swapping(lambda: module.to_empty(device=device))
    else:
        _materialize_each(module, device)
    with torch.no_grad():
        for item in transient:
            buffer = item.owner._buffers[item.name]
            assert buffer is not None
            buffer.fill_(_sentinel(buffer.dtype))
        for item in {id(t.owner): t for t in transient}.values():  # once per owning module
            assert item.init is not None
            item.init(item.owner)
        stale = [t.path for t in transient if _still_sentinel(t.owner._buffers[t.name])]
    if stale:
        raise CheckpointValueError(
            f"{what}: the module was on the meta device and its non-persistent buffers "
            f"{stale[:_SHOWN]} were not recomputed by the model's _init_weights; materialise "
            "the module yourself (module.to_empty(device=...), then recompute those buffers) "
            "and restore again"
        )


def _swapping(apply: Callable[[], object]) -> None:
    """Run ``apply`` with module conversions swapping tensors (keeps parameter objects)."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        apply()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _materialize_each(module: torch.nn.Module, device: torch.device) -> None:
    """Only the meta tensors, one by one; the others keep their data."""
    done: dict[int, torch.Tensor] = {}
    for owner in module.modules():
        for param in owner._parameters.values():
            if param is not None and is_meta(param) and id(param) not in done:
                empty = torch.nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=param.requires_grad
                )
                torch.utils.swap_tensors(param, empty)
                done[id(param)] = param
        for name, buffer in owner._buffers.items():
            if buffer is not None and is_meta(buffer):
                done.setdefault(id(buffer), torch.empty_like(buffer, device=device))
                owner._buffers[name] = done[id(buffer)]


def _sentinel(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return False
    return int(torch.iinfo(dtype).min)


def _still_sentinel(buffer: torch.Tensor | None) -> bool:
    if buffer is None or buffer.numel() == 0:
        return False
    if buffer.dtype.is_floating_point or buffer.dtype.is_complex:
        return bool(torch.isnan(buffer).any())
    if buffer.dtype == torch.bool:
        return False  # no value is out of range: trust the initializer
    return bool((buffer == _sentinel(buffer.dtype)).all())
