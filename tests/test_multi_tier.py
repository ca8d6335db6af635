"""Multi-tier checkpoints: a node-local tier with peer replicas beside the persistent root.

Nodes are simulated by giving ranks separate local roots (ranks that see the same folder are
one node); a node is lost by deleting its root. Multi-rank tests run real gloo ranks (FSDP2 on
CPU) with a hard timeout; every agreement of the local save and restore has a test where one
rank fails at that point.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _distributed import gather, run_ranks
from _multi_tier_model import build as _build
from _multi_tier_model import local_tensors as _local_tensors
from _multi_tier_model import train_step as _train_step
from _roots import RootUnderTest
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointSaveError,
    CheckpointValueError,
    CorruptCheckpointError,
    LocalTierOptions,
    RecipeState,
    RNGState,
    StepNotFoundError,
)
from orbit_pt._tiers import local_tier as _local_tier
from orbit_pt._tiers.local_store import LocalStore
from orbit_pt._tiers.topology import Topology
from orbit_pt.handlers import StateHandler

TIMEOUT = 180.0


# --------------------------------------------------------------------------------- helpers


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def _options(local_root: Path, **local: Any) -> CheckpointManagerOptions:
    persistent = local.pop("persistent_interval", 100)
    async_save = local.pop("async_save", False)
    settings = {"save_interval_steps": 2, "keep_last_n": 2, "replicas": 1, **local}
    return CheckpointManagerOptions(
        save_interval_steps=persistent,
        async_save=async_save,
        agreement_timeout=60,
        local=LocalTierOptions(root=local_root, **settings),
    )


def _node_root(base: Path, rank: int) -> Path:
    return base / f"node{rank}"


def _single(tmp_path: Path, **local: Any) -> CheckpointManager:
    return CheckpointManager(tmp_path / "persistent", options=_options(tmp_path / "local", **local))


def _run_folder(local_root: Path) -> Path:
    (folder,) = [p for p in local_root.iterdir() if p.name.startswith("run-")]
    return folder


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "bad",
    [
        {"save_interval_steps": 0},
        {"save_interval_steps": 5, "keep_last_n": 0},
        {"save_interval_steps": 5, "replicas": -1},
        {"save_interval_steps": 5, "replicas": True},
        {"save_interval_steps": 5, "preemption_tier": "nvme"},
    ],
)
def test_invalid_local_options_are_value_errors(tmp_path: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(CheckpointValueError, match="LocalTierOptions"):
        LocalTierOptions(root=tmp_path, **bad)


def test_local_root_must_be_a_folder_and_a_writer(tmp_path: Path) -> None:
    with pytest.raises(CheckpointValueError, match="not a URL"):
        LocalTierOptions(root="s3://bucket/run", save_interval_steps=5)
    local = LocalTierOptions(root=tmp_path, save_interval_steps=5)
    with pytest.raises(CheckpointValueError, match="read_only"):
        CheckpointManagerOptions(read_only=True, local=local)


def test_should_save_on_either_cadence_and_step_dir_is_persistent_only(tmp_path: Path) -> None:
    model, opt = _build(shard=False)
    with _single(tmp_path, persistent_interval=5, save_interval_steps=2) as mgr:
        assert [s for s in range(11) if mgr.should_save(s)] == [0, 2, 4, 5, 6, 8, 10]
        for step in range(1, 7):
            _train_step(model, opt, step)
            mgr.save(step, {"model": model, "optimizer": opt})
        assert mgr.all_steps(tier="persistent") == [5]
        # keep_last_n=2 would keep 4 and 6, but 4 is older than the persistent step 5.
        assert mgr.all_steps(tier="local") == [6]
        assert mgr.all_steps() == [5, 6]
        assert mgr.latest_step() == 6
        assert mgr.step_dir(5).is_dir()
        with pytest.raises(StepNotFoundError, match="only to the local tier"):
            mgr.step_dir(6)
        with pytest.raises(CheckpointValueError, match="tier"):
            mgr.all_steps(tier="nvme")


# ------------------------------------------------------------------------- one process


def test_local_restore_is_bitwise_and_says_where_it_came_from(tmp_path: Path) -> None:
    model, opt = _build(shard=False)
    recipe = RecipeState(rng=RNGState())
    with _single(tmp_path) as mgr:
        for step in range(1, 5):
            _train_step(model, opt, step)
            torch.rand(step)  # the global generator moves on
            recipe.step = step
            rng = torch.get_rng_state()
            mgr.save(step, {"model": model, "optimizer": opt, "recipe": recipe})
        expected = _local_tensors(model, opt)
    model, opt = _build(shard=False)  # a fresh model, and the generator reseeded
    assert not torch.equal(torch.get_rng_state(), rng)
    recipe = RecipeState(rng=RNGState())
    with _single(tmp_path) as mgr:
        mgr.restore(None, {"model": model, "optimizer": opt, "recipe": recipe})
        info = mgr.last_restore
        assert info is not None
        assert (info.step, info.tier, info.skipped) == (4, "local", ())
    _assert_equal(_local_tensors(model, opt), expected)
    assert recipe.step == 4
    assert torch.equal(torch.get_rng_state(), rng)


def test_corrupt_local_shard_is_never_loaded(tmp_path: Path) -> None:
    model, opt = _build(shard=False)
    states = {}
    with _single(tmp_path, persistent_interval=2, save_interval_steps=1, keep_last_n=3) as mgr:
        for step in range(1, 6):
            _train_step(model, opt, step)
            mgr.save(step, {"model": model, "optimizer": opt})
            states[step] = _local_tensors(model, opt)
        assert mgr.all_steps(tier="local") == [4, 5]  # 3 and older are older than persistent 4
    folder = _run_folder(tmp_path / "local")
    _corrupt(folder / "step_00000005" / "rank_00000" / "model" / "tensors.safetensors")
    fresh, fresh_opt = _build(shard=False)
    with _single(tmp_path) as mgr:
        before = _local_tensors(fresh, fresh_opt)
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            mgr.restore(5, {"model": fresh, "optimizer": fresh_opt})
        _assert_equal(_local_tensors(fresh, fresh_opt), before)  # nothing loaded
        mgr.restore(None, {"model": fresh, "optimizer": fresh_opt})
        info = mgr.last_restore
        assert info is not None
        assert (info.step, info.tier) == (4, "local")
        assert [s for s, _ in info.skipped] == [5]
        assert "checksum" in info.skipped[0][1]
        _assert_equal(_local_tensors(fresh, fresh_opt), states[4])
    # With the local step 4 corrupt too, the newest persistent step (4) is restored.
    _corrupt(folder / "step_00000004" / "rank_00000" / "optimizer" / "tensors.safetensors")
    fresh, fresh_opt = _build(shard=False)
    with _single(tmp_path) as mgr:
        mgr.restore(None, {"model": fresh, "optimizer": fresh_opt})
        info = mgr.last_restore
        assert info is not None
        assert (info.step, info.tier) == (4, "persistent")
        assert [s for s, _ in info.skipped] == [5, 4]
    _assert_equal(_local_tensors(fresh, fresh_opt), states[4])


def test_local_tier_beside_either_persistent_root(where: RootUnderTest, tmp_path: Path) -> None:
    model, opt = _build(shard=False)
    local = LocalTierOptions(root=tmp_path / "local", save_interval_steps=2, keep_last_n=2)
    states = {}
    with where.open(save_interval_steps=4, local=local) as mgr:
        for step in range(1, 7):
            _train_step(model, opt, step)
            mgr.save(step, {"model": model, "optimizer": opt})
            states[step] = _local_tensors(model, opt)
        assert mgr.all_steps(tier="persistent") == [4]
        assert mgr.all_steps(tier="local") == [4, 6]
    assert where.is_committed(4)
    # A restarted job (on S3: with an empty mirror) finds its local steps: the run id is read
    # back from the persistent root.
    storage = None
    if where.storage_options is not None:
        storage = {**where.storage_options, "cache_dir": str(tmp_path / "new-mirror")}
    options = CheckpointManagerOptions(save_interval_steps=4, local=local)
    with CheckpointManager(where.directory, options=options, storage_options=storage) as mgr:
        assert mgr.latest_step() == 6
        mgr.restore(None, {"model": model, "optimizer": opt})
        assert mgr.last_restore is not None
        assert mgr.last_restore.tier == "local"
        _assert_equal(_local_tensors(model, opt), states[6])
        mgr.restore(4, {"model": model, "optimizer": opt})  # on both tiers: the local one
        assert mgr.last_restore is not None
        assert mgr.last_restore.tier == "local"
        _assert_equal(_local_tensors(model, opt), states[4])
    fresh, fresh_opt = _build(shard=False)
    with where.reader() as reader:  # the persistent step, as another machine reads it
        reader.restore(4, {"model": fresh, "optimizer": fresh_opt})
    _assert_equal(_local_tensors(fresh, fresh_opt), states[4])


@pytest.mark.parametrize("tier", ["persistent", "local"])
def test_preemption_save_goes_to_the_tier_the_options_name(tmp_path: Path, tier: str) -> None:
    model, opt = _build(shard=False)
    options = _options(tmp_path / "local", preemption_tier=tier, async_save=True)
    with CheckpointManager(tmp_path / "persistent", options=options) as mgr:
        for step in range(1, 10):
            _train_step(model, opt, step)
            if step == 5:
                # What the SIGTERM handler does. (A real SIGTERM is sent to a rank in
                # test_sigterm_with_async_local_saves_...: in this process it would also reach
                # any handler an earlier test left installed.)
                mgr._preemption.request()
            if mgr.should_save(step):
                mgr.save(step, {"model": model, "optimizer": opt})
            if mgr.reached_preemption(step):
                break
        assert step == 5  # one process: acted on at once
        mgr.wait_until_finished()
        if tier == "persistent":
            assert mgr.all_steps(tier="persistent") == [5]
            assert mgr.all_steps(tier="local") == [2, 4]
        else:
            assert mgr.all_steps(tier="persistent") == []
            assert mgr.all_steps(tier="local") == [4, 5]


def test_local_restore_leaves_out_what_exclude_names(tmp_path: Path) -> None:
    model, opt = _build(shard=False)
    recipe = RecipeState(step=4, rng=RNGState())
    with _single(tmp_path) as mgr:
        mgr.save(4, {"model": model, "optimizer": opt, "recipe": recipe})
        with pytest.raises(CheckpointValueError, match="no named fields"):
            mgr.restore(4, {"model": model}, exclude=("model.up",))
        torch.rand(3)  # the generator moves on; the excluded RNG field must leave it there
        rng = torch.get_rng_state()
        live = RecipeState(step=9, rng=RNGState())
        out = mgr.restore(4, {"recipe": live}, exclude=("recipe.rng",))
        assert list(out) == ["recipe"]
        assert live.step == 4
        assert mgr.last_restore is not None
        assert mgr.last_restore.excluded == ("recipe.rng",)
        assert torch.equal(torch.get_rng_state(), rng)


def test_local_root_of_another_run_is_ignored_and_untouched(tmp_path: Path) -> None:
    model, opt = _build(shard=False)
    local = tmp_path / "local"
    with CheckpointManager(tmp_path / "run_a", options=_options(local)) as mgr:
        for step in (2, 4):
            mgr.save(step, {"model": model, "optimizer": opt})
    (theirs,) = list(local.iterdir())
    listing = sorted(str(p.relative_to(local)) for p in theirs.rglob("*"))
    with CheckpointManager(tmp_path / "run_b", options=_options(local)) as mgr:
        assert mgr.latest_step() is None
        assert mgr.all_steps(tier="local") == []
        with pytest.raises(StepNotFoundError):
            mgr.restore(None, {"model": model})
        mgr.save(6, {"model": model, "optimizer": opt})
        assert mgr.all_steps(tier="local") == [6]
    assert sorted(str(p.relative_to(local)) for p in theirs.rglob("*")) == listing
    # Run A, reopened, still has its steps: its id is kept in its persistent root.
    with CheckpointManager(tmp_path / "run_a", options=_options(local)) as mgr:
        assert mgr.all_steps(tier="local") == [2, 4]


def test_local_retention_and_rollback(tmp_path: Path) -> None:
    model, _opt = _build(shard=False)
    with _single(tmp_path, persistent_interval=10, save_interval_steps=2, keep_last_n=2) as mgr:
        for step in range(0, 9, 2):
            mgr.save(step, {"model": model})
        assert mgr.all_steps(tier="local") == [6, 8]
        mgr.save(10, {"model": model})  # both tiers
        assert mgr.all_steps(tier="local") == [8, 10]
        mgr.save(12, {"model": model})
        assert mgr.all_steps(tier="local") == [10, 12]  # 8 is older than persistent 10
        # A rollback: saving an older step removes the newer local steps of the abandoned run.
        mgr.save(4, {"model": model}, force=True)
        assert mgr.all_steps(tier="local") == [4]
        assert mgr.all_steps(tier="persistent") == [0, 4]  # 10 moved to superseded/


class _GatedHandler(StateHandler):
    """A state handler whose persistent save waits for a gate (an upload that takes long)."""

    name = "state"

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def save(self, directory: Path, item: Any, context: Any) -> Any:
        assert self.gate.wait(60)
        return super().save(directory, item, context)


def test_async_local_saves_do_not_wait_for_a_persistent_save_in_flight(tmp_path: Path) -> None:
    gate = threading.Event()
    options = _options(tmp_path / "local", persistent_interval=4, async_save=True)
    mgr = CheckpointManager(
        tmp_path / "persistent", options=options, handlers={"state": _GatedHandler(gate)}
    )
    try:
        item = {"state": {"weights": torch.arange(4.0)}}
        mgr.save(4, item)  # both tiers; the persistent lane blocks on the gate
        item["state"]["weights"] += 1
        mgr.save(6, item)  # local only: must commit while step 4's persistent save waits
        mgr._local_background.wait()
        assert mgr.all_steps(tier="local") == [4, 6]
        assert mgr.all_steps(tier="persistent") == []
        assert mgr.is_saving_in_progress()
        gate.set()
        mgr.wait_until_finished()
        assert mgr.all_steps(tier="persistent") == [4]
        out = mgr.restore(None, ["state"])
        assert torch.equal(out["state"]["weights"], torch.arange(4.0) + 1)
    finally:
        gate.set()
        mgr.close()


def test_a_failed_background_save_of_either_tier_is_raised_by_the_next_save(
    tmp_path: Path,
) -> None:
    model, opt = _build(shard=False)
    items = {"model": model, "optimizer": opt}
    with _single(tmp_path, persistent_interval=4, async_save=True) as mgr:
        local = mgr._local
        assert local is not None
        local.store.commit = _raiser(OSError(28, "No space left on device"))  # type: ignore[method-assign]
        mgr.save(2, items)  # local only; its background commit fails
        deadline = time.monotonic() + 60
        while mgr.is_saving_in_progress() and time.monotonic() < deadline:
            time.sleep(0.01)
        # Step 3 is no save step of either tier; step 4 is, and it raises step 2's failure.
        assert mgr.save(3, items) is False
        with pytest.raises(CheckpointSaveError, match="No space left on device"):
            mgr.save(4, items)
        local.store.__dict__.pop("commit")
        assert mgr.save(4, items)
        mgr.wait_until_finished()
        assert mgr.all_steps(tier="local") == [4]
        assert mgr.all_steps(tier="persistent") == [4]


def test_topology_spreads_replicas_over_other_nodes() -> None:
    keys = [["a", 1, 1], ["a", 1, 1], ["b", 1, 1], ["b", 1, 1], ["c", 1, 1], ["c", 1, 1]]
    topo = Topology.from_keys(keys, replicas=2)
    assert topo.node_of == (0, 0, 1, 1, 2, 2)
    assert topo.homes(3) == [1, 2, 0]
    assert [topo.holder(3, node) for node in (1, 2, 0)] == [3, 5, 1]
    assert topo.leader(2)
    assert not topo.leader(3)
    assert Topology.from_keys(keys[:2], replicas=1).replicas == 0  # one node: no replica


# ------------------------------------------------------------------------------ two ranks


def _save_run(rank: int, world: int, base: str, replicas: int, steps: int) -> None:
    base_path = Path(base)
    model, opt = _build(shard=True)
    options = _options(_node_root(base_path, rank), replicas=replicas, persistent_interval=3)
    with CheckpointManager(base_path / "persistent", options=options) as mgr:
        for step in range(1, steps + 1):
            _train_step(model, opt, step)
            mgr.save(step, {"model": model, "optimizer": opt})
            save_file(_local_tensors(model, opt), base_path / f"rank{rank}_step{step}.safetensors")
        assert mgr.all_steps(tier="local") == [4] if steps == 4 else True
        assert mgr.all_steps(tier="persistent") == [3]


def _restore_run(rank: int, world: int, base: str, expect: dict[str, Any]) -> None:
    base_path = Path(base)
    model, opt = _build(shard=True)
    options = _options(_node_root(base_path, rank), replicas=expect["replicas"])
    with CheckpointManager(base_path / "persistent", options=options) as mgr:
        assert mgr.latest_step() == expect["latest"]
        mgr.restore(None, {"model": model, "optimizer": opt})
        info = mgr.last_restore
        assert info is not None
        assert (info.step, info.tier) == (expect["step"], expect["tier"])
        assert [list(f) for f in info.fetched] == expect["fetched"]
        assert gather([info.step, info.tier]) == [[info.step, info.tier]] * world
    reference = load_file(base_path / f"rank{rank}_step{expect['step']}.safetensors")
    _assert_equal(_local_tensors(model, opt), reference)


@pytest.mark.distributed
def test_lost_node_with_replicas_restores_the_newest_local_step(tmp_path: Path) -> None:
    run_ranks(2, _save_run, str(tmp_path), 1, 4, timeout=TIMEOUT)
    # Node 1 holds rank 1's shard and rank 0's replica; node 0 the other two.
    for node in (0, 1):
        step4 = _run_folder(_node_root(tmp_path, node)) / "step_00000004"
        assert sorted(p.name for p in step4.iterdir()) == ["rank_00000", "rank_00001"]
    shutil.rmtree(_node_root(tmp_path, 1))  # node 1 is lost (replaced by an empty one)
    expect = {"replicas": 1, "latest": 4, "step": 4, "tier": "local", "fetched": [[1, 0]]}
    run_ranks(2, _restore_run, str(tmp_path), expect, timeout=TIMEOUT)
    # The restore re-created node 1's shards: its own and rank 0's replica.
    step4 = _run_folder(_node_root(tmp_path, 1)) / "step_00000004"
    assert sorted(p.name for p in step4.iterdir()) == ["rank_00000", "rank_00001"]


@pytest.mark.distributed
def test_lost_node_without_replicas_restores_the_newest_persistent_step(tmp_path: Path) -> None:
    run_ranks(2, _save_run, str(tmp_path), 0, 4, timeout=TIMEOUT)
    shutil.rmtree(_node_root(tmp_path, 1))
    expect = {"replicas": 0, "latest": 3, "step": 3, "tier": "persistent", "fetched": []}
    run_ranks(2, _restore_run, str(tmp_path), expect, timeout=TIMEOUT)


def _restore_on_one_rank(rank: int, world: int, base: str) -> None:
    base_path = Path(base)
    model, opt = _build(shard=True)
    with CheckpointManager(
        base_path / "persistent", options=_options(_node_root(base_path, 0))
    ) as mgr:
        assert mgr.all_steps(tier="local") == []  # shards of 2 ranks: not for this world
        mgr.restore(None, {"model": model, "optimizer": opt})
        info = mgr.last_restore
        assert info is not None
        assert (info.step, info.tier) == (3, "persistent")
    saved = [load_file(base_path / f"rank{r}_step3.safetensors") for r in range(2)]
    weight = model.state_dict()["up.weight"]
    weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
    assert torch.equal(weight, torch.cat([s["model/up.weight"] for s in saved]))


@pytest.mark.distributed
def test_smaller_world_restores_the_persistent_step(tmp_path: Path) -> None:
    run_ranks(2, _save_run, str(tmp_path), 1, 4, timeout=TIMEOUT)
    run_ranks(1, _restore_on_one_rank, str(tmp_path), timeout=TIMEOUT)


def _fail_at(rank: int, world: int, base: str, point: str) -> None:
    """Rank 1 fails at one point of a local save; every rank raises, nothing is recoverable."""
    base_path = Path(base)
    model, opt = _build(shard=True)
    options = _options(_node_root(base_path, rank), persistent_interval=1000)
    with CheckpointManager(base_path / "persistent", options=options) as mgr:
        mgr.save(2, {"model": model, "optimizer": opt})
        local = mgr._local
        assert local is not None
        if rank == 1 and point == "write":
            local._write = _raiser(OSError(28, "No space left on device"))  # type: ignore[method-assign]
        if rank == 1 and point == "replicate":
            local.corrupt_sends = lambda chunk: chunk.__setitem__(0, chunk[0] ^ 0xFF)
        if rank == 0 and point == "receive":  # rank 0 cannot create the replica's folder
            fresh_tmp = local.store.fresh_tmp

            def unwritable(step: int, shard: int, *, create: bool = True) -> Path:
                if create:
                    return fresh_tmp(step, shard)
                return Path("/proc/orbit-pt-cannot-write-here")

            local.store.fresh_tmp = unwritable  # type: ignore[method-assign,assignment]
        if rank == 1 and point == "commit":
            local.store.commit = _raiser(OSError(5, "Input/output error"))  # type: ignore[method-assign]
        started = time.monotonic()
        with pytest.raises(CheckpointSaveError) as raised:
            mgr.save(4, {"model": model, "optimizer": opt})
        assert "rank(s) [1]" in str(raised.value) or "rank(s) [0]" in str(raised.value)
        # Every rank learned it at once: nobody waited for the 60 s agreement timeout.
        assert time.monotonic() - started < 30
        assert mgr.all_steps(tier="local") == [2]
        assert mgr.latest_step() == 2
        # Nothing of step 4 is left on this node: no uncommitted folder, no committed shard.
        folder = local.store.root
        assert not (folder / "step_00000004").exists() or not any(
            (folder / "step_00000004").iterdir()
        )
        assert list((folder / ".orbit-tmp").iterdir()) == []
        # The next save works again.
        if rank == 1:
            local.corrupt_sends = None
            local.__dict__.pop("_write", None)
            local.store.__dict__.pop("commit", None)
        local.store.__dict__.pop("fresh_tmp", None)
        mgr.save(6, {"model": model, "optimizer": opt})
        assert mgr.all_steps(tier="local") == [2, 6]


def _raiser(error: Exception) -> Any:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    return fail


@pytest.mark.distributed
@pytest.mark.parametrize("point", ["write", "replicate", "receive", "commit"])
def test_one_rank_failing_in_a_local_save_fails_it_everywhere(tmp_path: Path, point: str) -> None:
    run_ranks(2, _fail_at, str(tmp_path), point, timeout=TIMEOUT)


class _Unstageable:
    """An item whose state cannot be taken on rank 1 (a data loader that fails mid-epoch)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def state_dict(self) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("the data loader's workers died")
        return {"position": 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _fail_elsewhere(rank: int, world: int, base: str, point: str) -> None:
    """Rank 1 fails at the local tier's open, stage, list or load agreement: every rank
    raises, and no rank is left waiting."""
    base_path = Path(base)
    local_root = _node_root(base_path, rank)
    if point == "open" and rank == 1:
        local_root.parent.mkdir(parents=True, exist_ok=True)
        local_root.write_text("a file where the local root should be")
    options = _options(local_root, persistent_interval=1000)
    if point == "open":
        with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\]"):
            CheckpointManager(base_path / "persistent", options=options)
        return
    model, opt = _build(shard=False)
    with CheckpointManager(base_path / "persistent", options=options) as mgr:
        items: dict[str, Any] = {"model": model, "optimizer": opt}
        mgr.save(2, items)
        if point == "stage":
            with pytest.raises(CheckpointSaveError, match=r"rank\(s\) \[1\]"):
                mgr.save(4, {**items, "loader": _Unstageable(rank == 1)})
            assert mgr.all_steps(tier="local") == [2]
        if point == "list":
            local = mgr._local
            assert local is not None
            if rank == 1:
                local.store.markers = _raiser(OSError(5, "Input/output error"))  # type: ignore[method-assign]
            with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\]"):
                mgr.latest_step()
            with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\]"):
                mgr.restore(None, items)
            local.store.__dict__.pop("markers", None)
            assert mgr.latest_step() == 2
        if point == "load":
            target = torch.nn.Linear(3, 3) if rank == 1 else model  # rank 1: the wrong model
            with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\]"):
                mgr.restore(2, {"model": target})


