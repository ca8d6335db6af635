"""The node-local tier: its save (write, replicate, commit) and its restore (list, fetch, verify,
load), each phase one agreement of every rank (docs/multi-tier.md, docs/protocol.md).

Save of step N:

1. ``orbit_pt.local.write``: every rank writes its own shard into a fresh folder of its node's
   local root and shares the file list (sizes, checksums) and a nonce; rank 0's nonce is the
   save's *attempt*, recorded in every marker.
2. ``orbit_pt.local.replicate``: every shard is streamed to the rank that keeps its replica on
   each of the next ``replicas`` nodes (:mod:`.topology`), checked on arrival.
3. ``orbit_pt.local.commit``: every rank writes the markers of the folders it holds (its own
   and the replicas it received) and renames them into place.

A failure in phase 1 or 2 on any rank discards every folder on every rank; a failure in phase 3
removes the shards of N this rank committed. A step is *recoverable* when every rank's shard
with one attempt is committed on some node; a restore never sees anything else.

Restore: every rank lists what its node holds (``orbit_pt.local.list``); every rank computes the
same plan from the same gathered listing; missing shards -- a rank's own shard lost with its
node, or a replica that is gone -- are fetched from a node that holds them
(``orbit_pt.local.fetch``, which re-creates the replicas too); every rank verifies its own shard
in full (``orbit_pt.local.verify``) before any rank loads (``orbit_pt.local.load``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from orbit_pt._control.collective import Collective
from orbit_pt._format import checksum as _checksum
from orbit_pt._tiers import shard as _shard
from orbit_pt._tiers.local_store import LocalStore, node_key
from orbit_pt._tiers.topology import Topology
from orbit_pt._tiers.transfer import Incoming, Outgoing, exchange
from orbit_pt.errors import CheckpointValueError, CorruptCheckpointError
from orbit_pt.handlers.base import HandlerContext
from orbit_pt.handlers.state import StateHandler

logger = logging.getLogger(__name__)

ITEMS_FILE = "items.json"


@dataclasses.dataclass
class Staged:
    """One item of a local save: its kind, its state (staged or live), its DTensor layout."""

    kind: str
    state: Any
    sharded: dict[str, dict[str, list[int]]]


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """How one recoverable local step is restored: which shards move where.

    Attributes:
        step: the step.
        attempt: the save attempt every used shard belongs to.
        moves: (shard, source rank, destination rank) for each copy to make.
        files: shard -> its files (sizes, checksums), from a holder's marker.
    """

    step: int
    attempt: str
    moves: tuple[tuple[int, int, int], ...]
    files: Mapping[int, Mapping[str, Any]]


class LocalTier:
    """This rank's part of the node-local tier. Opening it is collective."""

    def __init__(
        self,
        root: Path,
        run_id: str,
        *,
        replicas: int,
        keep_last_n: int,
        dist: Collective,
    ) -> None:
        self.root = Path(root)
        self.rank = dist.rank
        self.world_size = dist.world_size
        self.keep_last_n = keep_last_n
        # Agreed: a rank that cannot create its local root fails the open on every rank.
        _, keys = dist.agree(
            "orbit_pt.local.open",
            lambda: node_key(self.root),
            label=f"opening the local tier {self.root}",
            share=lambda key: key,
        )
        self.topology = Topology.from_keys(keys, replicas)
        if self.topology.replicas < replicas and dist.is_primary:
            logger.warning(
                "LocalTierOptions(replicas=%d): only %d node(s) found (ranks sharing a local "
                "root are one node), so each shard has %d replica(s); a lost node loses its "
                "local steps",
                replicas,
                self.topology.nodes,
                self.topology.replicas,
            )
        self.store = LocalStore(self.root, run_id, world_size=self.world_size)
        if self.topology.leader(self.rank):
            self.store.remove_leftovers()
        self._handlers: dict[str, StateHandler] = {}  # per item, for their staging buffers
        # Test hook: applied to every chunk this rank sends (fault injection only).
        self.corrupt_sends: Callable[[Any], None] | None = None

    # ----------------------------------------------------------------------------------- saving

    def capture(self, items: Mapping[str, Any], *, stage: bool) -> dict[str, Staged]:
        """Each item as this rank holds it; with ``stage``, copied into reused host buffers."""
        out = {}
        for name, item in items.items():
            captured = _shard.capture(name, item)
            state: Any = captured.state
            if stage:
                handler = self._handlers.setdefault(name, StateHandler())
                state = handler.stage(state, HandlerContext(step=0))
            out[name] = Staged(captured.kind, state, captured.sharded)
        return out

    def save(
        self,
        step: int,
        staged: Mapping[str, Staged],
        dist: Collective,
        *,
        newest_persistent: Callable[[], int | None],
    ) -> None:
        """Write, replicate and commit this rank's part of local step ``step`` (collective)."""
        rank = self.rank
        folders: dict[int, Path] = {}  # shard -> the folder this rank holds it in, uncommitted
        committed: list[int] = []

        def write() -> dict[str, Any]:
            if self.topology.leader(rank):
                self._drop_newer(step)
            tmp = self.store.fresh_tmp(step, rank)
            folders[rank] = tmp
            return self._write(tmp, step, staged)

        try:
            _, shared = dist.agree(
                "orbit_pt.local.write",
                write,
                label=f"writing local step {step}",
                share=lambda files: {"files": files, "nonce": uuid.uuid4().hex},
            )
            attempt = shared[0]["nonce"]
            manifests = {r: s["files"] for r, s in enumerate(shared)}

            def replicate() -> None:
                outgoing, incoming = [], []
                for node in self.topology.homes(rank)[1:]:
                    peer = self.topology.holder(rank, node)
                    outgoing.append(Outgoing(peer, folders[rank], manifests[rank], rank))
                for shard in range(self.world_size):
                    for node in self.topology.homes(shard)[1:]:
                        if self.topology.holder(shard, node) == rank:
                            tmp = self.store.fresh_tmp(step, shard, create=False)
                            folders[shard] = tmp
                            incoming.append(Incoming(shard, tmp, manifests[shard], shard))
                exchange(dist, outgoing, incoming, corrupt=self.corrupt_sends)

            dist.agree(
                "orbit_pt.local.replicate", replicate, label=f"replicating local step {step}"
            )

            def commit() -> None:
                for shard, tmp in sorted(folders.items()):
                    self.store.finish(tmp, self._marker(step, shard, attempt, manifests[shard]))
                for shard, tmp in sorted(folders.items()):
                    self.store.commit(tmp, step, shard)
                    committed.append(shard)

            dist.agree("orbit_pt.local.commit", commit, label=f"committing local step {step}")
        except BaseException:
            for tmp in folders.values():
                self.store.discard(tmp)
            for shard in committed:  # another rank failed to commit: the step is incomplete
                try:
                    self.store.delete_shard(step, shard)
                except OSError as exc:
                    logger.warning(
                        "could not remove local shard %d of step %d: %s", shard, step, exc
                    )
            raise
        self._retain(step, newest_persistent())

    def _write(self, tmp: Path, step: int, staged: Mapping[str, Staged]) -> dict[str, Any]:
        context = HandlerContext(step=step)
        files: dict[str, Any] = {}
        with _checksum.recording() as recorded:
            for name, item in staged.items():
                folder = tmp / name
                folder.mkdir()
                handler = self._handlers.setdefault(name, StateHandler())
                handler.save(folder, item.state, context)
            layout = {n: {"kind": i.kind, "sharded": i.sharded} for n, i in staged.items()}
            (tmp / ITEMS_FILE).write_bytes(json.dumps(layout, sort_keys=True).encode())
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = path.relative_to(tmp).as_posix()
            checksum = recorded.get(str(path.absolute())) or _checksum.of_file(path)
            files[rel] = {"size": path.stat().st_size, "checksum": checksum}
        return files

    def _marker(
        self, step: int, shard: int, attempt: str, files: Mapping[str, Any]
    ) -> dict[str, Any]:
        return {
            "format": 1,
            "run": self.store.run_id,
            "step": step,
            "rank": shard,
            "world_size": self.world_size,
            "attempt": attempt,
            "files": dict(files),
            "items": {},  # the layout is in items.json, covered by the checksums
        }

    # -------------------------------------------------------------------------------- retention

    def _drop_newer(self, step: int) -> None:
        """Remove this node's local steps newer than ``step``: a rollback's abandoned future."""
        newer = [s for s in self.store.steps() if s > step]
        if newer:
            logger.warning(
                "local tier %s: saving step %d removes newer local step(s) %s (a rollback; the "
                "persistent tier keeps its own in superseded/)",
                self.root,
                step,
                newer,
            )
        for s in newer:
            self.store.delete_step(s)

    def _retain(self, step: int, newest_persistent: int | None) -> None:
        """Keep this node's newest ``keep_last_n`` local steps up to ``step``; older steps, and
        steps older than the newest persistent step, go (never ``step`` itself)."""
        if not self.topology.leader(self.rank):
            return
        # Only steps with shards of this world size count as kept ones: a folder left by
        # another world size, or by a save that failed, never takes a complete step's place.
        complete = sorted(s for s in self.store.markers() if s <= step)
        kept = set(complete[-self.keep_last_n :]) | {step}
        doomed = [
            s
            for s in self.store.steps()
            if s < step
            and (s not in kept or (newest_persistent is not None and s < newest_persistent))
        ]
        for s in doomed:
            try:
                self.store.delete_step(s)
            except OSError as exc:
                logger.error("local tier %s: could not delete step %d: %s", self.root, s, exc)

    # ---------------------------------------------------------------------------------- restore

    def list_recoverable(
        self, dist: Collective, *, asked: int | None = None
    ) -> dict[int, LocalPlan]:
        """Every recoverable local step and how to restore it (collective, agreed).

        ``asked``: the step this rank's restore asks for; ranks asking different steps are
        refused on every rank.
        """

        def listing() -> dict[str, Any]:
            held = self.store.markers()
            return {
                str(step): {str(r): [m["attempt"], m["files"]] for r, m in shards.items()}
                for step, shards in held.items()
            }

        _, gathered = dist.agree(
            "orbit_pt.local.list",
            listing,
            label="listing the local tier",
            share=lambda held: [asked, held],
        )
        steps = [a for a, _ in gathered]
        if len(set(steps)) > 1:
            raise CheckpointValueError(
                f"the ranks asked to restore different steps {steps} (rank order); pass the "
                "same step on every rank, e.g. mgr.latest_step()"
            )
        return plan_recovery([held for _, held in gathered], self.topology, self.world_size)

    def fetch(self, plan: LocalPlan, dist: Collective) -> list[tuple[int, int]]:
        """Make the copies of ``plan`` (collective); returns (shard, source) fetched here."""
        rank = self.rank
        folders: dict[int, Path] = {}
        fetched = []
        outgoing, incoming = [], []
        for shard, source, destination in plan.moves:
            if source == rank:
                folder = self.store.shard_path(plan.step, shard)
                outgoing.append(Outgoing(destination, folder, plan.files[shard], shard))
            if destination == rank:
                tmp = self.store.fresh_tmp(plan.step, shard, create=False)
                folders[shard] = tmp
                incoming.append(Incoming(source, tmp, plan.files[shard], shard))
                if shard == rank:
                    fetched.append((shard, source))
        try:
            exchange(dist, outgoing, incoming, corrupt=self.corrupt_sends)
            for shard, tmp in sorted(folders.items()):
                marker = self._marker(plan.step, shard, plan.attempt, plan.files[shard])
                self.store.finish(tmp, marker)
                self.store.commit(tmp, plan.step, shard)
        finally:
            for tmp in folders.values():
                if tmp.exists():
                    self.store.discard(tmp)
        return fetched

    def verify(self, plan: LocalPlan, *, checked: bool = False) -> dict[str, Any]:
        """Check this rank's shard in full against its marker; return its items' layout.

        ``checked``: the shard was just fetched, every file checked against the same checksums
        on arrival; its bytes are not read again.
        """
        marker = self.store.marker(plan.step, self.rank)
        if marker is None or marker.get("attempt") != plan.attempt:
            raise CorruptCheckpointError(
                f"local shard {self.store.shard_path(plan.step, self.rank)} is missing or belongs "
                "to another save attempt"
            )
        if not checked:
            self.store.verify(plan.step, self.rank, marker)
        layout = json.loads(self.store.read_file(plan.step, self.rank, ITEMS_FILE))
        if not isinstance(layout, dict) or any(
            not isinstance(v, dict) or v.get("kind") not in _shard.KINDS for v in layout.values()
        ):
            raise CorruptCheckpointError(
                f"{self.store.shard_path(plan.step, self.rank) / ITEMS_FILE} is not a layout "
                "orbit_pt writes"
            )
        return layout

    def load(
        self,
        plan: LocalPlan,
        layout: Mapping[str, Any],
        targets: Mapping[str, Any],
        fields: Mapping[str, set[str]],
        context: HandlerContext,
    ) -> dict[str, Any]:
        folder = self.store.shard_path(plan.step, self.rank)
        out = {}
        for name, target in targets.items():
            item = layout[name]
            item_context = HandlerContext(
                step=plan.step,
                items=context.items,
                exclude=frozenset(fields.get(name, ())),
            )
            out[name] = _shard.load(
                name, item["kind"], folder / name, item["sharded"], target, item_context
            )
        return out


