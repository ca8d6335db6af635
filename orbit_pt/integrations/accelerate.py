"""Accelerate: save and restore everything an ``Accelerator`` prepared, as one orbit_pt step.

``accelerator.save_state`` / ``load_state`` pickle the optimizer, scheduler, sampler and RNG
states, restore the RNG before the data loader draws its seed (a resumed run drifts), and with
``total_limit`` delete old folders before the new one is written. These two functions do the
same job through a :class:`~orbit_pt.CheckpointManager`::

    from orbit_pt.integrations import accelerate as orbit

    config = DataLoaderConfiguration(use_stateful_dataloader=True)  # loaders resume mid-epoch
    accelerator = Accelerator(dataloader_config=config)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    mgr = CheckpointManager("ckpt", options=orbit.options_from_project_config(accelerator))
    step = orbit.load_state(accelerator, mgr) or 0   # the step restored; None on an empty root
    while step < total_steps:
        for batch in loader:                          # goes on where the saved run was
            ...
            step += 1
            orbit.save_state(accelerator, mgr, step)  # when mgr.should_save(step)

What one step holds (item names as Accelerate numbers its files):

- ``model``, ``model_1``, ...: each prepared model, as orbit_pt saves a module (a Hugging Face
  folder for a ``transformers`` model; DDP wrappers unwrapped; FSDP2 shards without gathering);
- ``optimizer``, ``optimizer_1``, ...: each prepared optimizer;
- ``recipe``: a :class:`~orbit_pt.RecipeState` with the training ``step``, the RNG of every
  generator, ``accelerator.step`` (the gradient-accumulation counter), and each prepared
  scheduler (``scheduler``, ``scheduler_1``, ...), data loader (``dataloader``, ...), object
  given to ``register_for_checkpointing`` (``custom``, ``custom_1``, ...) and the grad scaler
  (``scaler``), each through its ``state_dict()``. The loaders' positions are restored before
  the generators, so a resumed run draws what the uninterrupted one did.

Every file is safetensors, JSON or msgpack; nothing is pickled.

The shuffle resumes exactly when its order can be drawn again (measured with accelerate 1.16,
torchdata 0.11): in one process with a ``StatefulDataLoader(shuffle=True)`` (torchdata's
sampler saves its generator); across ranks with ``sampler=torch.utils.data.RandomSampler(...)``
and ``DataLoaderConfiguration(use_seedable_sampler=True)`` (the order follows the epoch
number, which orbit_pt saves). Across ranks with ``shuffle=True`` it does not (Accelerate
shards the batch sampler, which torchdata cannot save): :func:`save_state` warns once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from orbit_pt._control.collective import AgreedError, PeerError
from orbit_pt.errors import (
    CheckpointError,
    CheckpointSaveError,
    CheckpointTypeError,
    StateMismatchError,
)
from orbit_pt.manager import CheckpointManager
from orbit_pt.options import CheckpointManagerOptions
from orbit_pt.recipe import RecipeState, RNGState

RECIPE = "recipe"

logger = logging.getLogger(__name__)
_warned: set[int] = set()

__all__ = ["load_state", "options_from_project_config", "save_state"]


def save_state(
    accelerator: Any,
    mgr: CheckpointManager,
    step: int,
    metrics: Mapping[str, float] | None = None,
    *,
    force: bool = False,
) -> bool:
    """Save what ``accelerator`` prepared as step ``step`` of ``mgr`` (every rank calls it).

    As :meth:`CheckpointManager.save <orbit_pt.CheckpointManager.save>`: without ``force`` the
    step is saved only when ``mgr.should_save(step)`` (its ``save_interval_steps``, or a
    preemption); ``metrics`` feed best-n retention.

    Returns:
        Whether a save was started.

    Raises:
        CheckpointTypeError: a prepared data loader is not stateful (its position could not
            be saved): build the Accelerator with
            ``DataLoaderConfiguration(use_stateful_dataloader=True)``. Under
            torch.distributed, when that is so on any rank, every rank raises a
            ``CheckpointSaveError`` naming the rank and this cause; nothing is written.
        CheckpointSaveError: as ``CheckpointManager.save``.
    """
    if not force and not mgr.should_save(step):  # asked again inside save(): the same answer
        return False
    try:
        _agree_on_loaders(accelerator, mgr, f"the save of step {step}")
    except (AgreedError, PeerError) as exc:
        raise CheckpointSaveError(step, mgr.directory, str(exc)) from exc
    return mgr.save(step, _items(accelerator, step), metrics=metrics, force=force)


def load_state(
    accelerator: Any,
    mgr: CheckpointManager,
    step: int | None = None,
    *,
    exclude: Sequence[str] = (),
) -> int | None:
    """Restore step ``step`` of ``mgr`` (default: the latest) into what ``accelerator`` prepared.

    Prepare the same models, optimizers, schedulers and loaders, and register the same objects,
    as the run that saved it, before calling this (every rank calls it).

    ``exclude`` leaves parts of the step out, as :meth:`CheckpointManager.restore`'s: on another
    number of ranks than saved the step, the per-rank parts must be --
    ``exclude=("recipe.rng", "recipe.dataloader")`` (fresh RNG seeds, the loader starting its
    data over; the models and optimizers are resharded). Such a resume is not exact.

    Returns:
        The training step restored (the ``step`` given to :func:`save_state`), or None when
        ``step`` is None and ``mgr`` holds no step yet (a fresh run).

    Raises:
        StepNotFoundError: ``step`` is not a committed step of ``mgr``; the message names the
            steps it holds.
        ItemNotFoundError, StateMismatchError: the step holds other items or objects than
            this accelerator prepared.
        CheckpointTypeError: a prepared data loader is not stateful (as in
            :func:`save_state`; under torch.distributed every rank raises a
            ``CheckpointError`` naming the rank and this cause).
    """
    if step is None:
        step = mgr.latest_step()
        if step is None:
            return None
    _agree_on_loaders(accelerator, mgr, f"the restore of step {step}")
    items = _items(accelerator, step)
    try:
        mgr.restore(step, items, exclude=exclude)
    except CheckpointError as exc:
        excludable = _excludable(exc)
        if excludable is None:
            raise
        spelled = ", ".join(f'"{name}"' for name in excludable)
        raise StateMismatchError(
            f"{exc}\nWith Accelerate: orbit_pt.integrations.accelerate.load_state(accelerator, "
            f"mgr, exclude=({spelled}{',' if len(excludable) == 1 else ''}))"
        ) from exc
    recipe = items[RECIPE]
    accelerator.step = int(recipe.accelerator_step)
    return int(recipe.step)


def _excludable(error: BaseException) -> tuple[str, ...] | None:
    """The ``exclude=`` that a per-rank-state error (or the agreed error it caused) asks for."""
    seen: BaseException | None = error
    while seen is not None:
        names = getattr(seen, "excludable", None)
        if names is not None:
            return tuple(names)
        seen = seen.__cause__
    return None


def options_from_project_config(accelerator: Any, **overrides: Any) -> CheckpointManagerOptions:
    """:class:`~orbit_pt.CheckpointManagerOptions` following ``accelerator``'s
    ``ProjectConfiguration``: its ``total_limit`` becomes ``keep_last_n`` (the newest n steps,
    as Accelerate keeps the newest n folders -- but deleted only after the new step is
    committed). ``overrides`` are further options (``save_interval_steps=``, ...) and win."""
    fields: dict[str, Any] = {}
    total_limit = getattr(accelerator.project_configuration, "total_limit", None)
    if total_limit is not None:
        fields["keep_last_n"] = total_limit
    fields.update(overrides)
    return CheckpointManagerOptions(**fields)


def _items(accelerator: Any, step: int) -> dict[str, Any]:
    """The step's items: the prepared models and optimizers, and one recipe for the rest."""
    items: dict[str, Any] = {}
    for index, model in enumerate(accelerator._models):
        items[_numbered("model", index)] = model
    for index, optimizer in enumerate(accelerator._optimizers):
        items[_numbered("optimizer", index)] = optimizer
    fields: dict[str, Any] = {}
    for index, scheduler in enumerate(accelerator._schedulers):
        fields[_numbered("scheduler", index)] = scheduler
    for index, loader in enumerate(accelerator._dataloaders):
        fields[_numbered("dataloader", index)] = loader
    for index, obj in enumerate(accelerator._custom_objects):
        fields[_numbered("custom", index)] = obj
    if accelerator.scaler is not None:
        fields["scaler"] = accelerator.scaler
    items[RECIPE] = RecipeState(
        step=step, rng=RNGState(), accelerator_step=int(accelerator.step), **fields
    )
    return items


