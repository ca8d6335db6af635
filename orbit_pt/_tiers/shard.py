"""One rank's share of its items, as the node-local tier keeps it.

A local shard holds what this rank holds, nothing gathered: a module's ``state_dict()`` and an
optimizer's with every DTensor replaced by its local tensor, and any other item's state as the
state handler saves it. Each item is written in the state handler's format (``state.msgpack``
plus ``tensors.safetensors``, no pickle); each DTensor's global shape and offset are recorded
in the shard's marker, and a restore checks them against the live DTensor before anything is
loaded -- so a shard is only ever loaded into the mesh position it came from.

Loading is in place: module tensors are copied into the live parameters and buffers (a DTensor
into its local shard); optimizer state is rebuilt as DTensors on the live parameters' meshes and
given to ``load_state_dict``; other items go through the state handler's restore.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from orbit_pt._format.sharding import is_dtensor
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError, StateMismatchError
from orbit_pt.handlers._mismatch import load_state_dict, raise_mismatches
from orbit_pt.handlers._model_parts import as_module
from orbit_pt.handlers.base import HandlerContext
from orbit_pt.handlers.state import StateHandler

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]

MODULE, OPTIMIZER, STATE = "module", "optimizer", "state"
KINDS = (MODULE, OPTIMIZER, STATE)


@dataclass
class Captured:
    """An item's state as this rank holds it, ready for the state handler's writer.

    Attributes:
        kind: ``module``, ``optimizer`` or ``state``.
        state: the plain state (a module's: name -> tensor); for ``state`` items, the item.
        sharded: where each DTensor was (a key path into ``state``) -> its global shape and this
            rank's offset in it, as JSON.
    """

    kind: str
    state: Any
    sharded: dict[str, dict[str, list[int]]] = field(default_factory=dict)


def kind_of(item: Any) -> str:
    if as_module(item) is not None:  # a module, or a list of model parts (their union)
        return MODULE
    if isinstance(item, torch.optim.Optimizer):
        return OPTIMIZER
    return STATE


def capture(name: str, item: Any) -> Captured:
    """This rank's state of ``item`` (still the item's own tensors: stage it to keep it)."""
    kind = kind_of(item)
    if kind == MODULE:
        with torch.no_grad():
            state = dict(_module(item).state_dict())
        sharded: dict[str, dict[str, list[int]]] = {}
        for key, value in state.items():
            if is_dtensor(value):
                state[key], sharded[key] = _localize(value)
            elif isinstance(value, torch.Tensor) and value.is_meta:
                raise CheckpointValueError(
                    f"item {name!r}: tensor {key!r} is on the meta device; the local tier saves "
                    "materialized models only"
                )
        return Captured(kind, state, sharded)
    if kind == OPTIMIZER:
        full = item.state_dict()
        sharded = {}
        state_out: dict[Any, Any] = {}
        for index, entry in full["state"].items():
            converted = {}
            for key, value in entry.items():
                if is_dtensor(value):
                    converted[key], sharded[f"{index}/{key}"] = _localize(value)
                else:
                    converted[key] = value
            state_out[index] = converted
        return Captured(kind, {"state": state_out, "param_groups": full["param_groups"]}, sharded)
    _refuse_dtensors(name, item.state_dict() if hasattr(item, "state_dict") else item, "")
    return Captured(kind, item)


def load(
    name: str,
    kind: str,
    directory: Path,
    sharded: Mapping[str, Mapping[str, list[int]]],
    target: Any,
    context: HandlerContext,
) -> Any:
    """Load the item saved in ``directory`` into ``target`` (None: return its saved state).

    Raises:
        StateMismatchError: the target does not fit (keys, shapes, dtypes, or a DTensor whose
            global shape or offset differs from the saved shard's: another mesh).
    """
    handler = StateHandler()
    if kind == STATE:
        return handler.restore(directory, target, context)
    saved = handler.restore(directory, None, HandlerContext(step=context.step))
    if target is None:
        return saved
    if kind == MODULE:
        _load_module(name, saved, sharded, _module(target), directory)
    else:
        _load_optimizer(name, saved, sharded, target, directory)
    return target


def check_target(name: str, kind: str, target: Any) -> None:
    """Refuse a live target of another kind than the saved item (before anything is loaded)."""
    if target is None:
        return
    if kind != kind_of(target):
        raise StateMismatchError(
            f"item {name!r} was saved to the local tier as a {kind}, but the live object is a "
            f"{type(target).__name__}"
        )
    module = _module(target) if kind == MODULE else None
    if module is not None and any(
        (t.to_local() if is_dtensor(t) else t).is_meta  # type: ignore[attr-defined]
        for t in (*module.parameters(), *module.buffers())
    ):
        # A local shard is copied into live tensors; a meta model is materialized by the
        # persistent tier's restore, which restore(None) then falls back to.
        raise StateMismatchError(
            f"item {name!r}: the live module has tensors on the meta device; a local step loads "
            "into a materialized module only (restore a persistent step to materialize it)"
        )


def _module(item: Any) -> torch.nn.Module:
    module = as_module(item)
    assert module is not None, "kind_of said MODULE"
    return module


def _localize(tensor: Any) -> tuple[torch.Tensor, dict[str, list[int]]]:
    local = tensor.to_local().detach()
    shape = list(tensor.shape)
    _, offset = compute_local_shape_and_global_offset(
        tuple(tensor.shape), tensor.device_mesh, tuple(tensor.placements)
    )
    return local, {"shape": shape, "offset": [int(o) for o in offset]}


def _spec_problem(key: str, live: Any, spec: Mapping[str, list[int]] | None) -> str | None:
    """Why the saved shard at ``key`` cannot go into ``live``, or None."""
    if spec is None:
        if is_dtensor(live):
            return f"{key}: saved as a plain tensor, the live one is a DTensor"
        return None
    if not is_dtensor(live):
        return f"{key}: saved as a DTensor shard, the live one is a plain tensor"
    _, offset = compute_local_shape_and_global_offset(
        tuple(live.shape), live.device_mesh, tuple(live.placements)
    )
    here = {"shape": list(live.shape), "offset": [int(o) for o in offset]}
    if here != {"shape": list(spec["shape"]), "offset": list(spec["offset"])}:
        return (
            f"{key}: saved shard of global shape {spec['shape']} at offset {spec['offset']}, "
            f"this rank holds shape {here['shape']} at offset {here['offset']} (another mesh)"
        )
    return None


def _load_module(
    name: str,
    saved: Mapping[str, Any],
    sharded: Mapping[str, Mapping[str, list[int]]],
    module: torch.nn.Module,
    directory: Path,
) -> None:
    live = module.state_dict()
    problems = [f"{key}: missing from the live module" for key in saved if key not in live]
    problems += [f"{key}: not in the saved shard" for key in live if key not in saved]
    for key, value in saved.items():
        if key not in live:
            continue
        target = live[key]
        if not isinstance(target, torch.Tensor):
            continue
        problem = _spec_problem(key, target, sharded.get(key))
        if problem is None:
            local = target.to_local() if is_dtensor(target) else target  # type: ignore[attr-defined]
            if local.is_meta:
                problem = f"{key}: the live tensor is on the meta device (materialize it first)"
            elif tuple(local.shape) != tuple(value.shape) or local.dtype != value.dtype:
                problem = (
                    f"{key}: saved {value.dtype} {list(value.shape)}, live {local.dtype} "
                    f"{list(local.shape)}"
                )
        if problem:
            problems.append(problem)
    raise_mismatches(
        problems,
        f"item {name!r} of the local shard in {directory} does not fit the live module "
        f"({len(problems)} problem(s))",
    )
    with torch.no_grad():
        for key, value in saved.items():
            target = live[key]
            if isinstance(target, torch.Tensor):
                local = target.to_local() if is_dtensor(target) else target  # type: ignore[attr-defined]
                local.copy_(value)


def _load_optimizer(
    name: str,
    saved: Mapping[str, Any],
    sharded: Mapping[str, Mapping[str, list[int]]],
    optimizer: torch.optim.Optimizer,
    directory: Path,
) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    problems: list[str] = []
    state: dict[Any, Any] = {}
    for index, entry in saved["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            problems.append(f"state of parameter {index!r}: the live optimizer has {len(params)}")
            continue
        param = params[index]
        rebuilt = {}
        for key, value in entry.items():
            spec = sharded.get(f"{index}/{key}")
            if spec is None:
                rebuilt[key] = value
                continue
            problem = _spec_problem(f"state {index}.{key}", param, spec)
            if problem is not None:
                problems.append(problem)
                continue
            rebuilt[key] = DTensor.from_local(
                value.to(param.device),
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        state[index] = rebuilt
    raise_mismatches(
        problems,
        f"item {name!r} of the local shard in {directory} does not fit the live optimizer "
        f"({len(problems)} problem(s))",
    )
    load_state_dict(optimizer, {"state": state, "param_groups": saved["param_groups"]}, directory)


def _refuse_dtensors(name: str, value: Any, path: str) -> None:
    if is_dtensor(value):
        raise CheckpointTypeError(
            f"item {name!r} holds a DTensor at {path or '<root>'}; the local tier keeps DTensors "
            "of modules and optimizers only -- save this item's state as plain tensors"
        )
    if isinstance(value, Mapping):
        for key, sub in value.items():
            _refuse_dtensors(name, sub, f"{path}/{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, sub in enumerate(value):
            _refuse_dtensors(name, sub, f"{path}/{i}" if path else str(i))
