"""Lightning: ``ModelCheckpoint`` names and retires checkpoints; orbit_pt writes and reads them.

Give the Trainer the plugin and its callback::

    from orbit_pt.integrations.lightning import OrbitCheckpointIO

    io = OrbitCheckpointIO("out/orbit")
    trainer = pl.Trainer(
        plugins=[io],
        callbacks=[io.callback(model_attr="model"),   # the LightningModule's HF module
                   ModelCheckpoint(dirpath="out/checkpoints", every_n_train_steps=500,
                                   save_top_k=3, monitor="train_loss", save_last=True)],
    )
    trainer.fit(module, loader, ckpt_path="last")   # resumes exactly; from scratch at first

``ModelCheckpoint`` keeps choosing when to save, what each file is called and which files go
(``every_n_train_steps``, ``save_top_k``, ``monitor``, ``save_last``). Each ``.ckpt`` path it
names holds a small JSON pointer, ``{"orbit_step": N, ...}``; the state itself is step N of the
orbit_pt root, written once, atomically:

- ``model``: the module ``model_attr`` names, as orbit_pt saves a module (a Hugging Face
  folder that ``from_pretrained`` loads, for a ``transformers`` model);
- ``optimizer``, ``optimizer_1``, ...: the Trainer's optimizers, keyed by parameter name;
- ``recipe``: the step and the RNG of every generator of every rank;
- ``lightning``: the rest of Lightning's checkpoint (loops with the data loaders' positions,
  callbacks, LR schedulers, hyperparameters, what ``on_save_checkpoint`` hooks added, and any
  weights of the LightningModule outside ``model_attr``), as msgpack and safetensors.

Nothing is pickled, and a ``.ckpt`` that is not a pointer (a torch pickle) is refused, never
loaded. A second save of the same step (``save_last`` after a top-k save) writes a second
pointer to it. When ``ModelCheckpoint`` removes a file, the pointer goes; the step goes once no
pointer in that folder names it (deleted by orbit_pt's retention after the next save, or when
``fit`` ends), so the root holds what ``ModelCheckpoint`` keeps, plus the newest step, which
orbit_pt never deletes.

The callback restores what Lightning cannot before its optimizers exist: the optimizers' state
and the RNG, at ``on_train_start``, after the data loader's position was restored and its
iterator created (as in the run that never stopped, where the iterator drew its seed before the
saved RNG state). Lightning owns SIGTERM (its signal connector): the manager is opened without
orbit_pt's preemption watcher.

``OrbitCheckpointIO(root, options=None, *, storage_options=None)``: ``root`` is the orbit_pt
root (a folder, or an ``s3://`` URL with ``storage_options``); ``options`` are the manager's,
with retention left unset (``ModelCheckpoint`` keeps what is kept) -- ``async_save=True`` makes
a save return after a memory copy, and its pointer is written once the step has committed.
``io.callback(model_attr="model")`` is the callback; ``io.checkpoint_manager`` is the manager,
open while the Trainer runs.

Supported: one process, DDP, and FSDP2 through :class:`OrbitModelParallelStrategy` (tested
with pytorch-lightning 2.6 on CPU, 2 gloo ranks). ``OrbitModelParallelStrategy`` is Lightning's
``ModelParallelStrategy`` (``fully_shard`` in ``configure_model``) whose saves go to the plugin
on every rank, gather-free: each rank writes its own shards of the model and the optimizers
into the step's Hugging Face files, as orbit_pt's own FSDP2 path does. Lightning's own
``ModelParallelStrategy``, ``FSDPStrategy`` and DeepSpeed gather the state (or write DCP) before
any ``CheckpointIO`` sees it, and are refused.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from orbit_pt.errors import (
    CheckpointError,
    CheckpointTypeError,
    CheckpointValueError,
    StepNotFoundError,
)
from orbit_pt.handlers.base import HandlerContext
from orbit_pt.handlers.state import StateHandler
from orbit_pt.integrations._world import RNG_LEFT_OUT, saved_by_this_world
from orbit_pt.manager import CheckpointManager
from orbit_pt.options import CheckpointManagerOptions
from orbit_pt.policies import CheckpointInfo
from orbit_pt.recipe import RecipeState, RNGState

# OrbitCheckpointIO and OrbitModelParallelStrategy are built on first access (module
# __getattr__, so that importing this module imports no Lightning): they are not listed here.
__all__ = ["read_pointer"]

logger = logging.getLogger(__name__)

LIGHTNING = "lightning"
RECIPE = "recipe"
POINTER_FORMAT = "orbit_pt.lightning.pointer"
# Beside the pointers: the steps no pointer names any more, still to be deleted.
RELEASED_FILE = ".orbit-released.json"
# Weights of the LightningModule outside ``model_attr``, kept inside the ``lightning`` item.
_OTHER_WEIGHTS = "_orbit_other_weights"
# The largest pointer file we read: anything bigger is not one of ours.
_POINTER_MAX_BYTES = 4096


def read_pointer(path: str | os.PathLike[str]) -> int:
    """The orbit_pt step that the ``.ckpt`` pointer at ``path`` names.

    Raises:
        CheckpointError: ``path`` is not a pointer written by :class:`OrbitCheckpointIO` (a
            torch pickle is named as such and never unpickled).
    """
    return _read_pointer(Path(os.fspath(path))).step


@dataclasses.dataclass(frozen=True)
class _Pointer:
    """What a pointer file holds.

    ``overrides``: for a second save of the same step (``save_last`` right after a top-k
    save), the plain values of Lightning's loop and callback states that differ from the
    step's own (``ModelCheckpoint``'s ``last_model_path``), applied when it is loaded.
    """

    step: int
    root: str | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _read_pointer(path: Path) -> _Pointer:
    with open(path, "rb") as file:
        head = file.read(_POINTER_MAX_BYTES + 1)
    if head[:2] == b"PK" or head[:1] == b"\x80":
        raise CheckpointError(
            f"{path} is a torch pickle (Lightning's own checkpoint format), not an orbit_pt "
            "pointer; orbit_pt never unpickles a file. Load it with a Trainer that has no "
            "OrbitCheckpointIO, or resume from a checkpoint this plugin wrote"
        )
    try:
        pointer = json.loads(head) if len(head) <= _POINTER_MAX_BYTES else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        pointer = None
    step = pointer.get("orbit_step") if isinstance(pointer, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            f"{path} is not an orbit_pt pointer (a small JSON file holding "
            '{"orbit_step": N}); give fit(ckpt_path=...) a checkpoint that OrbitCheckpointIO '
            "wrote"
        )
    assert isinstance(pointer, dict)
    root = pointer.get("orbit_root")
    overrides = pointer.get("state_overrides")
    return _Pointer(
        step,
        root if isinstance(root, str) else None,
        overrides if isinstance(overrides, dict) else {},
    )


def _write_pointer(path: Path, pointer: _Pointer) -> None:
    """Write the pointer atomically: a reader sees the old pointer or the new, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "format": POINTER_FORMAT,
        "orbit_step": pointer.step,
        "orbit_root": pointer.root,
    }
    if pointer.overrides:
        record["state_overrides"] = pointer.overrides
    text = json.dumps(record)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _LightningStateHandler:
    """Lightning's checkpoint without the model and optimizers, written once, by rank 0.

    Every rank's dict is the same but for what only rank 0's holds (``on_save_checkpoint``
    of the LightningModule runs after the callback that hands the other ranks' dicts in), so
    only rank 0's is kept. The encoding is the state handler's: msgpack and safetensors, and a
    value neither can hold is refused with its path (``lightning.hyper_parameters.<key>``).
    """

    name = "orbit_pt.lightning.state"

    def save(self, directory: Path, item: Any, context: HandlerContext) -> Mapping[str, Any]:
        alone = dataclasses.replace(context, rank=0, world_size=1, collective=None)
        info: dict[str, Any] = {}

        def write() -> None:
            if context.rank == 0:
                try:
                    info.update(StateHandler().save(directory, item, alone))
                except CheckpointTypeError as exc:
                    raise CheckpointTypeError(
                        f"{exc}. In Lightning's checkpoint, hyperparameters "
                        "(save_hyperparameters) and callback states must be numbers, strings, "
                        "tensors and containers of them"
                    ) from None

        if context.collective is None:
            write()
        else:  # a failure on rank 0 (an unsavable hyperparameter) fails every rank here
            context.collective.run_everywhere("orbit_pt.lightning.state", write)
        return {"format_version": 1}

    def restore(self, directory: Path, target: Any | None, context: HandlerContext) -> Any:
        alone = dataclasses.replace(context, rank=0, world_size=1, saved_world_size=1)
        return StateHandler().restore(directory, None, alone)