def _agree_on_loaders(accelerator: Any, mgr: CheckpointManager, before: str) -> None:
    """:func:`_check_loaders` on every rank, agreed: a loader that cannot be saved on one rank
    fails every rank at once (raised on that rank alone, it would leave the others waiting in
    the manager's first agreement until ``agreement_timeout``). On one process its
    ``CheckpointTypeError`` is raised as it is."""
    # The manager's control group: the agreement that its save or restore would start with.
    mgr._dist.agree(
        "orbit_pt.accelerate.loaders",
        lambda: _check_loaders(accelerator),
        label=f"checking the data loaders before {before}",
    )


def _check_loaders(accelerator: Any) -> None:
    """Refuse a prepared loader whose position cannot be saved; warn about a lost shuffle."""
    for index, loader in enumerate(accelerator._dataloaders):
        _check_stateful(loader, index)
        if accelerator.num_processes > 1:
            _warn_if_shuffle_is_lost(loader, index)


def _numbered(kind: str, index: int) -> str:
    """``model``, ``model_1``, ...: as Accelerate numbers the files of a second model."""
    return kind if index == 0 else f"{kind}_{index}"


def _check_stateful(loader: Any, index: int) -> None:
    inner = getattr(loader, "base_dataloader", loader)
    if not (
        callable(getattr(inner, "state_dict", None))
        and callable(getattr(inner, "load_state_dict", None))
    ):
        raise CheckpointTypeError(
            f"prepared data loader {index} ({type(inner).__name__}) has no state to save, so a "
            "resumed run would start its data over: build the Accelerator with "
            "dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True) (the "
            "loader then resumes at its position), or do not prepare() the loader"
        )