@pytest.mark.distributed
@pytest.mark.parametrize("point", ["open", "stage", "list", "load"])
def test_one_rank_failing_elsewhere_in_the_local_tier_fails_everywhere(
    tmp_path: Path, point: str
) -> None:
    run_ranks(2, _fail_elsewhere, str(tmp_path), point, timeout=TIMEOUT)


def _restore_with_one_corrupt_rank(rank: int, world: int, base: str) -> None:
    base_path = Path(base)
    model, opt = _build(shard=True)
    options = _options(_node_root(base_path, rank))
    with CheckpointManager(base_path / "persistent", options=options) as mgr:
        before = _local_tensors(model, opt)
        # Rank 1 raises its own error; rank 0 the agreed one, naming rank 1 and the cause.
        expected = CorruptCheckpointError if rank == 1 else CheckpointError
        with pytest.raises(expected, match="checksum"):
            mgr.restore(4, {"model": model, "optimizer": opt})
        _assert_equal(_local_tensors(model, opt), before)
        mgr.restore(None, {"model": model, "optimizer": opt})
        info = mgr.last_restore
        assert info is not None
        assert (info.step, info.tier) == (3, "persistent")
        assert [s for s, _ in info.skipped] == [4]
    _assert_equal(
        _local_tensors(model, opt), load_file(base_path / f"rank{rank}_step3.safetensors")
    )