@dataclasses.dataclass(frozen=True)
class _KeepNamedSteps:
    """orbit_pt retention for the plugin: every step but those no pointer names any more.

    ``released`` is filled on rank 0 by ``remove_checkpoint``; rank 0's decision is the one
    every rank applies.
    """

    released: set[int]

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {info.step for info in checkpoints if info.step not in self.released}


def _lightning_classes(kind: str) -> tuple[type, ...]:
    """Lightning's ``kind`` class from each installed package (``pytorch_lightning``,
    ``lightning``), so that either package's Trainer accepts the plugin and its callback."""
    found: list[type] = []
    for package in ("pytorch_lightning", "lightning.pytorch"):
        try:
            module = __import__(package, fromlist=["plugins"])
        except ImportError:
            continue
        cls = module.Callback if kind == "Callback" else module.plugins.CheckpointIO
        if cls not in found:
            found.append(cls)
    if not found:
        raise ImportError(
            "orbit_pt.integrations.lightning needs Lightning: pip install 'orbit_pt[lightning]'"
        )
    return tuple(found)


class _Plugin:
    """The behaviour of :class:`OrbitCheckpointIO`, without Lightning's base class."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        options: CheckpointManagerOptions | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        options = options if options is not None else CheckpointManagerOptions()
        if not isinstance(options, CheckpointManagerOptions):
            raise CheckpointTypeError(
                f"options must be a CheckpointManagerOptions, got {type(options).__name__}"
            )
        if options.retention_policy() is not None:
            raise CheckpointValueError(
                "OrbitCheckpointIO keeps what ModelCheckpoint keeps; leave orbit_pt's retention "
                "options (keep_last_n, keep_best_n, retention=...) unset and give "
                "ModelCheckpoint save_top_k / monitor instead"
            )
        if options.read_only:
            raise CheckpointValueError(
                "OrbitCheckpointIO writes checkpoints; open a read-only CheckpointManager "
                "yourself to read a root beside a training job"
            )
        super().__init__()
        self.root = root
        self._released: set[int] = set()
        self._record_folders: set[Path] = set()  # rank 0: where RELEASED_FILE records are
        # Lightning owns SIGTERM; saves happen when ModelCheckpoint asks (force=True), so the
        # save-interval options do not apply either.
        self._options = dataclasses.replace(
            options, retention=_KeepNamedSteps(self._released), preemption_signals=()
        )
        self._storage_options = storage_options
        self._manager: CheckpointManager | None = None
        self._trainer: Any = None
        self._model_attr = "model"
        self._callback: Any = None
        self._saved: set[int] = set()  # steps saved by this process (a second save: a pointer)
        self._pointers: dict[Path, int] = {}  # rank 0: pointers written by this process
        self._pending: dict[Path, _Pointer] = {}  # rank 0: pointers waiting for a commit
        self._first_dump: tuple[int, dict[str, Any]] | None = None  # rank 0: see _overrides
        self._restore_step: int | None = None  # loaded; optimizers and RNG still to restore

    # ---------------------------------------------------------------------------- public

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """The manager of the root, open while the Trainer runs (``fit``/``validate``/...)."""
        if self._manager is None:
            raise CheckpointError(
                "OrbitCheckpointIO opens its CheckpointManager when the Trainer sets up; add "
                "io.callback() to the Trainer's callbacks and call fit()"
            )
        return self._manager

    def callback(self, model_attr: str = "model") -> Any:
        """The callback this plugin needs beside it in ``Trainer(callbacks=[...])``.

        Args:
            model_attr: the attribute of the LightningModule that holds the model to save as
                the step's ``model`` item (a Hugging Face folder for a ``transformers`` model).
        """
        if not isinstance(model_attr, str) or not model_attr:
            raise CheckpointTypeError(f"model_attr must be an attribute name, got {model_attr!r}")
        if self._callback is None:
            self._callback = _callback_class()(self)
        self._model_attr = model_attr
        return self._callback

    # ------------------------------------------------------- CheckpointIO (rank 0 saves)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as an orbit_pt step (with every rank) and point ``path`` at it."""
        if storage_options is not None:
            raise CheckpointValueError(
                "OrbitCheckpointIO takes no storage_options in save_checkpoint; give them to "
                "OrbitCheckpointIO(root, storage_options=...)"
            )
        target = _local_path(path)
        self._flush_pointers()
        step = self._save(checkpoint)
        pointer = _Pointer(step, self._root_name(), self._overrides(step, checkpoint))
        if self.checkpoint_manager.is_saving_in_progress():
            self._pending[target] = pointer  # written once the step has committed
        else:
            self._point(target, pointer)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the model of the step ``path`` points at in place, and return Lightning's
        checkpoint; the optimizers and the RNG follow at ``on_train_start``."""
        where = _local_path(path)
        pointer = self._pointer_at(where)
        step = pointer.step
        mgr = self.checkpoint_manager
        if self._trainer.global_rank == 0:
            released = _read_released(where.parent, self._root_name())
            self._released.update(released & set(mgr.all_steps()))
            self._record_folders.add(where.parent)
        mgr.wait_until_finished()
        pl_module = self._trainer.lightning_module
        model = self._model(pl_module)
        mgr.restore(step, {"model": model})
        checkpoint = dict(mgr.restore(step, [LIGHTNING])[LIGHTNING])
        _apply_overrides(checkpoint, pointer.overrides)
        world = int(self._trainer.world_size)
        if not saved_by_this_world(mgr, step, world, _LOADERS_LEFT_OUT, logger):
            _drop_loader_positions(checkpoint)
        state = pl_module.state_dict()
        state.update(checkpoint.pop(_OTHER_WEIGHTS, {}))
        checkpoint["state_dict"] = state
        # Lightning loads these into its optimizers; they do not exist yet, so the callback
        # restores them in place at on_train_start (an empty list loads nothing).
        checkpoint["optimizer_states"] = []
        self._restore_step = step
        logger.info("loaded the model of step %d from %s (%s)", step, mgr.directory, path)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path``; its step goes once no pointer names it."""
        target = _local_path(path)
        self._flush_pointers()
        if target in self._pending:
            step = self._pending.pop(target).step
        elif not target.exists():
            return
        else:
            step = _read_pointer(target).step
            target.unlink()
        self._pointers.pop(target, None)
        self._release_unless_named(step, target.parent)

    def teardown(self) -> None:
        """Lightning's hook; the callback closes the manager (on every rank)."""

    # ------------------------------------------------------------------------ internals

    def _open(self, trainer: Any, pl_module: Any) -> None:
        strategy_io = trainer.strategy.checkpoint_io
        if strategy_io is not self:
            wrapped = getattr(strategy_io, "checkpoint_io", None)
            if wrapped is self:
                raise CheckpointValueError(
                    f"OrbitCheckpointIO cannot be wrapped in {type(strategy_io).__name__}: "
                    "Lightning's AsyncCheckpointIO would save a model that training goes on "
                    "changing. Use orbit_pt's own: OrbitCheckpointIO(root, "
                    "CheckpointManagerOptions(async_save=True))"
                )
            raise CheckpointValueError(
                f"the Trainer's strategy ({type(trainer.strategy).__name__}) does not use this "
                f"OrbitCheckpointIO (it uses {type(strategy_io).__name__}); pass it as "
                "Trainer(plugins=[io]). Strategies that write their own checkpoints (FSDP, "
                "model parallel, DeepSpeed) are not supported"
            )
        if not _supported_strategy(trainer.strategy):
            raise CheckpointValueError(
                f"OrbitCheckpointIO supports one process, DDP and OrbitModelParallelStrategy, "
                f"not {type(trainer.strategy).__name__}: that strategy writes its own "
                "checkpoints (or gathers the state before any CheckpointIO sees it). For "
                "gather-free FSDP2, give the Trainer strategy=OrbitModelParallelStrategy(...) "
                "from orbit_pt.integrations.lightning (fully_shard in configure_model)"
            )
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "save_weights_only", False):
                raise CheckpointValueError(
                    "ModelCheckpoint(save_weights_only=True) is not supported by "
                    "OrbitCheckpointIO: every step holds the whole training state. Read the "
                    "weights from a step's model/ folder (from_pretrained) instead"
                )
        self._model(pl_module)
        self._trainer = trainer
        if self._manager is None:
            self._manager = CheckpointManager(
                self.root,
                options=self._options,
                handlers={LIGHTNING: _LightningStateHandler()},
                storage_options=self._storage_options,
            )

    def _close(self, *, failed: bool = False) -> None:
        mgr = self._manager
        if mgr is None:
            return
        self._manager = None
        self._restore_step = None
        try:
            if not failed:
                mgr.wait_until_finished()
                self._flush_pointers(mgr)
                mgr.apply_retention()  # the steps released since the last save go now
                self._forget_deleted(mgr)
        finally:
            mgr.close()
            self._trainer = None
            self._saved.clear()
            self._first_dump = None

    def _model(self, pl_module: Any) -> torch.nn.Module:
        model = getattr(pl_module, self._model_attr, None)
        if not isinstance(model, torch.nn.Module):
            raise CheckpointValueError(
                f"{type(pl_module).__name__}.{self._model_attr} is "
                f"{type(model).__name__}, not a torch module; give io.callback(model_attr=...) "
                "the attribute that holds the model"
            )
        return model

    def _save(self, checkpoint: Mapping[str, Any]) -> int:
        """The collective save of Lightning's ``checkpoint`` (every rank calls it once)."""
        if "optimizer_states" not in checkpoint:
            raise CheckpointValueError(
                "Lightning asked for a weights-only checkpoint, which OrbitCheckpointIO does "
                "not write; drop weights_only / save_weights_only"
            )
        step = int(checkpoint["global_step"])
        if step in self._saved:
            return step  # the same step again (save_last): one step, another pointer
        self._released.discard(step)  # saved anew: no longer the step a pointer let go
        trainer = self._trainer
        if trainer is None:
            raise CheckpointError(
                "OrbitCheckpointIO saves only inside a Trainer that has io.callback() among "
                "its callbacks"
            )
        pl_module = trainer.lightning_module
        model = self._model(pl_module)
        prefix = f"{self._model_attr}."
        skipped = ("state_dict", "optimizer_states")
        lightning = {k: v for k, v in checkpoint.items() if k not in skipped}
        lightning[_OTHER_WEIGHTS] = {
            k: v for k, v in checkpoint.get("state_dict", {}).items() if not k.startswith(prefix)
        }
        items: dict[str, Any] = {"model": model, LIGHTNING: lightning}
        for index, optimizer in enumerate(trainer.optimizers):
            items["optimizer" if index == 0 else f"optimizer_{index}"] = optimizer
        items[RECIPE] = RecipeState(step=step, rng=RNGState())
        mgr = self.checkpoint_manager
        mgr.save(step, items, force=True)
        self._saved.add(step)
        self._forget_deleted(mgr)
        return step

    def _restore_training_state(self) -> None:
        """The optimizers and the RNG of the step loaded (the callback's on_train_start)."""
        step, self._restore_step = self._restore_step, None
        if step is None:
            return
        trainer = self._trainer
        mgr = self.checkpoint_manager
        items: dict[str, Any] = {"model": self._model(trainer.lightning_module)}
        for index, optimizer in enumerate(trainer.optimizers):
            items["optimizer" if index == 0 else f"optimizer_{index}"] = optimizer
        # The model names the optimizers' state; it was loaded already, so it is left out.
        mgr.restore(step, items, exclude=("model",))
        if not saved_by_this_world(mgr, step, int(trainer.world_size), RNG_LEFT_OUT, logger):
            return
        recipe = mgr.restore(step, [RECIPE])[RECIPE]
        RNGState().load_state_dict(recipe["rng"])

    def _pointer_at(self, path: Path) -> _Pointer:
        if not path.exists():
            raise CheckpointError(f"{path} does not exist; nothing to load")
        pointer = _read_pointer(path)
        step, root = pointer.step, pointer.root
        mgr = self.checkpoint_manager
        if step not in mgr.all_steps():
            mgr.reload()
        if step not in mgr.all_steps():
            raise StepNotFoundError(step, mgr.directory, mgr.all_steps())
        if root is not None and _same_root(root, mgr.directory) is False:
            logger.warning(
                "%s was written for the orbit_pt root %s; loading step %d of %s", path, root,
                step, mgr.directory,
            )  # fmt: skip
        return pointer

    def _overrides(self, step: int, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """For a second save of ``step``: the plain loop and callback values it changed."""
        states = {key: checkpoint.get(key) for key in _OVERRIDABLE}
        if self._first_dump is None or self._first_dump[0] != step:
            self._first_dump = (step, states)
            return {}
        return _plain_changes(states, self._first_dump[1])

    def _root_name(self) -> str:
        """The root as pointers record it: absolute, or the URL."""
        text = os.fspath(self.root)
        return text if "://" in text else str(Path(text).absolute())

    def _point(self, path: Path, pointer: _Pointer) -> None:
        """Write the pointer at ``path``; a step that only the pointer it replaces named (the
        previous ``last.ckpt``) is released."""
        step = pointer.step
        replaced = self._pointers.get(path)
        if replaced is None and path.is_file():
            try:
                replaced = _read_pointer(path).step
            except CheckpointError:
                replaced = None  # not ours; overwritten, as Lightning would
        _write_pointer(path, pointer)
        self._pointers[path] = step
        if replaced is not None and replaced != step:
            self._release_unless_named(replaced, path.parent)

    def _release_unless_named(self, step: int, folder: Path) -> None:
        if step in self._named_steps(folder):
            return
        self._released.add(step)
        # Kept beside the pointers, so that a run killed before the step is deleted deletes
        # it after it resumes (load_checkpoint reads this record).
        self._record_folders.add(folder)
        _write_released(folder, self._released, self._root_name())

    def _forget_deleted(self, mgr: CheckpointManager) -> None:
        """Drop the released steps that retention has deleted, here and in the records: a
        step saved again later under the same number (after resuming from an older pointer)
        must not be taken for the released one."""
        if not self._released or mgr.is_saving_in_progress():
            return
        self._released.intersection_update(mgr.all_steps())
        for folder in self._record_folders:
            if folder.is_dir():
                _write_released(folder, self._released, self._root_name())

    def _flush_pointers(self, mgr: CheckpointManager | None = None) -> None:
        """Write the pointers of async saves that have committed since."""
        mgr = mgr or self._manager
        if not self._pending or mgr is None or mgr.is_saving_in_progress():
            return
        mgr.wait_until_finished()  # a failed save raises here, before its pointers exist
        committed = set(mgr.all_steps())
        for path, pointer in list(self._pending.items()):
            if pointer.step in committed:
                del self._pending[path]
                self._point(path, pointer)

    def _named_steps(self, folder: Path) -> set[int]:
        """The steps the pointers of this process and those in ``folder`` name."""
        named = set(self._pointers.values()) | {p.step for p in self._pending.values()}
        if folder.is_dir():
            for candidate in folder.iterdir():
                if candidate.suffix != ".ckpt" or not candidate.is_file():
                    continue
                try:
                    named.add(_read_pointer(candidate).step)
                except (CheckpointError, OSError):
                    continue  # not ours
        return named


_OVERRIDABLE = ("loops", "callbacks")
_PLAIN = (str, int, float, bool, type(None))


def _plain_changes(new: Any, old: Any) -> dict[str, Any]:
    """The str/number/bool/None leaves of the nested dicts ``new`` that differ from ``old``."""
    changes: dict[str, Any] = {}
    for key, value in new.items() if isinstance(new, Mapping) else ():
        if not isinstance(key, str):
            continue
        before = old.get(key) if isinstance(old, Mapping) else None
        if isinstance(value, Mapping):
            inner = _plain_changes(value, before)
            if inner:
                changes[key] = inner
        elif isinstance(value, _PLAIN) and (type(value) is not type(before) or value != before):
            changes[key] = value
    return changes


def _apply_overrides(checkpoint: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        current = checkpoint.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            _apply_overrides(current, value)
        elif not isinstance(value, Mapping):
            checkpoint[key] = value


def _read_released(folder: Path, root: str) -> set[int]:
    """The steps whose last pointer in ``folder`` was removed (for the root ``root``)."""
    try:
        record = json.loads((folder / RELEASED_FILE).read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(record, dict) or record.get("orbit_root") != root:
        return set()
    return {s for s in record.get("steps", []) if isinstance(s, int) and not isinstance(s, bool)}


def _write_released(folder: Path, steps: set[int], root: str) -> None:
    text = json.dumps({"orbit_root": root, "steps": sorted(steps)})
    fd, tmp = tempfile.mkstemp(prefix=f"{RELEASED_FILE}.", dir=folder)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text + "\n")
        os.replace(tmp, folder / RELEASED_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_LOADERS_LEFT_OUT = (
    "the data loaders' positions are not restored (they belong to the old ranks' samplers); "
    "the data starts this epoch over"
)


def _drop_loader_positions(checkpoint: dict[str, Any]) -> None:
    """Take the data loaders' positions out of a checkpoint saved by another number of ranks.

    A position is rank 0's, in the order of the old world's sampler (which rows each rank
    drew): loaded into this run's loaders it would mean other data, or fail inside torchdata
    (a distributed sampler's state into a single-process loader). Without it each loader
    starts its epoch over, as Lightning does for a loader it cannot restore; the model and
    optimizers are resharded and the step count goes on.
    """
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    if isinstance(fit_state, dict):
        fit_state.pop("combined_loader", None)


def _supported_strategy(strategy: Any) -> bool:
    """One process, DDP, or OrbitModelParallelStrategy: the strategies that hand every save to
    the CheckpointIO on rank 0, with the model and optimizers as they are on every rank.
    (DeepSpeed's derives from DDP's but saves through its engine.)"""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    if "OrbitModelParallelStrategy" in names:
        return True
    if any(word in name for name in names for word in ("DeepSpeed", "FSDP", "ModelParallel")):
        return False
    return bool(names & {"SingleDeviceStrategy", "DDPStrategy"})


def _local_path(path: Any) -> Path:
    text = os.fspath(path)
    if "://" in str(text):
        raise CheckpointValueError(
            f"OrbitCheckpointIO writes its pointers to local paths, got {text!r}; give "
            "ModelCheckpoint a local dirpath (the orbit_pt root itself may be an s3:// URL)"
        )
    return Path(text).absolute()


def _same_root(recorded: str, directory: Any) -> bool | None:
    if "://" in recorded or "://" in str(directory):
        return recorded.rstrip("/") == str(directory).rstrip("/")
    try:
        return Path(recorded).resolve() == Path(directory).resolve()
    except OSError:
        return None


def _callback_class() -> type:
    built = globals().get("_OrbitCallback")
    if isinstance(built, type):
        return built

    class _OrbitCallback(*_lightning_classes("Callback")):  # type: ignore[misc]
        """Opens the plugin's manager, brings the other ranks into each save, and restores
        the optimizers and the RNG once they exist."""

        def __init__(self, plugin: _Plugin) -> None:
            super().__init__()
            self._plugin = plugin

        @property
        def state_key(self) -> str:
            return "OrbitCheckpointIO"

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self._plugin._open(trainer, pl_module)

        def on_save_checkpoint(
            self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]
        ) -> None:
            # Rank 0 saves from the plugin (Lightning calls it there only, with the finished
            # checkpoint); the other ranks join the same collective save from here.
            if trainer.global_rank != 0:
                self._plugin._save(checkpoint)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._plugin._restore_training_state()

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self._plugin._close()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            try:
                self._plugin._close(failed=True)
            except Exception:  # the training error is the one to raise
                logger.exception("closing the checkpoint manager failed after an error")

    _OrbitCallback.__module__ = __name__
    globals()["_OrbitCallback"] = _OrbitCallback
    return _OrbitCallback


def _plugin_class() -> type:
    class OrbitCheckpointIO(_Plugin, *_lightning_classes("CheckpointIO")):  # type: ignore[misc]
        """A Lightning ``CheckpointIO`` whose checkpoints are orbit_pt steps: see the module.

        Args:
            root: the orbit_pt root (a folder, or an ``s3://`` URL).
            options: the manager's options; retention stays with ``ModelCheckpoint``, so its
                retention options must be unset. ``async_save=True`` makes saves return
                after a memory copy (the pointer is written once the step has committed).
            storage_options: for an object-store root.
        """

    OrbitCheckpointIO.__module__ = __name__
    return OrbitCheckpointIO


def _strategies_module() -> Any:
    """Lightning's ``strategies`` module: ``pytorch_lightning``'s when installed, else the
    ``lightning`` package's (a strategy subclasses one package's classes only)."""
    for package in ("pytorch_lightning", "lightning.pytorch"):
        try:
            return importlib.import_module(f"{package}.strategies")
        except ImportError:
            continue
    raise ImportError(
        "orbit_pt.integrations.lightning needs Lightning: pip install 'orbit_pt[lightning]'"
    )


def _strategy_class() -> type:
    strategies = _strategies_module()
    Strategy: Any = strategies.Strategy  # noqa: N806 (Lightning's class)
    base: Any = strategies.ModelParallelStrategy

    class OrbitModelParallelStrategy(base):
        """Lightning's ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in the module's
        ``configure_model``) whose checkpoints are orbit_pt steps written without gathering.

        Give it with the plugin: ``Trainer(strategy=OrbitModelParallelStrategy(
        data_parallel_size=2), plugins=[io], callbacks=[io.callback(), checkpoints])``. The
        arguments are ``ModelParallelStrategy``'s but ``save_distributed_checkpoint`` (the
        plugin writes every checkpoint). Lightning's own strategy gathers nothing either, but
        writes DCP folders with a pickled metadata file, bypassing the ``CheckpointIO``; this
        one hands each save to the plugin, which saves the sharded model and optimizers as
        they are on every rank (each rank writes its own rows into the step's Hugging Face
        files), and restores them in place on a resume.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if "save_distributed_checkpoint" in kwargs:
                raise CheckpointValueError(
                    "OrbitModelParallelStrategy takes no save_distributed_checkpoint: every "
                    "checkpoint is an orbit_pt step, written by each rank without gathering"
                )
            super().__init__(*args, **kwargs)

        def _orbit_plugin(self) -> _Plugin:
            plugin = self.checkpoint_io
            if not isinstance(plugin, _Plugin):
                raise CheckpointValueError(
                    "OrbitModelParallelStrategy saves through OrbitCheckpointIO; give the "
                    f"Trainer plugins=[OrbitCheckpointIO(root)] (it has "
                    f"{type(plugin).__name__})"
                )
            return plugin

        def setup(self, trainer: Any) -> None:
            self._orbit_plugin()  # before anything could be saved the default way (a pickle)
            super().setup(trainer)

        def lightning_module_state_dict(self) -> dict[str, Any]:
            # The plugin saves the module model_attr names from the module itself (sharded,
            # gather-free); Lightning's checkpoint keeps only the weights outside it, which
            # are plain tensors here (a sharded one is refused: it would need a gather).
            prefix = f"{self._orbit_plugin()._model_attr}."
            others = {
                key: value
                for key, value in self.lightning_module.state_dict().items()
                if not key.startswith(prefix)
            }
            sharded = [key for key, value in others.items() if _is_dtensor(value)]
            if sharded:
                raise CheckpointValueError(
                    f"{sharded[0]!r} is sharded but outside the model io.callback(model_attr=...) "
                    "names; keep every sharded module under that attribute"
                )
            return others

        def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
            # The plugin saves trainer.optimizers themselves, by parameter name, per shard.
            return {}

        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
        ) -> None:
            # As single-process and DDP strategies do: rank 0 hands the checkpoint to the
            # plugin; the other ranks joined the same collective save from the callback's
            # on_save_checkpoint. (ModelParallelStrategy's own would write DCP here.)
            Strategy.save_checkpoint(self, checkpoint, filepath, storage_options)

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
            # Every rank: the plugin restores the sharded model in place (each rank reads its
            # own rows) and returns the rest of Lightning's checkpoint.
            return self._orbit_plugin().load_checkpoint(checkpoint_path)

        def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
            # The model was restored in place by load_checkpoint; only the weights outside it
            # are left to load.
            prefix = f"{self._orbit_plugin()._model_attr}."
            others = {
                key: value
                for key, value in checkpoint.get("state_dict", {}).items()
                if not key.startswith(prefix)
            }
            if others:
                self.lightning_module.load_state_dict(others, strict=False)

    OrbitModelParallelStrategy.__module__ = __name__
    return OrbitModelParallelStrategy


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor"


def __getattr__(name: str) -> Any:
    # OrbitCheckpointIO subclasses Lightning's CheckpointIO, OrbitModelParallelStrategy its
    # ModelParallelStrategy: built on first use, so that importing this module does not
    # import Lightning.
    builders = {"OrbitCheckpointIO": _plugin_class, "OrbitModelParallelStrategy": _strategy_class}
    if name in builders:
        cls = builders[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