def _warn_if_shuffle_is_lost(loader: Any, index: int) -> None:
    """Warn (once per loader) when a distributed resume cannot redraw this epoch's shuffle.

    Distributed, Accelerate shards the batch sampler (``BatchSamplerShard``), which torchdata
    cannot save; a resumed loader skips the batches already seen in a permutation drawn
    anew. A sampler seeded by its epoch (Accelerate's ``SeedableRandomSampler``, whose epoch
    orbit_pt saves) draws the same one again; a sampler that draws from a generator (torchdata's
    ``RandomSampler``, ``shuffle=True``) does not: the generator's state at the start of the
    epoch is recorded nowhere.
    """
    sampler = _innermost_sampler(loader)
    if sampler is None or id(loader) in _warned:
        return
    if getattr(sampler, "generator", None) is not None and not hasattr(sampler, "set_epoch"):
        _warned.add(id(loader))
        logger.warning(
            "prepared data loader %d shuffles with %s from a generator whose state at the start "
            "of each epoch nobody saves, so a resumed distributed run will see other batches "
            "than the uninterrupted one. For an exact resume, give the loader "
            "sampler=torch.utils.data.RandomSampler(dataset) and build the Accelerator with "
            "DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)",
            index,
            type(sampler).__name__,
        )


def _innermost_sampler(loader: Any) -> Any:
    inner = getattr(loader, "base_dataloader", loader)
    batch_sampler: Any = getattr(inner, "batch_sampler", None)
    while (wrapped := getattr(batch_sampler, "batch_sampler", None)) is not None:
        batch_sampler = wrapped  # BatchSamplerShard around the loader's own batch sampler
    return getattr(batch_sampler, "sampler", None)
