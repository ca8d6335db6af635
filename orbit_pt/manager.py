"""``CheckpointManager``: when to save, atomic commits of steps, and what retention keeps."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from orbit_pt import _version
from orbit_pt._control.background import BackgroundSaver
from orbit_pt._control.collective import AgreedError, Collective, PeerError
from orbit_pt._control.preemption import PreemptionWatcher
from orbit_pt._control.preemption_agreement import PreemptionAgreement
from orbit_pt._format import progress as _progress
from orbit_pt._format import remote_files as _remote_files
from orbit_pt._format import safe_open as _safe_open
from orbit_pt._format.remote_files import RemoteFile
from orbit_pt._storage import fs as _fs
from orbit_pt._storage import layout as _layout
from orbit_pt._storage import verifiers as _verifiers
from orbit_pt._storage.remote import open_root
from orbit_pt._storage.store import StepStore
from orbit_pt._tiers.local_tier import LocalPlan, LocalTier
from orbit_pt._tiers.shard import check_target as check_local_target
from orbit_pt.errors import (
    CheckpointError,
    CheckpointSaveError,
    CheckpointTypeError,
    CheckpointValueError,
    CorruptCheckpointError,
    ItemNotFoundError,
    PreemptionExit,
    ReadOnlyError,
    StepNotFoundError,
)
from orbit_pt.handlers import Handler, HandlerContext, default_handler, handler_by_name
from orbit_pt.handlers.base import (
    FieldsHandler,
    RangeReadingHandler,
    StagingHandler,
    per_rank_error,
)
from orbit_pt.metadata import FileMetadata, ItemMetadata, StepMetadata, validate_metrics
from orbit_pt.options import CheckpointManagerOptions, timeout_of
from orbit_pt.policies import CheckpointInfo
from orbit_pt.retention import RetentionDecision, decide, record

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class CheckpointManager:
    """Saves and restores the steps of one training run under a root folder.

    Args:
        directory: the root folder; created when missing (unless ``read_only``).
        options: when to save and what to keep; defaults save every step and keep every step.
        handlers: item name -> handler, for items whose default handler (chosen by type) is not
            what you want.
        clock: seconds since the epoch, for the commit time recorded in each step. Tests pass a
            fake clock; leave it alone otherwise.
        storage_options: for an object-store root (``directory`` like ``"s3://bucket/prefix"``):
            keyword arguments for the object-store client (credentials, endpoint, ...), plus
            orbit_pt's own ``cache_dir`` (the local mirror), ``lease_seconds`` and
            ``takeover``. See docs/object-storage.md.

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
        storage_options: Mapping[str, Any] | None = None,
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
        self._close_lock = threading.Lock()
        # Default handlers are kept per item name, so their staging buffers are reused.
        self._default_handlers: dict[str, Handler] = {}
        # A writer's collective is collective to create (every rank constructs its manager at
        # the same point); a read-only manager's never talks to other ranks, so an evaluator may
        # open one on rank 0 alone.
        self._dist = (
            Collective.local()
            if self._options.read_only
            else Collective(timeout=timeout_of(self._options))
        )
        # The background commit talks over a gloo group of its own, so that its agreements never
        # interleave with the training thread's (preemption checks, plans, sync saves).
        self._background_dist = (
            self._dist.new_group()
            if self._options.async_save and self._dist.enabled
            else self._dist
        )
        # The local tier's background saves get a group (and a thread) of their own too, so
        # that a local save never waits for a persistent upload in flight, nor the reverse.
        self._local_dist = (
            self._dist.new_group()
            if self._options.async_save and self._options.local is not None
            else self._dist
        )
        self._local: LocalTier | None = None
        with contextlib.ExitStack() as undo:  # a manager that fails to open releases everything
            undo.callback(self._dist.close)
            undo.callback(self._background_dist.close)
            undo.callback(self._local_dist.close)
            local, remote = open_root(directory, storage_options)
            self._store = StepStore(
                local, read_only=self._options.read_only, dist=self._dist, remote=remote
            )
            undo.callback(self._store.close)
            self._background = BackgroundSaver(self._store.root)
            local_options = self._options.local
            if local_options is not None:
                self._local = LocalTier(
                    Path(local_options.root),
                    self._run_id(),
                    replicas=local_options.replicas,
                    keep_last_n=local_options.keep_last_n,
                    dist=self._dist,
                )
            self._local_background = BackgroundSaver(
                self._local.root if self._local is not None else self._store.root
            )
            self._preemption = PreemptionWatcher(
                () if self._options.read_only else self._options.preemption_signals
            )
            undo.pop_all()
        self._agreement = PreemptionAgreement(
            self._preemption,
            self._dist,
            watched=bool(self._options.preemption_signals) and not self._options.read_only,
        )
        # The step saved once the preemption was agreed; a later save() ends the process.
        self._preemption_saved: int | None = None
        self._last_restore: RestoreInfo | None = None

    # ------------------------------------------------------------------------------- discovery

    @property
    def directory(self) -> Path:
        """The root folder."""
        return self._store.root

    def all_steps(self, tier: str | None = None) -> list[int]:
        """Every committed step, ascending; ``[]`` when there is none.

        With a local tier (``CheckpointManagerOptions.local``): ``tier="persistent"`` lists
        the root's steps, ``tier="local"`` the steps recoverable from the surviving local
        roots and replicas, and the default both. Listing the local tier is collective: call
        it on every rank.
        """
        if tier not in (None, "local", "persistent"):
            raise CheckpointValueError(f"tier must be None, 'local' or 'persistent', got {tier!r}")
        if tier == "persistent" or (tier is None and self._local is None):
            return self._store.steps()
        local = sorted(self._local_plans()) if self._local is not None else []
        if tier == "local":
            return local
        return sorted(set(local) | set(self._store.steps()))

    def latest_step(self) -> int | None:
        """The newest committed step, or None.

        With a local tier: the newest step recoverable from either tier, the same on every
        rank (collective: call it on every rank).
        """
        steps = self.all_steps() if self._local is not None else self._store.steps()
        return steps[-1] if steps else None

    def _local_plans(self, asked: int | None = None) -> dict[int, LocalPlan]:
        """The recoverable local steps (collective); ``asked``: the step every rank must ask."""
        assert self._local is not None
        self._check_open()
        try:
            return self._local.list_recoverable(self._dist, asked=asked)
        except (AgreedError, PeerError) as exc:
            raise CheckpointError(f"listing the local tier failed: {exc}") from exc

    def _run_id(self) -> str:
        """This run's id, kept in the persistent root (created by its first writer)."""

        def read_or_create() -> str:
            if not self._dist.is_primary:
                return ""
            name = _layout.RUN_ID_FILE
            path = self._store.root / name
            remote = self._store.remote
            # An object store's own copy only: a mirror's may outlive a deleted prefix.
            data = remote.get_root_file(name) if remote is not None else None
            if remote is None and path.is_file():
                data = path.read_bytes()
            if data is not None:
                return data.decode().strip()
            run_id = uuid.uuid4().hex
            tmp = path.with_name(name + ".tmp")
            tmp.unlink(missing_ok=True)
            _fs.write_file_durably(tmp, run_id.encode())
            _fs.replace_durably(tmp, path)
            if remote is not None:
                remote.put_root_file(self._store.root, name)
            return run_id

        _, shared = self._dist.agree(
            "orbit_pt.local.run_id", read_or_create, label="reading the run id", share=str
        )
        return str(shared[0])

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
        """The committed folder of ``step`` (e.g. for ``from_pretrained(step_dir / "model")``).

        Persistent steps only: a step saved only to the local tier has no Hugging Face folder.
        """
        _check_step(step)
        if self._local is not None and step not in self._store.steps():
            raise StepNotFoundError(
                step,
                self.directory,
                self._store.steps(),
                detail="a step saved only to the local tier has no folder: its shards are "
                "per rank; restore it, or save it to the persistent tier",
            )
        self._store.metadata(step)
        return self._store.step_path(step)

    def metadata(self, step: int | None = None) -> StepMetadata:
        """What was recorded about ``step`` (default: the latest) when it was committed."""
        return self._store.metadata(self._resolve_step(step))

    def reload(self) -> None:
        """Re-read the root, e.g. in a read-only manager to see steps committed since it opened.

        Waits for a save in flight first, so that a commit is never lost from the view. On a
        writing manager under torch.distributed this is collective (rank 0 scans, every rank
        takes its view): call it on every rank.
        """
        self._check_open()
        self._wait_all(reason="reload")
        self._store.rescan()

    # ---------------------------------------------------------------------------------- saving

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a save step (interval, listed steps, custom policy, preemption).

        Always False on a read-only manager, which cannot save. Collective under
        torch.distributed (it asks :meth:`reached_preemption`).
        """
        _check_step(step)
        if self._options.read_only:
            return False
        persistent, local = self._due(step)
        return persistent or local

    def _due(self, step: int) -> tuple[bool, bool]:
        """Whether ``step`` is a save step of the persistent tier and of the local tier."""
        preempted = self.reached_preemption(step)
        local_options = self._options.local
        if local_options is None:
            return self._save_policy.should_save(step, preempted=preempted), False
        if preempted:  # the preemption save is one save, to the tier the options name
            if local_options.preemption_tier == "local":
                return False, True
            return True, False
        persistent = self._save_policy.should_save(step, preempted=False)
        return persistent, step % local_options.save_interval_steps == 0

    def reached_preemption(self, step: int) -> bool:
        """Whether the job was asked to stop by a preemption signal, agreed by every rank.

        Under torch.distributed this is collective (unless no preemption signal is watched):
        call it at the same point of every rank's loop. Every rank gets the same answer at the
        same step, so the preemption save that follows is one save on all ranks. Once True it
        stays True. It does not wait for the other ranks: each check starts an all-reduce of
        the flag that the next check reads, so a signal is acted on at the check after the one
        that first sees it (on one process, at once). Asking again for the same step gives the
        same answer.

        Raises:
            CheckpointError: another rank's process left while the last check was in flight.
        """
        _check_step(step)
        return self._agreement.check(step)

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

        Under torch.distributed every rank calls ``save`` for the same step; the save is one
        agreement per phase (plan, stage, write, finish: see docs/protocol.md), so a failure
        on any rank raises on every rank, naming the rank, and commits nothing. The recorded
        ``metrics`` are rank 0's; a non-finite metric on any rank fails the save everywhere.

        With a local tier (``CheckpointManagerOptions.local``) the step goes to each tier whose
        cadence it is on (``force`` saves to the persistent tier, and to the local one on its
        cadence); the local save is its own agreements (docs/multi-tier.md) and, with
        ``async_save``, runs on a background lane of its own.

        Preemption: once every rank agreed that the job is being preempted, the next save is
        the preemption save (synchronous; with a local tier it goes to
        ``LocalTierOptions.preemption_tier``, after both lanes have finished). If the loop
        calls ``save`` again after it instead of stopping (``reached_preemption``), the
        process ends with :class:`PreemptionExit`
        (a ``SystemExit`` with ``options.preemption_exit_code``; ``finally`` blocks and
        context managers run). Saving the preemption step itself again returns False.

        Raises:
            CheckpointSaveError: writing failed; nothing of ``step`` was committed and earlier
                steps are untouched (unless a rollback had begun moving them into
                ``superseded/``: the error then names them and the steps now committed). The
                cause is chained. With ``async_save``, a failure of the previous background
                save is raised here (and this step is not saved).
            StepNotDurableError: a ``CheckpointSaveError`` whose step *is* committed: only the
                fsync after the commit's rename failed (docs/reliability.md).
            PreemptionExit: see above.
        """
        self._check_open()
        _check_step(step)
        if self._options.read_only:
            raise ReadOnlyError(
                f"this manager opened {self.directory} read-only; it cannot save step {step}. "
                "Open it without read_only=True (only one writer per root)"
            )
        if self._preemption_saved is not None:
            if step == self._preemption_saved:
                return False
            raise PreemptionExit(self._options.preemption_exit_code, step, self._preemption_saved)
        if force:
            persistent, local = True, False
            if self._options.local is not None:
                local = step % self._options.local.save_interval_steps == 0
        else:
            persistent, local = self._due(step)
            if not (persistent or local):
                return False
        # A lane's save that already failed is raised now, whichever tier this step goes to.
        self._background.raise_failure()
        self._local_background.raise_failure()
        preemption = self._agreement.agreed
        if preemption:  # both lanes finish first; the preemption save is synchronous
            self._wait_all(reason=f"preemption save of step {step}")
        start_local = None
        if local:
            start_local = self._stage_local(step, items, metrics, synchronous=preemption)
            if not persistent:
                start_local()
                if preemption:
                    self._preemption_saved = step
                return True
        # The previous async save must be durable (or its failure raised) before the next, and
        # before staging reuses its buffers. Its outcome was agreed by every rank.
        self._background.wait(reason=f"save of step {step}")
        context = HandlerContext(
            step=step,
            items=dict(items) if isinstance(items, Mapping) else {},
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            collective=self._dist,
            shared_files=self._store.remote is None,
        )
        try:
            handlers, metric_values = self._plan(step, items, metrics)
            # A preemption save is synchronous: the job is about to exit inside its grace period.
            staged = None
            if self._options.async_save and not preemption:
                staged = self._stage(handlers, items, context)
        except (AgreedError, PeerError) as exc:
            raise CheckpointSaveError(step, self.directory, str(exc)) from exc
        if start_local is not None:
            # Started after the persistent staging: a local write running beside that copy
            # would slow the copy the training loop waits for.
            start_local()
        if staged is not None:
            job = self._save_job(step, handlers, staged, context, metric_values)
            self._background.submit(step, job)
        else:
            self._save_job(step, handlers, items, context, metric_values, dist=self._dist)()
        if preemption:
            self._preemption_saved = step
        return True

    def _stage_local(
        self,
        step: int,
        items: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        *,
        synchronous: bool,
    ) -> Callable[[], None]:
        """Stage ``step`` for the local tier; the returned call writes it (now, or on the
        local lane with ``async_save``)."""
        assert self._local is not None
        local = self._local
        asynchronous = self._options.async_save and not synchronous
        # Only the previous local save: a persistent upload in flight is not waited for.
        self._local_background.wait(reason=f"local save of step {step}")
        try:
            self._plan(step, items, metrics)
            staged, _ = self._dist.agree(
                "orbit_pt.local.stage",
                lambda: local.capture(items, stage=asynchronous),
                label=f"staging local step {step}",
            )
        except (AgreedError, PeerError) as exc:
            raise CheckpointSaveError(step, local.root, str(exc)) from exc

        def newest_persistent() -> int | None:
            steps = self._store.steps()
            return steps[-1] if steps else None

        def job(dist: Collective) -> None:
            try:
                local.save(step, staged, dist, newest_persistent=newest_persistent)
            except (AgreedError, PeerError) as exc:
                raise CheckpointSaveError(step, local.root, str(exc)) from exc

        def start() -> None:
            if asynchronous:
                self._local_background.submit(step, lambda: job(self._local_dist))
            else:
                job(self._dist)

        return start

    def _wait_all(self, *, reason: str | None = None) -> None:
        """Wait for both lanes (persistent, local); the first failure is raised after both."""
        try:
            self._background.wait(reason=reason)
        finally:
            self._local_background.wait(reason=reason)

    def _plan(
        self, step: int, items: Mapping[str, Any], metrics: Mapping[str, Any] | None
    ) -> tuple[dict[str, Handler], dict[str, float]]:
        """The plan phase, agreed: validate the inputs on every rank and choose the handlers.

        Returns the handlers and the metrics to record (rank 0's).
        """

        def plan() -> tuple[dict[str, Handler], dict[str, float]]:
            return self._handlers_for_save(items), validate_metrics(metrics, step=step)

        (handlers, _), shared = self._dist.agree(
            "orbit_pt.save.plan",
            plan,
            label=f"planning the save of step {step}",
            # Handler names, not only item names: ranks whose items differ in kind would
            # otherwise split into an async save on one rank and a sync save on another.
            share=lambda result: [step, {n: h.name for n, h in result[0].items()}, result[1]],
        )
        steps = [s for s, _, _ in shared]
        names = [n for _, n, _ in shared]
        if len(set(steps)) > 1 or any(n != names[0] for n in names):
            detail = "; ".join(
                f"rank {rank}: step {s}, items {sorted(n.items())}"
                for rank, (s, n, _) in enumerate(shared)
            )
            raise CheckpointSaveError(
                step,
                self.directory,
                f"the ranks are saving different steps or items ({detail}); every rank must "
                "call save() with the same step and the same items (names and kinds)",
            )
        recorded = shared[0][2]
        for rank, (_, _, theirs) in enumerate(shared[1:], start=1):
            if theirs != recorded:
                logger.debug(
                    "step %d: rank %d's metrics %s differ from rank 0's %s; rank 0's are recorded",
                    step,
                    rank,
                    theirs,
                    recorded,
                )
        return handlers, {name: float(value) for name, value in recorded.items()}

    def _stage(
        self, handlers: Mapping[str, Handler], items: Mapping[str, Any], context: HandlerContext
    ) -> dict[str, Any] | None:
        """Snapshots of every item for a background save, or None to save synchronously.

        Agreed: staging fails on every rank if it fails on one (e.g. a pinned-memory
        allocation). Every rank makes the same sync/async choice, because the plan phase
        agreed on the handlers.
        """
        if not all(isinstance(handler, StagingHandler) for handler in handlers.values()):
            for name, handler in handlers.items():
                if not isinstance(handler, StagingHandler) and name not in self._warned_no_staging:
                    self._warned_no_staging.add(name)
                    logger.warning(
                        "async_save: handler %r of item %r has no stage(); saving synchronously",
                        handler.name,
                        name,
                    )
            return None

        def stage() -> dict[str, Any]:
            staged: dict[str, Any] = {}
            for name, handler in handlers.items():
                assert isinstance(handler, StagingHandler)
                staged[name] = handler.stage(items[name], context)
            return staged

        snapshots, _ = self._dist.agree(
            "orbit_pt.save.stage", stage, label=f"staging step {context.step}"
        )
        return snapshots

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
        """Delete a committed step (renamed away first, so it is never listed half-deleted).

        Raises:
            StepNotFoundError: ``step`` is not committed.
            CheckpointError: it could not be renamed away; the message names the steps
                committed now. (Once renamed, it is deleted: a failure to remove its files is
                logged, and the next writer to open the root removes them.)
        """
        self._check_open()
        if self._options.read_only:
            raise ReadOnlyError(f"this manager opened {self.directory} read-only; cannot delete")
        self._background.wait(reason=f"delete of step {step}")
        self._store.metadata(_check_step(step))
        self._store.delete([step], dist=self._dist)

    def apply_retention(self, *, dry_run: bool = False) -> list[RetentionDecision]:
        """Apply the retention policy now, as after a save: delete the steps it does not keep.

        The kept set is the union of what each retention rule keeps, plus the latest committed
        step, always (docs/retention.md); with no retention option, every step is kept.

        Args:
            dry_run: decide only; delete nothing (allowed on a read-only manager).

        Returns:
            One decision per committed step (ascending): kept or not, and by which rules.

        Raises:
            ReadOnlyError: a read-only manager without ``dry_run``.
            CheckpointError: a deletion failed. The other steps were still deleted; the
                message names the steps not deleted (they stay listed) and the steps committed
                now, as re-read from the root.

        On a writing manager under torch.distributed this is collective (rank 0 decides, every
        rank gets its decisions, the deletion is agreed): call it on every rank.
        """
        self._check_open()
        if self._options.read_only and not dry_run:
            raise ReadOnlyError(
                f"this manager opened {self.directory} read-only; it cannot delete steps. Use "
                "apply_retention(dry_run=True) to see what retention keeps"
            )
        self._background.wait(reason="apply_retention")
        return self._apply_retention(self._dist, dry_run=dry_run, after_save=False)

    def wait_until_finished(self) -> None:
        """Block until a save in flight is committed; re-raise its failure, if any.

        Safe from any thread. A background failure is raised to every thread that waits, and
        stays pending until the thread that called ``save`` has received it too. With a local
        tier, waits for the saves in flight of both tiers.
        """
        self._wait_all()

    def is_saving_in_progress(self) -> bool:
        """Whether an async save (of either tier) is being written in the background now."""
        return self._background.is_saving() or self._local_background.is_saving()

    # ------------------------------------------------------------------------------- restoring

    @property
    def last_restore(self) -> RestoreInfo | None:
        """What the last successful :meth:`restore` did, or None before the first.

        The step, the items restored, the items asked for that the step does not hold
        (``missing_ok=True``) and the ``exclude`` entries left out -- the same on every rank.
        """
        return self._last_restore

    def restore(
        self,
        step: int | None = None,
        items: Mapping[str, Any] | Sequence[str] | None = None,
        *,
        exclude: Sequence[str] = (),
        missing_ok: bool = False,
        verify: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``step`` (default: the latest).

        Args:
            step: a committed step, or None for the latest.
            items: ``{name: live object}`` to load in place (modules, optimizers, objects with
                ``load_state_dict``, dicts of tensors); a value of None, or a sequence of names,
                returns that item's saved state instead. None restores every item as plain
                state. A subset of the saved items is fine.
            exclude: items (``"optimizer"``) and fields of items (``"recipe.rng"``: a field of a
                :class:`~orbit_pt.RecipeState`, a top-level key of a dict or of a
                ``state_dict()``) to leave out: they keep their live values and are not in the
                result. Every entry must name an item or field that the step holds (with
                ``missing_ok``, an item it lacks is fine too). On another world size than the
                step was saved with, every per-rank field (RNG, a data loader's position) must
                be excluded (docs/elastic.md).
            missing_ok: items asked for that the step does not hold (e.g. a model-only seed
                step restored into ``{model, optimizer, recipe}``) are left as they are, with
                a WARNING, instead of raising :class:`ItemNotFoundError`. They are not in the
                result; :attr:`last_restore` lists them under ``missing``.
            verify: read the restored items' files in full first and check them against the
                checksums recorded at commit; default ``options.verify_on_restore``. Sizes are
                always checked. Under torch.distributed (a writing manager) the large
                ``.safetensors`` files are split between the ranks, each checked once by one
                of them, and a failed check on any rank fails the restore on every rank before
                anything is loaded.

        Raises:
            ItemNotFoundError: an item asked for is not in the step (and not ``missing_ok``).
            CheckpointValueError: an ``exclude`` entry names no item or field of the step, or
                a field of an item that has none (a model: exclude it whole).
            StateMismatchError: a target does not fit its saved state; or, on another world
                size, a per-rank field is not excluded -- the message names each one and the
                ``exclude=(...)`` that accepts it.
            CorruptCheckpointError: a file is missing, truncated, or (with ``verify``) its
                bytes changed since the commit; the message names the file and the step.

        Everything but the loading itself is checked first, on every rank, before any item is
        loaded. Under torch.distributed the checks and then the loading are each one
        agreement: a failure on any rank raises on every rank (docs/protocol.md).

        Returns:
            name -> the loaded object (in place) or its saved state, for each item restored.
        """
        self._check_open()
        self._wait_all(reason="restore")
        if verify is None:
            verify = self._options.verify_on_restore
        if self._local is None:
            return self._restore_persistent(step, items, exclude, missing_ok, verify)
        if step is not None:
            _check_step(step)
        plans = self._local_plans(asked=step)
        if step is not None:
            if step in plans:  # a named step never falls back: its failure is raised
                out = self._restore_local(plans[step], items, exclude, missing_ok, skipped=None)
                assert out is not None
                return out
            return self._restore_persistent(step, items, exclude, missing_ok, verify)
        skipped: list[tuple[int, str]] = []
        persistent = set(self._store.steps())
        for candidate in sorted(set(plans) | persistent, reverse=True):
            if candidate in plans:
                out = self._restore_local(
                    plans[candidate], items, exclude, missing_ok, skipped=skipped
                )
                if out is not None:
                    return out
            if candidate in persistent:
                return self._restore_persistent(
                    candidate, items, exclude, missing_ok, verify, skipped=skipped
                )
        if skipped:
            raise CorruptCheckpointError(
                f"no step could be restored: every local step failed its checks "
                f"({'; '.join(f'step {s}: {why}' for s, why in skipped)}) and {self.directory} "
                "holds no persistent step"
            )
        raise StepNotFoundError(None, self.directory, [])

    def _restore_local(
        self,
        plan: LocalPlan,
        items: Mapping[str, Any] | Sequence[str] | None,
        exclude: Sequence[str],
        missing_ok: bool,
        *,
        skipped: list[tuple[int, str]] | None,
    ) -> dict[str, Any] | None:
        """Restore a recoverable local step: fetch what is missing, verify, then load.

        With ``skipped`` (a restore of the newest step), a failure to fetch or verify on any
        rank skips the step on every rank: it is appended there and None is returned.
        Otherwise it is raised.
        """
        local = self._local
        assert local is not None
        step = plan.step
        label = f"restoring local step {step}"
        entries = _exclude_entries(exclude)

        def check() -> tuple[list[tuple[int, int]], dict[str, Any], dict[str, Any], Any]:
            fetched = local.fetch(plan, self._dist)
            layout = local.verify(
                plan, checked=any(shard == self._dist.rank for shard, _ in fetched)
            )
            wanted = dict.fromkeys(layout) if items is None else self._wanted(items, None)
            whole, fields = self._split_exclude(
                step, list(layout), wanted, entries, missing_ok=missing_ok
            )
            missing = [name for name in wanted if name not in layout and name not in whole]
            if missing and not missing_ok:
                raise ItemNotFoundError(
                    f"local step {step} has no item(s) {missing}; it holds {sorted(layout)}. "
                    "Pass missing_ok=True to restore what it holds"
                )
            targets = {n: t for n, t in wanted.items() if n in layout and n not in whole}
            for name in fields:
                if name in layout and layout[name]["kind"] != "state":
                    raise CheckpointValueError(
                        f"exclude names field(s) {sorted(fields[name])} of item {name!r}, a "
                        f"{layout[name]['kind']} with no named fields; leave the whole item out "
                        f"with exclude=({name!r},)"
                    )
            for name, target in targets.items():
                check_local_target(name, layout[name]["kind"], target)
            chosen = {"targets": targets, "fields": fields, "missing": missing}
            return fetched, layout, chosen, wanted

        try:
            (_, layout, chosen, wanted), shared = self._agree_restore(
                "orbit_pt.local.verify",
                check,
                label,
                share=lambda r: [r[0], sorted(r[2]["missing"])],
                root=local.store.root,
            )
        except CheckpointError as exc:
            if skipped is None:
                raise
            reason = str(exc)
            skipped.append((step, reason))
            logger.warning("skipping local step %d: %s", step, reason)
            return None
        targets, fields = chosen["targets"], chosen["fields"]
        context = HandlerContext(
            step=step,
            items=wanted,
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            saved_world_size=self._dist.world_size,
        )

        def load() -> dict[str, Any]:
            return local.load(plan, layout, targets, fields, context)

        out, _ = self._agree_restore("orbit_pt.local.load", load, label, root=local.store.root)
        fetched = tuple(sorted((shard, source) for f in shared for shard, source in f[0]))
        self._last_restore = RestoreInfo(
            step=step,
            items=tuple(targets),
            missing=tuple(chosen["missing"]),
            excluded=tuple(entries),
            tier="local",
            fetched=fetched,
            skipped=tuple(skipped or ()),
        )
        if self._dist.is_primary:
            logger.info(
                "restored local step %d from %s%s",
                step,
                local.root,
                f" (shards fetched from peers: {list(fetched)})" if fetched else "",
            )
        return out

    def _restore_persistent(
        self,
        step: int | None,
        items: Mapping[str, Any] | Sequence[str] | None,
        exclude: Sequence[str],
        missing_ok: bool,
        verify: bool,
        *,
        skipped: Sequence[tuple[int, str]] = (),
    ) -> dict[str, Any]:
        label = "restore" if step is None else f"restoring step {step}"

        def check() -> _RestorePlan:
            return self._plan_restore(step, items, exclude, missing_ok=missing_ok, verify=verify)

        plan, shared = self._agree_restore(
            "orbit_pt.restore.plan",
            check,
            label,
            share=lambda p: [p.step, list(p.info.excluded), list(p.info.missing)],
        )
        _check_same_restore(shared)

        def load() -> dict[str, Any]:
            total = sum(
                f.size for rel, f in plan.meta.files.items() if rel.split("/")[0] in plan.targets
            )
            primary = self._dist.is_primary
            with _progress.showing(f"restoring step {plan.step}", total, primary=primary):
                return self._restore_items(plan)

        out, _ = self._agree_restore("orbit_pt.restore", load, label)
        self._last_restore = dataclasses.replace(plan.info, skipped=tuple(skipped))
        if self._dist.is_primary:
            if plan.info.missing:
                logger.warning(
                    "restored step %d from %s without item(s) %s, which it does not hold "
                    "(missing_ok=True): they keep their live values",
                    plan.step,
                    self.directory,
                    list(plan.info.missing),
                )
            if plan.info.excluded:
                logger.info(
                    "restored step %d from %s leaving out %s (exclude): they keep their live "
                    "values",
                    plan.step,
                    self.directory,
                    list(plan.info.excluded),
                )
        return out

    def _agree_restore(
        self,
        tag: str,
        fn: Callable[[], _T],
        label: str,
        *,
        share: Callable[[_T], Any] | None = None,
        root: Path | None = None,
    ) -> tuple[_T, list[Any]]:
        """One agreement of a restore: a rank that fails (a bad checksum, a mismatched model, a
        bad exclude) stops every rank, instead of letting the others train on from a state
        this rank does not have."""
        try:
            # No link below the root the restore reads from is followed.
            confined = _safe_open.confining(root or self._store.root, fn)
            return self._dist.agree(tag, confined, label=label, share=share)
        except AgreedError as exc:
            if exc.local is not None:
                # This rank's own error keeps its type (StateMismatchError, ...); the others'
                # are added to its message.
                if hasattr(exc.local, "add_note"):
                    exc.local.add_note(f"agreed by every rank: {exc}")
                raise exc.local from None
            raise

    def _plan_restore(
        self,
        asked: int | None,
        items: Mapping[str, Any] | Sequence[str] | None,
        exclude: Sequence[str],
        *,
        missing_ok: bool,
        verify: bool,
    ) -> _RestorePlan:
        """Everything a restore checks before it loads anything, on this rank."""
        step = self._resolve_step(asked)
        meta = self._store.metadata(step)
        wanted = self._wanted(items, meta)
        entries = _exclude_entries(exclude)
        whole, fields = self._split_exclude(
            step, list(meta.items), wanted, entries, missing_ok=missing_ok
        )
        missing = [name for name in wanted if name not in meta.items and name not in whole]
        if missing and not missing_ok:
            raise ItemNotFoundError(
                f"step {step} under {self.directory} has no item(s) {missing}; it holds "
                f"{sorted(meta.items)}. Pass missing_ok=True to restore what it holds and leave "
                "the others as they are (e.g. a model-only seed step)"
            )
        targets = {n: t for n, t in wanted.items() if n in meta.items and n not in whole}
        handlers = {n: self._handler_for_restore(step, n, meta.items[n]) for n in targets}
        context = HandlerContext(
            step=step,
            items=wanted,  # every live object, also those left out (the optimizer's model)
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            saved_world_size=meta.world_size,
            collective=self._dist,
        )
        # An object-store step: its small files into the local mirror, before the field checks
        # read the items; the tensors of the handlers that can are read by range while
        # loading. A verify reads every byte of the files it checks: downloaded whole, they
        # are split between the ranks when the restore is one agreement (_storage/verifiers.py).
        read = [*targets, *(n for n in fields if n not in targets)]
        by_range = [n for n in read if _reads_by_range(handlers.get(n))]
        checked_here: set[str] = set()
        checked_elsewhere: set[str] = set()
        if verify:
            checked_here, checked_elsewhere = self._split_verify(meta, targets, by_range)
            if not checked_elsewhere:
                by_range = []  # this rank checks every file: all of them downloaded
        remote = self._store.fetch(step, meta, read, by_range=by_range, checked_here=checked_here)
        with _remote_files.reading(remote):
            self._check_fields(step, meta, targets, whole, fields, entries, context)
        self._store.check_files(
            step,
            meta,
            items=read,
            checksums_of=targets if verify else (),
            # A private mirror's copy of such a file is not the one its checker read.
            checked_elsewhere=set() if self._store.scattered else checked_elsewhere,
            remote=remote,
        )
        info = RestoreInfo(
            step=step, items=tuple(targets), missing=tuple(missing), excluded=tuple(entries)
        )
        return _RestorePlan(step, meta, targets, handlers, fields, context, info, remote)

    def _split_verify(
        self, meta: StepMetadata, targets: Mapping[str, Any], by_range: Sequence[str]
    ) -> tuple[set[str], set[str]]:
        """The files this rank checks in full for a verifying restore, and those another rank
        checks (the range-read ``.safetensors`` of the targets, when the restore is one
        agreement over several ranks; otherwise this rank checks everything itself)."""
        if not (self._dist.enabled and self._dist.world_size > 1):
            return set(), set()
        folders = tuple(f"{name}/" for name in by_range if name in targets)
        sizes = {
            rel: f.size
            for rel, f in meta.files.items()
            if rel.startswith(folders) and rel.endswith(".safetensors")
        }
        owners = _verifiers.assign(sizes, self._dist.world_size)
        here = {rel for rel, rank in owners.items() if rank == self._dist.rank}
        return here, set(owners) - here

    def _split_exclude(
        self,
        step: int,
        held: Sequence[str],
        wanted: Mapping[str, Any],
        entries: Sequence[str],
        *,
        missing_ok: bool,
    ) -> tuple[set[str], dict[str, set[str]]]:
        """The items left out whole, and the fields left out per item, of ``exclude``.

        An entry is an item when it is an item's name, else ``item.field`` for the longest
        item name it starts with (item names may hold dots).
        """
        known = [*held, *(name for name in wanted if name not in held)]
        whole: set[str] = set()
        fields: dict[str, set[str]] = {}
        for entry in entries:
            item, field = entry, ""
            if entry not in known:
                owners = [n for n in known if entry.startswith(f"{n}.") and len(entry) > len(n) + 1]
                if not owners:
                    raise CheckpointValueError(
                        f"exclude entry {entry!r} names no item of step {step} under "
                        f"{self.directory}, which holds {sorted(held)}; write 'item' to "
                        "leave an item out or 'item.field' for a field of one, e.g. 'recipe.rng'"
                    )
                item = max(owners, key=len)
                field = entry[len(item) + 1 :]
            if item not in held and not missing_ok:
                raise CheckpointValueError(
                    f"exclude entry {entry!r} names item {item!r}, which step {step} under "
                    f"{self.directory} does not hold (it holds {sorted(held)}); remove "
                    "it from exclude, or pass missing_ok=True"
                )
            if field:
                fields.setdefault(item, set()).add(field)
            else:
                whole.add(item)
        return whole, fields

    def _check_fields(
        self,
        step: int,
        meta: StepMetadata,
        targets: Mapping[str, Any],
        whole: set[str],
        fields: Mapping[str, set[str]],
        entries: Sequence[str],
        context: HandlerContext,
    ) -> None:
        """Every excluded field exists; on another world size, no per-rank state is restored.

        Raises before anything is loaded, naming every per-rank field and item at once.
        """
        resharded = meta.world_size != context.world_size
        names = [n for n in fields if n in meta.items]
        names += [n for n in targets if resharded and n not in fields]
        per_rank: dict[str, str] = {}
        for name in names:
            handler = self._handler_for_restore(step, name, meta.items[name])
            if not isinstance(handler, FieldsHandler):
                if name in fields:
                    raise CheckpointValueError(
                        f"exclude names field(s) {sorted(fields[name])} of item {name!r} of step "
                        f"{step}, but its handler {handler.name!r} has no named fields; leave "
                        f"the whole item out with exclude=({name!r},)"
                    )
                continue
            saved = handler.saved_fields(
                self._store.step_path(step) / name, targets.get(name), context
            )
            unknown = sorted(fields.get(name, set()) - set(saved.names))
            if unknown:
                raise CheckpointValueError(
                    f"exclude names field(s) {unknown} of item {name!r}, which step {step} under "
                    f"{self.directory} does not hold; its fields are {list(saved.names)}"
                )
            if name not in targets or name in whole:
                continue
            if saved.item_per_rank is not None:
                per_rank[name] = saved.item_per_rank
                continue
            skipped = fields.get(name, set())
            per_rank.update(
                (f"{name}.{field}", why)
                for field, why in saved.per_rank.items()
                if field not in skipped
            )
        if per_rank:
            raise per_rank_error(
                per_rank,
                [*entries, *per_rank],
                step=step,
                saved_world_size=meta.world_size,
                world_size=context.world_size,
            )

    def _restore_items(self, plan: _RestorePlan) -> dict[str, Any]:
        with _remote_files.reading(plan.remote):
            return self._restore_each(plan)

    def _restore_each(self, plan: _RestorePlan) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, target in plan.targets.items():
            item_dir = self._store.step_path(plan.step) / name
            context = dataclasses.replace(
                plan.context, exclude=frozenset(plan.fields.get(name, ()))
            )
            try:
                out[name] = plan.handlers[name].restore(item_dir, target, context)
            except CheckpointError:
                raise
            except OSError as exc:
                raise CorruptCheckpointError(
                    f"reading item {name!r} of step {plan.step} from {item_dir} failed: {exc}"
                ) from exc
        return out

    # ------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Finish any save in flight and release everything: the root's lock, the signal
        handlers, orbit_pt's process groups.

        Safe to call twice and from any thread; each resource is released even if releasing
        another fails. A background save's failure is raised after everything is released.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.ExitStack() as release:  # run in reverse order, each one regardless
            release.callback(self._store.close)
            release.callback(self._dist.close)
            release.callback(self._background_dist.close)
            release.callback(self._local_dist.close)
            release.callback(self._preemption.close)
            self._wait_all()

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
            # A background failure that another thread's close() raised is still owed to the
            # thread that saved: it gets that first.
            self._wait_all()
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

    def _apply_retention(
        self, dist: Collective, *, dry_run: bool = False, after_save: bool = True
    ) -> list[RetentionDecision]:
        decisions = decide(self._infos(), self._retention)
        if self._retention is not None and decisions and not dry_run:
            # Rank 0 decides, so that a policy that is not deterministic still deletes the same
            # steps from every rank's view.
            rows = dist.broadcast([[d.step, d.kept, list(d.kept_by)] for d in decisions])
            decisions = [RetentionDecision(step, kept, tuple(by)) for step, kept, by in rows]
            doomed = [d.step for d in decisions if not d.kept]
            if doomed:
                logger.info("retention: deleting step(s) %s from %s", doomed, self.directory)
                try:
                    self._store.delete(doomed, dist=dist, background=after_save)
                except (CheckpointError, OSError) as exc:
                    if not after_save:
                        raise
                    # The new step is committed: failing save() for it would tell the loop its
                    # step is lost. A step not deleted stays listed and retention tries again
                    # after the next save; a half-removed one is out of the step namespace and
                    # is cleaned at open.
                    logger.error(
                        "retention could not delete step(s) %s from %s: %s; it will retry "
                        "after the next save",
                        doomed,
                        self.directory,
                        exc,
                    )
        if not dry_run and not self._options.read_only and dist.is_primary:
            # After the deletions, so that the commit and retention renames come first.
            record(self.directory, self._options)
            self._store.publish_root_file(_layout.RETENTION_FILE)
        return decisions

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

    def _wanted(
        self, items: Mapping[str, Any] | Sequence[str] | None, meta: StepMetadata | None
    ) -> dict[str, Any]:
        """The items asked for, name -> live object (None: return the saved state)."""
        if items is None:
            assert meta is not None
            return dict.fromkeys(meta.items)
        if isinstance(items, Mapping):
            return dict(items)
        if isinstance(items, Sequence) and not isinstance(items, (str, bytes)):
            return dict.fromkeys(items)
        raise CheckpointTypeError(
            "items must be a mapping of name -> object to load into, or a sequence of item "
            f"names, got {type(items).__name__}"
        )


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """What a restore did: :attr:`CheckpointManager.last_restore`.

    Attributes:
        step: the step restored.
        items: the items loaded in place or returned, in the order asked.
        missing: items asked for that the step does not hold, left as they were
            (``restore(..., missing_ok=True)``; e.g. the optimizer of a model-only seed step).
        excluded: the ``exclude`` entries (items and ``item.field`` names), left out with
            their live values.
        tier: ``"persistent"`` (the root) or ``"local"`` (the node-local tier).
        fetched: for a local restore, ``(rank, peer)`` for each rank whose own shard was not on
            its node and was copied from ``peer``'s node (a lost node, a replaced node).
        skipped: ``(step, reason)`` for each newer step that ``restore(None)`` tried and skipped
            because a shard failed its checks on some rank.
    """

    step: int
    items: tuple[str, ...]
    missing: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()
    tier: str = "persistent"
    fetched: tuple[tuple[int, int], ...] = ()
    skipped: tuple[tuple[int, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class _RestorePlan:
    """A restore checked on this rank: what to load into what, with which handler."""

    step: int
    meta: StepMetadata
    targets: dict[str, Any]
    handlers: dict[str, Handler]
    fields: dict[str, set[str]]  # item -> its excluded fields
    context: HandlerContext
    info: RestoreInfo
    # Files of an object-store step read by byte range from the store (``StepStore.fetch``).
    remote: Mapping[Path, RemoteFile] = dataclasses.field(default_factory=dict)


def _exclude_entries(exclude: object) -> list[str]:
    """``exclude`` as a list of distinct names, in order, or a CheckpointTypeError."""
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Iterable):
        raise CheckpointTypeError(
            f'exclude must be a sequence of names, got {exclude!r}; e.g. exclude=("optimizer", '
            '"recipe.rng") -- a single name needs a trailing comma: exclude=("optimizer",)'
        )
    entries = list(exclude)
    bad = [entry for entry in entries if not isinstance(entry, str) or not entry]
    if bad:
        raise CheckpointTypeError(
            f"exclude entries must be non-empty strings ('item' or 'item.field'), got {bad[0]!r}"
        )
    return list(dict.fromkeys(entries))


def _check_same_restore(shared: list[Any]) -> None:
    """Refuse, on every rank, a restore whose ranks asked for different steps or exclusions."""
    steps = [s for s, _, _ in shared]
    if len(set(steps)) > 1:
        raise CheckpointValueError(
            f"the ranks asked to restore different steps {steps} (rank order); pass the same "
            "step on every rank, e.g. mgr.latest_step()"
        )
    if any(rest != shared[0][1:] for _, *rest in shared):
        detail = "; ".join(
            f"rank {rank}: exclude {excluded}, missing {missing}"
            for rank, (_, excluded, missing) in enumerate(shared)
        )
        raise CheckpointValueError(
            f"the ranks asked for different restores of step {steps[0]} ({detail}); pass the "
            "same items, exclude and missing_ok on every rank"
        )


def _reads_by_range(handler: Handler | None) -> bool:
    """Whether ``handler`` reads its ``.safetensors`` files by byte range (RangeReadingHandler)."""
    return isinstance(handler, RangeReadingHandler) and handler.reads_by_range is True


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointTypeError(
            f"step must be an int, got {step!r} ({type(step).__name__}); pass int(step)"
        )
    if step < 0:
        raise CheckpointValueError(f"step must be >= 0, got {step}")
    return step
