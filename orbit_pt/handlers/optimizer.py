"""The optimizer handler: optimizer state keyed by parameter *name*.

``optimizer.state_dict()`` keys state by the position of each parameter in the optimizer's
param groups, which changes whenever the model is built, wrapped or grouped differently. This
handler replaces each position with the parameter's canonical name in the model (the same name
the model handler saves its weight under), so a checkpoint survives a change in parameter
order, ``torch.compile``, activation checkpointing, or a different split into param groups.

On disk (in the item's folder):

- ``optimizer.safetensors``: every state tensor, named ``<parameter name>/<state key>``
  (``model.layers.0.mlp.weight/exp_avg``); tensors inside param groups (a tensor ``lr``) are
  named ``param_groups/<i>/<key>``;
- ``optimizer.msgpack``: ``{"format_version", "optimizer_class", "state", "param_groups",
  "param_shapes"}`` in the msgpack encoding the state handler uses (``handlers._codec``), with
  parameter names in each group's ``params``. ``optimizer_class`` (``torch.optim.adamw.AdamW``)
  is absent from steps written before it was recorded; their class is not checked.

Under FSDP2 the state tensors that follow their parameter's sharding (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``: DTensors) are written by every rank as its own rows of
``optimizer.safetensors``, like the model's weights; plain tensors (``step``) and the msgpack
file are written once, by rank 0. A restore rebuilds those DTensors with the live parameter's
layout, reading only this rank's rows, so the state reshards to any number of ranks.

The names come from the model saved or restored alongside the optimizer (see
:class:`OptimizerHandler`). We do not use ``torch.distributed.checkpoint.state_dict`` here: on an
optimizer that has not stepped yet, it takes a zero-learning-rate step to create the state, which
changes the optimizer being saved (Adam's ``step`` becomes 1).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from orbit_pt._format.remote_files import for_each
from orbit_pt._format.safetensors import SafetensorsReader, fits_in_place, plan_file
from orbit_pt._format.sharding import (
    Piece,
    is_dtensor,
    needs_exchange,
    piece_of,
    read_local,
    settle_union,
    stage_pieces,
    write_files,
)
from orbit_pt._format.staging import StagingPool
from orbit_pt.errors import CheckpointTypeError, CheckpointValueError
from orbit_pt.handlers._codec import (
    TensorRef,
    check_refs,
    encode,
    materialize,
    pack,
    read_optimizer_structure,
)
from orbit_pt.handlers._mismatch import class_name, load_state_dict
from orbit_pt.handlers._model_parts import as_module
from orbit_pt.handlers._optimizer_fit import Fit, fit, names_listed
from orbit_pt.handlers._optimizer_union import (
    held_elsewhere,
    merge_structures,
    unpack_structure,
)
from orbit_pt.handlers.base import HandlerContext
from orbit_pt.handlers.model import parameter_names

logger = logging.getLogger(__name__)

STRUCTURE_FILE = "optimizer.msgpack"
TENSORS_FILE = "optimizer.safetensors"
_FORMAT_VERSION = 1

Hyperparameters = Literal["auto", "live", "saved"]
_HYPERPARAMETERS = ("auto", "live", "saved")


@dataclass(frozen=True)
class _StagedOptimizer:
    """An encoded optimizer: msgpack bytes, this rank's tensor pieces by name, metadata info."""

    structure: bytes
    tensors: dict[str, Piece]
    info: dict[str, Any]