@pytest.mark.distributed
def test_a_corrupt_shard_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    run_ranks(2, _save_run, str(tmp_path), 1, 4, timeout=TIMEOUT)
    shard = _run_folder(_node_root(tmp_path, 1)) / "step_00000004" / "rank_00001"
    _corrupt(shard / "optimizer" / "tensors.safetensors")
    run_ranks(2, _restore_with_one_corrupt_rank, str(tmp_path), timeout=TIMEOUT)


def _preempted(rank: int, world: int, base: str) -> None:
    base_path = Path(base)
    model, opt = _build(shard=True)
    options = _options(_node_root(base_path, rank), async_save=True, persistent_interval=1000)
    with CheckpointManager(base_path / "persistent", options=options) as mgr:
        step = 0
        while True:
            step += 1
            _train_step(model, opt, step)
            if rank == 1 and step == 7:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, to one rank
            if mgr.should_save(step):
                mgr.save(step, {"model": model, "optimizer": opt})
            if mgr.reached_preemption(step):
                break
            assert step < 50
        mgr.wait_until_finished()
        assert mgr.all_steps(tier="persistent") == [step]
        assert gather(step) == [step] * world
        save_file(_local_tensors(model, opt), base_path / f"rank{rank}_final.safetensors")


@pytest.mark.distributed
def test_sigterm_with_async_local_saves_leaves_a_persistent_preemption_step(
    tmp_path: Path,
) -> None:
    run_ranks(2, _preempted, str(tmp_path), timeout=TIMEOUT)
    for node in (0, 1):
        shutil.rmtree(_node_root(tmp_path, node))  # every node lost: only the root is left
    with CheckpointManager(
        tmp_path / "persistent", options=CheckpointManagerOptions(read_only=True)
    ) as mgr:
        (step,) = mgr.all_steps()
        assert mgr.metadata(step).world_size == 2


