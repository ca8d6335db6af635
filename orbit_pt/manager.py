"""``CheckpointManager``: when to save, atomic commits of steps, and what retention keeps."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from orbit_pt import _layout, _progress, _version
from orbit_pt._background import BackgroundSaver
from orbit_pt._commit import StepStore
from orbit_pt._dist import Collective
from orbit_pt._preemption import PreemptionWatcher
from orbit_pt.errors import (
    CheckpointError,
    CheckpointTypeError,
    CheckpointValueError,
    CorruptCheckpointError,
    ItemNotFoundError,
    ReadOnlyError,
)
from orbit_pt.handlers import Handler, HandlerContext, default_handler, handler_by_name
from orbit_pt.handlers.base import StagingHandler
from orbit_pt.metadata import FileMetadata, ItemMetadata, StepMetadata, validate_metrics
from orbit_pt.options import CheckpointManagerOptions
from orbit_pt.policies import CheckpointInfo

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and restores the steps of one training run under a root folder.

    Args:
        directory: the root folder; created when missing (unless ``read_only``).
        options: when to save and what to keep; defaults save every step and keep every step.
        handlers: item name -> handler, for items whose default handler (chosen by type) is not
            what you want.
        clock: seconds since the epoch, for the commit time recorded in each step. Tests pass a
            fake clock; leave it alone otherwise.

    Raises:
        CheckpointLockedError: another writing manager holds the root; open this one with
            ``CheckpointManagerOptions(read_only=True)`` to read beside it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        options: CheckpointManagerOptions | None = None,
        handlers: Mapping[str, Handler] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._options = options if options is not None else CheckpointManagerOptions()
        if not isinstance(self._options, CheckpointManagerOptions):
            raise CheckpointTypeError(
                f"options must be a CheckpointManagerOptions, got {type(self._options).__name__}"
            )
        self._handlers = dict(handlers or {})
        for name, handler in self._handlers.items():
            _layout.check_item_name(name)
            if not isinstance(handler, Handler):
                raise CheckpointTypeError(
                    f"handlers[{name!r}] must implement the Handler protocol (name, save, "
                    f"restore), got {type(handler).__name__}"
                )
        self._clock = clock
        self._retention = self._options.retention_policy()
        self._best = self._options.best_policy()
        # The best-n rules of the retention policy: a step saved without their metric is
        # kept unranked, and that is logged once.
        self._ranking = self._options.ranking_policies()
        self._save_policy = self._options.save_policy_object()
        self._warned_unranked = False
        self._warned_no_staging: set[str] = set()
        self._closed = False
        # Default handlers are kept per item name, so their staging buffers are reused.
        self._default_handlers: dict[str, Handler] = {}
        # Collective under torch.distributed: every rank constructs its manager at the same point.
        self._dist = Collective()
        self._store = StepStore(Path(directory), read_only=self._options.read_only, dist=self._dist)
        try:
            # The background commit talks over a gloo group of its own, so that its barriers
            # never interleave with the training thread's (preemption checks, sync saves).
            self._background_dist = (
                Collective(group=self._dist.new_group())
                if self._options.async_save and self._dist.enabled and not self._options.read_only
                else self._dist
            )
            self._background = BackgroundSaver(self._store.root)
            self._preemption = PreemptionWatcher(
                () if self._options.read_only else self._options.preemption_signals
            )
        except BaseException:
            self._store.close()  # a manager that failed to open must not keep the root locked
            raise
        self._preemption_agreed: tuple[int, bool] | None = None
        self._preempted = False

    # ------------------------------------------------------------------------------- discovery

    @property
    def directory(self) -> Path:
        """The root folder."""
        return self._store.root

    def all_steps(self) -> list[int]:
        """Every committed step, ascending; ``[]`` when there is none."""
        return self._store.steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self._store.steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The committed step with the best ``best_metric`` (ties: the newer step).

        Ranked by ``best_metric``/``best_mode``, or else by the ``KeepBestN`` in ``retention=``;
        with neither, this is the latest step. Steps saved without the metric are not ranked;
        None when no committed step carries it. Metrics are read from each step's metadata, so
        this survives restarts.
        """
        if self._best is None:
            return self.latest_step()
        ranked = self._best.ranked(self._infos())
        return ranked[0].step if ranked else None

    def step_dir(self, step: int) -> Path:
        """The committed folder of ``step`` (e.g. for ``from_pretrained(step_dir / "model")``)."""
        self._store.metadata(_check_step(step))
        return self._store.step_path(step)

    def metadata(self, step: int | None = None) -> StepMetadata:
        """What was recorded about ``step`` (default: the latest) when it was committed."""
        return self._store.metadata(self._resolve_step(step))

    def reload(self) -> None:
        """Re-read the root, e.g. in a read-only manager to see steps committed since it opened."""
        self._store.rescan()

    # ---------------------------------------------------------------------------------- saving

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a save step (interval, listed steps, custom policy, preemption)."""
        _check_step(step)
        return self._save_policy.should_save(step, preempted=self.reached_preemption(step))

    def reached_preemption(self, step: int) -> bool:
        """Whether the job was asked to stop by a preemption signal, agreed by every rank.

        Under torch.distributed this is collective (one all-reduce on a gloo group, unless no
        preemption signal is watched): call it at the same point of every rank's loop. Every
        rank gets the same answer at the same step, so the preemption save that follows is
        one save on all ranks. Once True it stays True.
        """
        _check_step(step)
        if self._preempted:
            return True
        if self._preemption_agreed is not None and self._preemption_agreed[0] == step:
            return self._preemption_agreed[1]
        local = self._preemption.requested
        # Decided by the options, which every rank shares, and not by whether this rank could
        # install its handler: one rank skipping the all-reduce would hang the others.
        watched = bool(self._options.preemption_signals) and not self._options.read_only
        agreed = self._dist.any(local) if watched else local
        self._preemption_agreed = (step, agreed)
        if agreed:
            self._preempted = True
            logger.warning(
                "preemption agreed at step %d (rank %d of %d)",
                step,
                self._dist.rank,
                self._dist.world_size,
            )
        return agreed

    def save(
        self,
        step: int,
        items: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``items`` as ``step``, atomically; return whether a step was saved.

        Without ``force``, nothing happens unless ``should_save(step)``. Saving a step that
        exists, or one older than existing steps (a rollback), moves those steps into
        ``superseded/`` first, with a warning: nothing is deleted silently. Retention runs only
        after the new step is committed.

        Raises:
            CheckpointSaveError: writing failed; nothing of ``step`` was committed and earlier
                steps are untouched. The cause is chained.
        """
        self._check_open()
        _check_step(step)
        if self._options.read_only:
            raise ReadOnlyError(
                f"this manager opened {self.directory} read-only; it cannot save step {step}. "
                "Open it without read_only=True (only one writer per root)"
            )
        if not force and not self.should_save(step):
            return False
        handlers = self._handlers_for_save(items)
        metric_values = validate_metrics(metrics, step=step)
        # The previous async save must be durable (or its failure raised) before the next.
        self._background.wait(reason=f"save of step {step}")
        context = HandlerContext(
            step=step,
            items=dict(items),
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            collective=self._dist,
        )
        # A preemption save is synchronous: the job is about to exit inside its grace period.
        if self._options.async_save and not self._preempted:
            snapshots = self._stage(handlers, items, context)
            if snapshots is not None:
                job = self._save_job(step, handlers, snapshots, context, metric_values)
                self._background.submit(step, job)
                return True
        self._save_job(step, handlers, items, context, metric_values, dist=self._dist)()
        return True

    def _stage(
        self, handlers: Mapping[str, Handler], items: Mapping[str, Any], context: HandlerContext
    ) -> dict[str, Any] | None:
        """Snapshots of every item for a background save, or None if a handler can't stage."""
        for name, handler in handlers.items():
            if not isinstance(handler, StagingHandler):
                if name not in self._warned_no_staging:
                    self._warned_no_staging.add(name)
                    logger.warning(
                        "async_save: handler %r of item %r has no stage(); saving synchronously",
                        handler.name,
                        name,
                    )
                return None
        staged: dict[str, Any] = {}
        for name, handler in handlers.items():
            assert isinstance(handler, StagingHandler)
            staged[name] = handler.stage(items[name], context)
        return staged

    def _save_job(
        self,
        step: int,
        handlers: Mapping[str, Handler],
        items: Mapping[str, Any],
        context: HandlerContext,
        metrics: dict[str, float],
        *,
        dist: Collective | None = None,
    ) -> Callable[[], None]:
        """The write + commit + retention of one step, to run now or on the background thread."""
        collective = dist if dist is not None else self._background_dist
        # Handlers agree on their files over the same group as the commit they run inside.
        context = dataclasses.replace(context, collective=collective)

        def write_items(tmp: Path) -> dict[str, ItemMetadata]:
            written = {}
            for name, handler in handlers.items():
                item_dir = tmp / name
                item_dir.mkdir(exist_ok=True)  # every rank may create it on a shared filesystem
                info = handler.save(item_dir, items[name], context)
                written[name] = ItemMetadata(handler=handler.name, info=dict(info or {}))
            return written

        def build_metadata(
            written: dict[str, ItemMetadata], files: dict[str, FileMetadata]
        ) -> StepMetadata:
            return StepMetadata(
                step=step,
                time=self._clock(),
                items=written,
                metrics=metrics,
                world_size=collective.world_size,
                files=files,
                orbit_pt_version=_version.__version__,
            )

        def job() -> None:
            self._store.commit(step, write_items, build_metadata, dist=collective)
            self._warn_if_unranked(step, metrics)
            self._apply_retention(collective)

        return job

    def delete(self, step: int) -> None:
        """Delete a committed step (renamed away first, so it is never listed half-deleted)."""
        self._check_open()
        if self._options.read_only:
            raise ReadOnlyError(f"this manager opened {self.directory} read-only; cannot delete")
        self._background.wait(reason=f"delete of step {step}")
        self._store.metadata(_check_step(step))
        self._store.delete([step], dist=self._dist)

    def wait_until_finished(self) -> None:
        """Block until a save in flight is committed; re-raise its failure, if any."""
        self._background.wait()

    # ------------------------------------------------------------------------------- restoring

    def restore(
        self,
        step: int | None = None,
        items: Mapping[str, Any] | Sequence[str] | None = None,
        *,
        verify: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``step`` (default: the latest).

        Args:
            step: a committed step, or None for the latest.
            items: ``{name: live object}`` to load in place (modules, optimizers, objects with
                ``load_state_dict``, dicts of tensors); a value of None, or a sequence of names,
                returns that item's saved state instead. None restores every item as plain
                state. A subset of the saved items is fine.
            verify: read the restored items' files in full first and check them against the
                checksums recorded at commit; default ``options.verify_on_restore``. Sizes are
                always checked.

        Raises:
            CorruptCheckpointError: a file is missing, truncated, or (with ``verify``) its
                bytes changed since the commit; the message names the file and the step.

        Returns:
            name -> the loaded object (in place) or its saved state.
        """
        self._check_open()
        self._background.wait(reason="restore")
        step = self._resolve_step(step)
        meta = self._store.metadata(step)
        targets = self._targets(step, meta, items)
        if verify is None:
            verify = self._options.verify_on_restore
        self._store.check_files(step, meta, checksums_of=targets if verify else ())
        context = HandlerContext(
            step=step,
            items=targets,
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            saved_world_size=meta.world_size,
            collective=self._dist,
        )
        total = sum(f.size for rel, f in meta.files.items() if rel.split("/")[0] in targets)
        with _progress.showing(f"restoring step {step}", total, primary=self._dist.is_primary):
            return self._restore_items(step, meta, targets, context)

    def _restore_items(
        self, step: int, meta: StepMetadata, targets: dict[str, Any], context: HandlerContext
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, target in targets.items():
            handler = self._handler_for_restore(step, name, meta.items[name])
            item_dir = self._store.step_path(step) / name
            try:
                out[name] = handler.restore(item_dir, target, context)
            except CheckpointError:
                raise
            except OSError as exc:
                raise CorruptCheckpointError(
                    f"reading item {name!r} of step {step} from {item_dir} failed: {exc}"
                ) from exc
        return out

    # ------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Finish any save in flight and release the root's lock. Safe to call twice."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            self._preemption.close()
            self._store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, steps={self._store.steps()})"

    # --------------------------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(
                f"this CheckpointManager for {self.directory} is closed; open a new one"
            )

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            latest = self.latest_step()
            if latest is None:
                self._store.metadata(None)  # raises StepNotFoundError with the root named
            assert latest is not None
            return latest
        return _check_step(step)

    def _infos(self) -> list[CheckpointInfo]:
        return [
            CheckpointInfo(step=s, time=m.time, metrics=m.metrics)
            for s, m in self._store.committed().items()
        ]

    def _apply_retention(self, dist: Collective) -> None:
        if self._retention is None:
            return
        infos = self._infos()
        if not infos:
            return
        keep = set(self._retention.keep(infos)) | {infos[-1].step}
        # Rank 0 decides, so that a policy that is not deterministic still deletes the same
        # steps from every rank's view.
        doomed = dist.broadcast([info.step for info in infos if info.step not in keep])
        if not doomed:
            return
        logger.info("retention: deleting step(s) %s from %s", doomed, self.directory)
        try:
            self._store.delete(doomed, dist=dist)
        except (CheckpointError, OSError) as exc:
            # The new step is committed: failing save() for it would tell the loop its step is
            # lost. A step not deleted stays listed and retention tries again after the next
            # save; a half-removed one is out of the step namespace and is cleaned at open.
            logger.error(
                "retention could not delete step(s) %s from %s: %s; it will retry after the "
                "next save",
                doomed,
                self.directory,
                exc,
            )

    def _warn_if_unranked(self, step: int, metrics: Mapping[str, float]) -> None:
        missing = sorted({rule.metric for rule in self._ranking if rule.metric not in metrics})
        if not missing or self._warned_unranked:
            return
        self._warned_unranked = True
        logger.warning(
            "step %d in %s was saved without metric %s, so best-n retention cannot rank it and "
            "keeps it; pass metrics={%r: ...} to save() (logged once)",
            step,
            self.directory,
            ", ".join(map(repr, missing)),
            missing[0],
        )

    def _handlers_for_save(self, items: Mapping[str, Any]) -> dict[str, Handler]:
        if not isinstance(items, Mapping):
            raise CheckpointTypeError(
                f"items must be a mapping of item name -> object, got {type(items).__name__}; "
                'e.g. {"model": model, "optimizer": optimizer}'
            )
        if not items:
            raise CheckpointValueError("items is empty; give at least one item to save")
        chosen: dict[str, Handler] = {}
        for name, item in items.items():
            _layout.check_item_name(name)
            handler = self._handlers.get(name)
            if handler is None:
                # Reuse the default handler of this item from the previous save, so that its
                # staging buffers are reused and async saves do not grow memory.
                fresh = default_handler(item, item_name=name)
                cached = self._default_handlers.get(name)
                handler = cached if type(cached) is type(fresh) else fresh
                self._default_handlers[name] = handler
            chosen[name] = handler
        return chosen

    def _handler_for_restore(self, step: int, name: str, saved: ItemMetadata) -> Handler:
        configured = self._handlers.get(name)
        if configured is not None:
            if configured.name != saved.handler:
                raise CheckpointValueError(
                    f"item {name!r} of step {step} was saved by handler {saved.handler!r}, but "
                    f"handlers[{name!r}] is {configured.name!r}; configure a {saved.handler!r} "
                    "handler for it, or restore without one"
                )
            return configured
        handler = handler_by_name(saved.handler)
        if handler is None:
            raise CheckpointValueError(
                f"item {name!r} of step {step} was saved by handler {saved.handler!r}, which is "
                f"not built in; pass CheckpointManager(..., handlers={{{name!r}: ...}}) with it"
            )
        return handler

    def _targets(
        self, step: int, meta: StepMetadata, items: Mapping[str, Any] | Sequence[str] | None
    ) -> dict[str, Any]:
        if items is None:
            return dict.fromkeys(meta.items)
        if isinstance(items, Mapping):
            targets = dict(items)
        elif isinstance(items, Sequence) and not isinstance(items, (str, bytes)):
            targets = dict.fromkeys(items)
        else:
            raise CheckpointTypeError(
                "items must be a mapping of name -> object to load into, or a sequence of item "
                f"names, got {type(items).__name__}"
            )
        missing = [name for name in targets if name not in meta.items]
        if missing:
            raise ItemNotFoundError(
                f"step {step} under {self.directory} has no item(s) {missing}; it holds "
                f"{sorted(meta.items)}"
            )
        return targets


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointTypeError(
            f"step must be an int, got {step!r} ({type(step).__name__}); pass int(step)"
        )
    if step < 0:
        raise CheckpointValueError(f"step must be >= 0, got {step}")
    return step