class OptimizerHandler:
    """Default handler for ``torch.optim.Optimizer``.

    The optimizer's parameters are named after the model among the items of the same
    ``save``/``restore`` call: the only ``nn.Module`` among them, or the item named
    ``model_item``.

    A restore checks, before anything is changed, that the optimizer is of the class that saved
    the state and keeps the same state per parameter (``exp_avg``, ``max_exp_avg_sq``, ...);
    then it loads the state by parameter name into whatever param groups the optimizer has
    (the saved ones split, merged or reordered).

    Args:
        model_item: the item holding the model whose parameters the optimizer updates. Needed
            only when the items hold several modules (or the model is not itself an item).
        strict: with True, the optimizer must update exactly the parameters that were saved;
            with False, it may update a subset or superset of them (frozen embeddings, an added
            head): the parameters both have are restored, the optimizer's others keep their
            current state, and both kinds are named in one warning.
        hyperparameters: whose param-group hyperparameters (``lr``, ``weight_decay``,
            ``initial_lr``, ...) the optimizer has after a restore. ``"saved"``: the
            checkpoint's, each optimizer group taking those of the saved group with the same
            parameters (an error when the groups do not correspond one to one); ``"live"``: the
            optimizer's own, untouched; ``"auto"`` (default): the checkpoint's when the groups
            correspond one to one -- so a resumed run continues its LR schedule exactly, as with
            ``Optimizer.load_state_dict`` -- otherwise the optimizer's own, logged.

    With ``async_save``, :meth:`stage` names and encodes the state and copies its tensors into
    reused host buffers; :meth:`save` writes that copy on the background thread.
    """

    name = "optimizer"
    # From an object-store root its .safetensors files are read by range (RangeReadingHandler).
    reads_by_range = True

    def __init__(
        self,
        *,
        model_item: str | None = None,
        strict: bool = True,
        hyperparameters: Hyperparameters = "auto",
    ) -> None:
        if model_item is not None and (not isinstance(model_item, str) or not model_item):
            raise CheckpointValueError(
                f"model_item must be the name of an item, got {model_item!r}"
            )
        if not isinstance(strict, bool):
            raise CheckpointTypeError(f"strict must be True or False, got {strict!r}")
        if hyperparameters not in _HYPERPARAMETERS:
            raise CheckpointValueError(
                f"hyperparameters must be one of {_HYPERPARAMETERS}, got {hyperparameters!r}; "
                "'live' keeps the optimizer's own, 'saved' takes the checkpoint's"
            )
        self.model_item = model_item
        self.strict = strict
        self.hyperparameters: Hyperparameters = hyperparameters
        self._pool = StagingPool()

    def stage(self, item: Any, context: HandlerContext) -> _StagedOptimizer:
        """Encode the state now and copy its tensors into reused host buffers."""
        staged = self._encode_state(_check_optimizer(item, "save"), context)
        tensors = stage_pieces(self._pool, staged.tensors)
        return _StagedOptimizer(staged.structure, tensors, staged.info)

    def save(self, directory: Path, item: Any, context: HandlerContext) -> Mapping[str, Any]:
        if isinstance(item, _StagedOptimizer):
            staged = item
        else:
            staged = self._encode_state(_check_optimizer(item, "save"), context)
        pieces = staged.tensors
        planned = plan_file(TENSORS_FILE, [(n, p.dtype, p.shape) for n, p in pieces.items()])
        write_files(
            directory,
            [planned],
            pieces,
            rank=context.rank,
            world_size=context.world_size,
            collective=context.collective,
            what=f"the optimizer state in {directory}",
        )
        if context.rank == 0:
            (directory / STRUCTURE_FILE).write_bytes(staged.structure)
        return staged.info

    def _encode_state(
        self, optimizer: torch.optim.Optimizer, context: HandlerContext
    ) -> _StagedOptimizer:
        names = self._names(optimizer, context, "save")
        saved = optimizer.state_dict()
        state = {names[index]: value for index, value in saved["state"].items()}
        groups = [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in saved["param_groups"]
        ]
        shapes = {
            name: list(param.shape) for name, param in zip(names, _params(optimizer), strict=True)
        }
        tensors: dict[str, torch.Tensor] = {}
        structure = {
            "format_version": _FORMAT_VERSION,
            "optimizer_class": class_name(type(optimizer)),
            "state": encode(state, "", tensors),
            "param_groups": encode(groups, "param_groups", tensors),
            "param_shapes": shapes,
        }
        info = {
            "format_version": _FORMAT_VERSION,
            "optimizer": type(optimizer).__name__,
            "optimizer_class": class_name(type(optimizer)),
            "state_keys": sorted({str(k) for per_param in state.values() for k in per_param}),
            "parameters": len(names),
            "tensors": len(tensors),
        }
        packed = pack(structure)
        pieces, stages = settle_union(  # collective: every rank settles the same item
            {name: piece_of(name, t, rank=context.rank) for name, t in tensors.items()},
            rank=context.rank,
            world_size=context.world_size,
            collective=context.collective,
            what=f"the optimizer state of step {context.step}",
            extra=base64.b64encode(packed).decode(),
            in_place=context.shared_files,
        )
        if stages:  # rank 0, and the ranks hold different parameters (pipeline stages)
            packed = merge_structures([base64.b64decode(text) for text in stages])
            info = {**info, "parameters": len(unpack_structure(packed)["param_shapes"])}
            info["tensors"] = len(pieces)
        return _StagedOptimizer(packed, pieces, info)

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        structure = read_optimizer_structure(directory / STRUCTURE_FILE)  # layout checked
        reader = SafetensorsReader(directory / TENSORS_FILE)
        check_refs(structure, reader, STRUCTURE_FILE)
        if target is None:
            return {
                "state": materialize(structure["state"], reader),
                "param_groups": materialize(structure["param_groups"], reader),
            }
        optimizer = _check_optimizer(target, "restore")
        names = self._names(optimizer, context, "restore")
        # Every check happens here, before the first tensor is read into the optimizer.
        plan = held_elsewhere(
            lambda unexpected_ok: fit(
                structure,
                optimizer,
                names,
                strict=self.strict,
                hyperparameters=self.hyperparameters,
                item=_item_name(context, optimizer),
                directory=directory,
                unexpected_ok=unexpected_ok,
            ),
            context,
            label=f"planning the restore of {directory.name}",
            strict=self.strict,
            item=_item_name(context, optimizer),
            directory=directory,
        )
        _log_plan(plan, context.step, directory)
        params = _params(optimizer)
        saved_state = structure["state"]
        state: dict[int, Any] = {}
        pairs = list(zip(names, params, strict=True))

        def read(position: int) -> None:
            name, param = pairs[position]
            current = optimizer.state.get(param, {})
            if name in saved_state:
                state[position] = _materialize_like(saved_state[name], reader, param, current)
            elif name in plan.missing and current:
                state[position] = current  # not in the checkpoint: left as it is

        # By ranged requests (object storage), several parameters' state at once -- unless a
        # layout moves rows between ranks, which must happen in the same order on every rank.
        moves = any(needs_exchange(param, remote=reader.is_remote) for _, param in pairs)
        for_each(range(len(pairs)), read, remote=reader.is_remote and not moves)
        state = dict(sorted(state.items()))
        live_groups = list(optimizer.param_groups)
        groups = []
        start = 0
        # Positions in the *current* order: torch pairs the state's and the live params by them.
        for group, saved_group in zip(live_groups, plan.hyperparameters, strict=True):
            count = len(group["params"])
            hyper = _hyper(group) if saved_group is None else materialize(saved_group, reader)
            groups.append({**hyper, "params": list(range(start, start + count))})
            start += count
        load_state_dict(optimizer, {"state": state, "param_groups": groups}, directory)
        if all(saved_group is None for saved_group in plan.hyperparameters):
            # The live hyperparameters, as the very objects the optimizer had: load_state_dict
            # deep-copies groups, which would give a tensor lr (or any value held elsewhere,
            # such as by a compiled step) a new identity.
            optimizer.param_groups[:] = live_groups
        return optimizer

    def _names(
        self, optimizer: torch.optim.Optimizer, context: HandlerContext, action: str
    ) -> list[str]:
        """The canonical name of every optimizer parameter, in param-group order."""
        model = self._model(context, action)
        by_id = parameter_names(model)
        names: list[str] = []
        unknown: list[str] = []
        for group_index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                name = by_id.get(id(param))
                if name is None:
                    unknown.append(f"group {group_index}: {list(param.shape)}")
                else:
                    names.append(name)
        if unknown:
            raise CheckpointValueError(
                f"the optimizer updates {len(unknown)} parameter(s) that are not parameters of "
                f"the model it was paired with (shapes {unknown[:5]}); build the optimizer from "
                "that model's parameters, or pass OptimizerHandler(model_item=...) naming the "
                "model item that owns them"
            )
        if len(set(names)) != len(names):
            raise CheckpointValueError(
                "the optimizer lists the same parameter twice across its param groups; "
                "each parameter must be in exactly one group"
            )
        return names

    def _model(self, context: HandlerContext, action: str) -> torch.nn.Module:
        items = context.items
        if self.model_item is not None:
            if self.model_item not in items:
                raise CheckpointValueError(
                    f"OptimizerHandler(model_item={self.model_item!r}) but the items to {action} "
                    f"are {sorted(items)}; include the model under that name"
                )
            model = as_module(items[self.model_item])
            if model is None:
                raise CheckpointTypeError(
                    f"OptimizerHandler needs item {self.model_item!r} as a live torch.nn.Module "
                    "(or a list of model parts) to name the optimizer's parameters, got "
                    f"{type(items[self.model_item]).__name__}; pass the model object in the "
                    f"items of {action}()"
                )
            return model
        modules = [name for name, value in items.items() if as_module(value) is not None]
        if len(modules) == 1:
            only = as_module(items[modules[0]])
            assert only is not None
            return only
        found = f"several ({modules})" if modules else "none"
        raise CheckpointValueError(
            f"the optimizer handler names optimizer state after the model's parameters, so the "
            f"items to {action} must hold exactly one torch.nn.Module; they hold {found}. Pass "
            "the model alongside the optimizer (e.g. {'model': model, 'optimizer': opt}), or "
            "configure CheckpointManager(..., handlers={'optimizer': "
            "OptimizerHandler(model_item='model')})"
        )


