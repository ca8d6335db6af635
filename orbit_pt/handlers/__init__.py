"""Handlers: how each item of a checkpoint is written and read back.

Pick one explicitly with ``CheckpointManager(..., handlers={"name": SomeHandler()})``; otherwise
:func:`default_handler` chooses by the item's type.
"""

from __future__ import annotations

from typing import Any

import torch

from orbit_pt._format.sharding import is_dtensor
from orbit_pt.errors import CheckpointTypeError
from orbit_pt.handlers._codec import has_state_dict, loader_hint
from orbit_pt.handlers._model_parts import parts_of
from orbit_pt.handlers.base import Handler, HandlerContext
from orbit_pt.handlers.model import ModelHandler
from orbit_pt.handlers.optimizer import OptimizerHandler
from orbit_pt.handlers.state import StateHandler

__all__ = [
    "Handler",
    "HandlerContext",
    "ModelHandler",
    "OptimizerHandler",
    "StateHandler",
    "default_handler",
    "handler_by_name",
]


def default_handler(item: Any, *, item_name: str) -> Handler:
    """The handler orbit_pt uses for ``item`` when none was configured for ``item_name``.

    A bare tensor (``{"step": torch.tensor(5)}``) is an item like a dict of tensors: the state
    handler saves it, restores it in place into a target tensor of the same shape and dtype,
    and returns it as a tensor when restored without a target.
    """
    if isinstance(item, torch.nn.Module) or parts_of(item) is not None:
        return ModelHandler()  # a module, or a list of parts of one (torchtitan's model_parts)
    if isinstance(item, torch.optim.Optimizer):
        return OptimizerHandler()
    if is_dtensor(item):
        raise CheckpointTypeError(
            f"item {item_name!r} is a DTensor, which has no default handler: save it inside "
            "its module (the model handler writes sharded tensors), or save item.full_tensor()"
        )
    if has_state_dict(item) or isinstance(item, (torch.Tensor, dict, list, tuple)):
        return StateHandler()
    hint = loader_hint(item)
    raise CheckpointTypeError(
        f"item {item_name!r} is a {type(item).__name__}, which has no default handler: "
        + (
            hint
            or "give it state_dict()/load_state_dict(), pass a dict, or configure one with "
            f"CheckpointManager(..., handlers={{{item_name!r}: YourHandler()}})"
        )
    )


def handler_by_name(name: str) -> Handler | None:
    """A fresh built-in handler registered under ``name`` (as recorded in metadata), or None."""
    factory = _BUILTIN.get(name)
    return factory() if factory is not None else None


_BUILTIN: dict[str, type[Any]] = {
    ModelHandler.name: ModelHandler,
    OptimizerHandler.name: OptimizerHandler,
    StateHandler.name: StateHandler,
}