def plan_recovery(
    gathered: Sequence[Mapping[str, Any]], topology: Topology, world_size: int
) -> dict[int, LocalPlan]:
    """The recoverable steps of a gathered listing, each with its copies to make.

    Pure: every rank computes the same plans from the same listing.
    """
    # node -> step -> shard -> (attempt, files); the ranks of a node list the same folder.
    held: dict[int, dict[int, dict[int, tuple[str, Any]]]] = {}
    for rank, listing in enumerate(gathered):
        on_node = held.setdefault(topology.node_of[rank], {})
        for listed_step, shards in listing.items():
            for listed_shard, (listed_attempt, listed_files) in shards.items():
                on_node.setdefault(int(listed_step), {})[int(listed_shard)] = (
                    listed_attempt,
                    listed_files,
                )
    plans: dict[int, LocalPlan] = {}
    steps = sorted({s for node in held.values() for s in node}, reverse=True)
    for step in steps:
        attempts = sorted({a for node in held.values() for a, _ in node.get(step, {}).values()})
        for attempt in attempts:
            sources: dict[int, list[int]] = {}
            files: dict[int, Any] = {}
            for node, by_step in sorted(held.items()):
                for shard, (a, f) in by_step.get(step, {}).items():
                    if a == attempt:
                        sources.setdefault(shard, []).append(node)
                        files.setdefault(shard, f)
            if set(sources) != set(range(world_size)):
                continue
            moves = []
            for shard in range(world_size):
                for node in topology.homes(shard):
                    if node in sources[shard]:
                        continue
                    source_node = sources[shard][0]
                    moves.append(
                        (
                            shard,
                            topology.holder(shard, source_node),
                            topology.holder(shard, node),
                        )
                    )
            plans[step] = LocalPlan(step, attempt, tuple(moves), files)
            break
    return plans