def test_marker_is_written_last_and_checked(tmp_path: Path) -> None:
    """A shard folder without its marker, or with a marker of another world size, is not
    listed (what a crash between the write and the rename leaves is never read)."""
    model, _opt = _build(shard=False)
    with _single(tmp_path) as mgr:
        mgr.save(2, {"model": model})
    folder = _run_folder(tmp_path / "local")
    store = LocalStore(tmp_path / "local", folder.name[len("run-") :], world_size=1)
    assert list(store.markers()) == [2]
    marker_path = folder / "step_00000002" / "rank_00000" / "SHARD.json"
    marker = json.loads(marker_path.read_text())
    marker_path.write_text(json.dumps({**marker, "world_size": 2}))
    assert store.markers() == {}
    marker_path.unlink()
    assert store.markers() == {}
    with _single(tmp_path) as mgr:
        assert mgr.latest_step() is None


def test_plan_needs_every_shard_of_one_attempt() -> None:
    topo = Topology.from_keys([["a"], ["b"]], replicas=1)
    files = {"x": {"size": 1, "checksum": "xxh3-64:0"}}
    # Node 0 has shard 0 of attempt A; node 1 has shard 1 of attempt B: not one save.
    listing = [{"4": {"0": ["A", files]}}, {"4": {"1": ["B", files]}}]
    assert _local_tier.plan_recovery(listing, topo, 2) == {}
    listing = [{"4": {"0": ["A", files], "1": ["A", files]}}, {}]
    plans = _local_tier.plan_recovery(listing, topo, 2)
    # Node 1 is empty: rank 1's shard and rank 0's replica are copied from node 0.
    assert plans[4].moves == ((0, 0, 1), (1, 0, 1))


