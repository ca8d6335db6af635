"""Hugging Face ``Trainer``: its checkpoints written and resumed by orbit_pt, with no pickle.

``OrbitTrainer`` is a ``transformers.Trainer``; ``OrbitTrainerMixin`` goes in front of a
``Trainer`` subclass a user already has (``class T(OrbitTrainerMixin, SFTTrainer)``). Wherever
the ``Trainer`` would write a ``checkpoint-N`` folder (``save_steps``, ``save_strategy``), step
N is saved through ``trainer.checkpoint_manager`` instead, rooted at ``<output_dir>/orbit``
unless ``orbit_dir=`` says otherwise. A step holds:

- ``model/``: the Hugging Face folder (``from_pretrained`` loads it);
- ``optimizer/`` (unless ``save_only_model``);
- ``recipe/``: the LR scheduler, the grad scaler and the RNG of every generator, as msgpack;
- ``trainer_state/trainer_state.json``: the ``TrainerState``, as the Trainer writes it, and
  ``trainer_state/training_args.json``: the ``TrainingArguments`` (JSON, not
  ``training_args.bin``).

``train(resume_from_checkpoint=True | step | path of a step folder)`` resumes from it, with
the Trainer's own resume logic (its data fast-forward, and the RNG restored when it restores
it), so the resumed run is the one that never stopped. ``save_total_limit`` keeps what the
Trainer keeps (:class:`KeepTotalWithBest`: n steps in all, the best and the newest protected),
deleted after the new step has committed; ``load_best_model_at_end`` loads the best step's
model. Preemption (SIGTERM) belongs to the Trainer: the manager's own watcher is off.

The ``Trainer`` has no public hooks for this, so this module overrides these of its private
methods, and no others: ``_save_checkpoint``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state`` and
``_load_best_model``. Tested with transformers 5 (``tests/test_integration_hf.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orbit_pt._storage import layout as _layout
from orbit_pt.errors import CheckpointError, CheckpointValueError, StepNotFoundError
from orbit_pt.handlers.base import HandlerContext
from orbit_pt.integrations._world import RNG_LEFT_OUT, saved_by_this_world
from orbit_pt.manager import CheckpointManager
from orbit_pt.options import CheckpointManagerOptions
from orbit_pt.policies import CheckpointInfo
from orbit_pt.recipe import RecipeState, RNGState

# and OrbitTrainer, made on first use (see __getattr__ at the end)
__all__ = ["KeepTotalWithBest", "OrbitTrainerMixin", "options_from_training_args"]

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state"
TRAINER_STATE_FILE = "trainer_state.json"
TRAINING_ARGS_FILE = "training_args.json"


@dataclass(frozen=True)
class KeepTotalWithBest:
    """The Trainer's ``save_total_limit``: ``limit`` steps in all, the newest ones, except that
    the best (by ``metric``, the earliest of equals, as the Trainer tracks it) is kept in place
    of the second newest. With ``limit=1`` and a best that is not the newest, two are kept."""

    limit: int
    metric: str | None = None
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise CheckpointValueError(f"save_total_limit must be an int >= 1, got {self.limit!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        order = [c.step for c in sorted(checkpoints, key=lambda c: c.step)]
        best = self._best(checkpoints)
        limit = self.limit
        if best is not None and best != order[-1]:
            limit = max(limit, 2)
            index = order.index(best)  # moved to the second newest place
            order = [*order[:index], *order[index + 1 : -1], best, order[-1]]
        return set(order[-limit:])

    def _best(self, checkpoints: Sequence[CheckpointInfo]) -> int | None:
        if self.metric is None:
            return None
        metric = self.metric
        ranked = [c for c in checkpoints if metric in c.metrics]
        if not ranked:
            return None
        sign = -1.0 if self.mode == "max" else 1.0
        return min(ranked, key=lambda c: (sign * c.metrics[metric], c.step)).step


def options_from_training_args(args: Any, **overrides: Any) -> CheckpointManagerOptions:
    """Options that follow ``TrainingArguments``: the Trainer decides when to save (no cadence
    here) and owns SIGTERM; ``save_total_limit`` becomes :class:`KeepTotalWithBest`;
    ``metric_for_best_model``/``greater_is_better`` rank the steps (``best_step()``)."""
    fields: dict[str, Any] = {"preemption_signals": ()}
    metric = _metric_name(args)
    mode: Literal["min", "max"] = "max" if args.greater_is_better else "min"
    if metric is not None:
        fields.update(best_metric=metric, best_mode=mode)
    if args.save_total_limit is not None:
        fields["retention"] = KeepTotalWithBest(args.save_total_limit, metric, mode)
    fields.update(overrides)
    return CheckpointManagerOptions(**fields)


@dataclass(frozen=True)
class TrainerFiles:
    """The Trainer's own records of one step, as JSON text (a snapshot: async saves keep it).

    Attributes:
        state: ``trainer_state.json``, as ``TrainerState.save_to_json`` writes it.
        args: ``training_args.json``: the ``TrainingArguments`` (``to_json_string()``), where
            the Trainer pickles ``training_args.bin``.
    """

    state: str
    args: str


class _TrainerStateHandler:
    """``trainer_state.json`` and ``training_args.json`` of a step (written by rank 0)."""

    name = "orbit_pt.hf.trainer_state"

    def stage(self, item: Any, context: HandlerContext) -> TrainerFiles:
        assert isinstance(item, TrainerFiles)
        return item  # already a snapshot

    def save(self, directory: Path, item: Any, context: HandlerContext) -> Mapping[str, Any]:
        def write() -> None:
            if context.rank == 0:
                (directory / TRAINER_STATE_FILE).write_text(item.state)
                (directory / TRAINING_ARGS_FILE).write_text(item.args)

        if context.collective is None:
            write()
        else:  # the files are there before any rank goes on; a failed write fails every rank
            context.collective.run_everywhere("orbit_pt.hf.trainer_state", write)
        return {"format_version": 1}

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        from transformers import TrainerState

        return TrainerState.load_from_json(str(directory / TRAINER_STATE_FILE))


class OrbitTrainerMixin:
    """Put in front of a ``transformers.Trainer`` (sub)class: see the module's docstring.

    Call ``trainer.checkpoint_manager.close()`` when done with the trainer (it waits for a
    save in flight, and ends the manager's threads and its gloo group before the process
    exits).

    Args:
        orbit_dir: the checkpoint root (a folder, or an ``s3://`` URL); default
            ``<output_dir>/orbit``.
        orbit_options: the manager's options; default :func:`options_from_training_args`.
        storage_options: for an object-store root.
    """

    checkpoint_manager: CheckpointManager

    def __init__(
        self,
        *args: Any,
        orbit_dir: str | os.PathLike[str] | None = None,
        orbit_options: CheckpointManagerOptions | None = None,
        storage_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        trainer: Any = self
        root = orbit_dir if orbit_dir is not None else Path(trainer.args.output_dir) / "orbit"
        self.checkpoint_manager = CheckpointManager(
            root,
            options=orbit_options or options_from_training_args(trainer.args),
            handlers={TRAINER_STATE: _TrainerStateHandler()},
            storage_options=storage_options,
        )

    # --------------------------------------------------------------------------- resuming

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` is True (the latest step), a step
        number, or the path of a step folder (or of a folder inside it) of the manager's root.

        Raises:
            StepNotFoundError: True on a root with no committed step, or a step it lacks.
            CheckpointError: a path that is not a step folder of this root.
        """
        resume = self._orbit_resume_path(resume_from_checkpoint)
        try:
            result = super().train(resume, *args, **kwargs)  # type: ignore[misc]
        except BaseException:
            try:  # the training error is the one to raise; a save failing as well is logged
                self.checkpoint_manager.wait_until_finished()
            except Exception:
                logger.exception("an async save failed too, after training failed")
            raise
        # An async save of the last step is durable before train() returns (the process may
        # exit next); a failed one is raised here.
        self.checkpoint_manager.wait_until_finished()
        return result

    def _orbit_resume_path(self, resume: Any) -> str | None:
        mgr = self.checkpoint_manager
        if resume is None or resume is False:
            return None
        if resume is True:
            step = mgr.latest_step()
            if step is None:  # "no committed checkpoint under <root> yet"
                raise StepNotFoundError(None, mgr.directory, [])
        elif isinstance(resume, int):
            step = resume
            mgr.step_dir(step)  # StepNotFoundError naming the steps there are
        else:
            step = self._orbit_step_of(resume)
        return str(mgr.step_dir(step) / TRAINER_STATE)

    def _orbit_step_of(self, path: Any) -> int:
        """The step whose folder ``path`` is (or is inside), in the manager's root."""
        mgr = self.checkpoint_manager
        where = Path(os.fspath(path)).resolve()
        root = Path(mgr.directory).resolve()
        parts = where.relative_to(root).parts if where.is_relative_to(root) else ()
        step = _layout.parse_step_name(parts[0]) if parts else None
        if step is None:
            raise CheckpointError(
                f"{path} is not a step folder of {mgr.directory}; give resume_from_checkpoint "
                f"True, a step number, or one of {[str(mgr.step_dir(s)) for s in mgr.all_steps()]}"
            )
        mgr.step_dir(step)  # committed, or StepNotFoundError
        return step

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        trainer: Any = self
        step = self._orbit_step_of(resume_from_checkpoint)
        self.checkpoint_manager.restore(step, {"model": model or trainer.model})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        trainer: Any = self
        step = self._orbit_step_of(checkpoint)
        # The model names the optimizer's state; it was loaded already, so it is left out.
        items = {"model": trainer.model, "optimizer": trainer.optimizer}
        self.checkpoint_manager.restore(step, items, exclude=("model",))
        recipe = self._orbit_recipe(step)
        if trainer.lr_scheduler is not None and "scheduler" in recipe:
            trainer.lr_scheduler.load_state_dict(recipe["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        trainer: Any = self
        recipe = self._orbit_recipe(self._orbit_step_of(checkpoint))
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None and "scaler" in recipe:
            scaler.load_state_dict(recipe["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # The Trainer calls this where its own resume restores the RNG (after fast-forwarding
        # the data), so the streams go on as in the run that never stopped.
        if checkpoint is None:
            return
        trainer: Any = self
        step = self._orbit_step_of(checkpoint)
        # The RNG is per rank: another world's streams would give ranks the wrong ones (or
        # every rank rank 0's). The Trainer's own resume keeps the seeds it set when it finds
        # no RNG file for its rank; so does this one, and says so.
        world = int(trainer.args.world_size)
        if not saved_by_this_world(self.checkpoint_manager, step, world, RNG_LEFT_OUT, logger):
            return
        recipe = self._orbit_recipe(step)
        if "rng" in recipe:
            RNGState().load_state_dict(recipe["rng"])

    def _orbit_recipe(self, step: int) -> dict[str, Any]:
        if "recipe" not in self.checkpoint_manager.metadata(step).items:
            return {}  # save_only_model
        return dict(self.checkpoint_manager.restore(step, ["recipe"])["recipe"])

    def _load_best_model(self) -> None:
        trainer: Any = self
        best = trainer.state.best_global_step
        if not best:
            return
        logger.info("loading the best model, step %d (%s)", best, trainer.state.best_metric)
        self.checkpoint_manager.restore(best, {"model": trainer.model})

    # ----------------------------------------------------------------------------- saving

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer: Any = self
        mgr = self.checkpoint_manager
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        step = trainer.state.global_step
        best = trainer.state.best_global_step
        if best and (best == step or best in mgr.all_steps()):
            # Where from_pretrained finds the best model once this step is committed.
            trainer.state.best_model_checkpoint = str(
                Path(mgr.directory) / _layout.step_name(best) / "model"
            )
        if trainer.args.should_save:
            self._orbit_export_callback_states()
        files = TrainerFiles(_json_text(trainer.state), trainer.args.to_json_string())
        items: dict[str, Any] = {"model": trainer.model, TRAINER_STATE: files}
        if not trainer.args.save_only_model:
            items["optimizer"] = trainer.optimizer
            fields: dict[str, Any] = {"rng": RNGState()}
            if trainer.lr_scheduler is not None:
                fields["scheduler"] = trainer.lr_scheduler
            scaler = getattr(trainer.accelerator, "scaler", None)
            if scaler is not None:
                fields["scaler"] = scaler
            items["recipe"] = RecipeState(step=step, **fields)
        mgr.save(step, items, metrics=self._orbit_metrics(step), force=True)

    def _orbit_export_callback_states(self) -> None:
        """As the Trainer does before writing its state: stateful callbacks' state into it."""
        from transformers.trainer_callback import ExportableState

        trainer: Any = self
        for callback in [*trainer.callback_handler.callbacks, trainer.control]:
            if not isinstance(callback, ExportableState):
                continue
            name = type(callback).__name__
            if isinstance(trainer.state.stateful_callbacks.get(name), list):
                trainer.state.stateful_callbacks[name].append(callback.state())
            else:
                trainer.state.stateful_callbacks[name] = callback.state()

    def _orbit_metrics(self, step: int) -> dict[str, float]:
        """The evaluation metric of ``step`` (for best-n retention), if it was evaluated."""
        trainer: Any = self
        metric = _metric_name(trainer.args)
        if metric is None:
            return {}
        for entry in reversed(trainer.state.log_history):
            if entry.get("step") == step and metric in entry:
                return {metric: float(entry[metric])}
        return {}


def _json_text(state: Any) -> str:
    """What ``TrainerState.save_to_json`` writes."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _metric_name(args: Any) -> str | None:
    metric = args.metric_for_best_model
    if metric is None:
        return None
    return metric if metric.startswith("eval_") else f"eval_{metric}"


def _trainer_class() -> Any:
    from transformers import Trainer

    class OrbitTrainer(OrbitTrainerMixin, Trainer):
        """A ``transformers.Trainer`` whose checkpoints orbit_pt writes and resumes."""

    OrbitTrainer.__module__ = __name__
    return OrbitTrainer


def __getattr__(name: str) -> Any:
    # OrbitTrainer subclasses transformers.Trainer: built on first use, so that importing this
    # module does not import transformers.
    if name == "OrbitTrainer":
        cls = _trainer_class()
        globals()["OrbitTrainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