def _log_plan(plan: Fit, step: int, directory: Path) -> None:
    if plan.missing or plan.unexpected:
        logger.warning(
            "step %d, %s: restored the optimizer state of the parameters the checkpoint and the "
            "optimizer share (strict=False); %d optimizer parameter(s) have no saved state and "
            "keep their current state: %s; %d saved parameter(s) are not in the optimizer and "
            "were skipped: %s",
            step,
            directory,
            len(plan.missing),
            names_listed(plan.missing),
            len(plan.unexpected),
            names_listed(plan.unexpected),
        )
    if plan.kept_live_because:
        logger.info(
            "step %d, %s: the optimizer's param groups do not correspond one to one to the "
            "checkpoint's (%s), so the optimizer keeps its own hyperparameters; pass "
            "OptimizerHandler(hyperparameters='live') to always keep them",
            step,
            directory,
            plan.kept_live_because,
        )


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """A live param group's hyperparameters: everything but its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def _item_name(context: HandlerContext, optimizer: torch.optim.Optimizer) -> str:
    """The name the optimizer has among the items (for messages), "optimizer" if none."""
    return next((name for name, v in context.items.items() if v is optimizer), "optimizer")


def _materialize_like(
    value: Any, reader: SafetensorsReader, param: Any, existing: Mapping[Any, Any]
) -> Any:
    """One parameter's saved state, read into the optimizer's own tensors where it can be.

    A resumed optimizer usually already holds state of the right shapes (it was built and
    stepped, or restored before): reading straight into those tensors, which load_state_dict
    then keeps as they are, makes the restore cost no memory beyond the state itself. Tensors
    shaped like a DTensor ``param`` are read as this rank's rows only and laid out like it.
    """
    if not isinstance(value, Mapping):
        return materialize(value, reader)
    out: dict[Any, Any] = {}
    for key, sub in value.items():
        if not isinstance(sub, TensorRef) or sub.as_numpy:
            out[key] = materialize(sub, reader)
            continue
        entry = reader.entries[sub.name]
        current = existing.get(key)
        sharded = is_dtensor(param) and param.ndim > 0 and entry.shape == tuple(param.shape)
        if sharded:
            out[key] = _read_sharded(reader, sub.name, param, current)
        elif (
            isinstance(current, torch.Tensor)
            and not is_dtensor(current)
            and fits_in_place(current, entry.dtype, entry.shape)
        ):
            with torch.no_grad():
                out[key] = reader.read(sub.name, out=current)
        else:
            out[key] = reader.read(sub.name)
    return out


def _read_sharded(reader: SafetensorsReader, name: str, param: Any, current: Any) -> Any:
    """This rank's rows of ``name`` as a DTensor laid out like ``param``."""
    from torch.distributed.tensor import DTensor

    local = current.to_local() if is_dtensor(current) else None
    if (
        local is not None
        and current.placements == param.placements
        and current.shape == param.shape  # the same layout, so the same local shape
        and fits_in_place(local, reader.entries[name].dtype, local.shape)
    ):
        read_local(reader, name, param, out=local)
        return current
    local = read_local(reader, name, param, out=None)
    return DTensor.from_local(
        local.to(param.to_local().device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _check_optimizer(item: Any, action: str) -> torch.optim.Optimizer:
    if not isinstance(item, torch.optim.Optimizer):
        raise CheckpointTypeError(
            f"OptimizerHandler can only {action} a torch.optim.Optimizer, got {type(item).__name__}"
        )
    return item