def test_logs_when_replicas_cannot_be_placed(tmp_path: Path, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING), _single(tmp_path, replicas=1):
        pass
    assert "1 node(s) found" in caplog.text


WORKER = Path(__file__).parent / "_multi_tier_worker.py"


def _resume_after_kill(rank: int, world: int, base: str) -> None:
    """Restore the newest recoverable step and check it against a replay of the same steps."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _multi_tier_worker import options

    base_path = Path(base)
    model, opt = _build(shard=True)
    with CheckpointManager(base_path / "persistent", options=options(base_path, rank)) as mgr:
        latest = mgr.latest_step()
        assert latest is not None
        mgr.restore(None, {"model": model, "optimizer": opt})
        info = mgr.last_restore
        assert info is not None
        assert info.step == latest
        (base_path / f"restored{rank}.json").write_text(
            json.dumps({"step": info.step, "tier": info.tier, "fetched": info.fetched})
        )
    replay, replay_opt = _build(shard=True)
    for step in range(1, info.step + 1):
        _train_step(replay, replay_opt, step)
    _assert_equal(_local_tensors(model, opt), _local_tensors(replay, replay_opt))


@pytest.mark.distributed
@pytest.mark.parametrize("after", [13, 26])
def test_sigkill_of_every_rank_and_a_lost_node_restores_an_agreed_step(
    tmp_path: Path, after: int
) -> None:
    job = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path)], start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            progress = [tmp_path / f"progress{r}" for r in range(2)]
            texts = [p.read_text() if p.exists() else "" for p in progress]
            if all(t and int(t) >= after for t in texts):
                break
            assert job.poll() is None, "the worker ended before it was killed"
            time.sleep(0.005)
        else:
            raise AssertionError("the worker made no progress")
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # every rank at once, wherever it is
        job.wait(timeout=60)
    shutil.rmtree(_node_root(tmp_path, 1))  # and node 1 is lost
    run_ranks(2, _resume_after_kill, str(tmp_path), timeout=TIMEOUT)
    restored = [json.loads((tmp_path / f"restored{r}.json").read_text()) for r in range(2)]
    assert restored[0] == restored[1]
    assert restored[0]["step"] >= after - 6  # a recent step, not a restart from far back
