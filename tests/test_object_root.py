"""A root in object storage, against a real S3 server (moto's, on 127.0.0.1, started by a fixture).

The same guarantees as a local root: a step is committed only once every object is uploaded
(the marker last), discovery lists only committed steps, retention and rollback, async saves,
one writer per root (a lease that a dead writer's successor takes over), and a save that fails
part-way commits nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _distributed import run_ranks
from _roots import FOREIGN_OBJECTS, RootUnderTest

from orbit_pt import (
    CheckpointLockedError,
    CheckpointManager,
    CheckpointManagerOptions,
    CheckpointSaveError,
    CheckpointValueError,
)

pytest.importorskip("moto")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(4, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def _root(s3: Any, tmp_path: Path) -> dict[str, Any]:
    return {
        "url": s3.url,
        "prefix": s3.prefix,
        "options": {**s3.storage_options, "cache_dir": str(tmp_path / "mirror")},
    }


@pytest.fixture
def root(s3_root: Any, tmp_path: Path) -> dict[str, Any]:
    """A fresh prefix in the bucket, and its own local mirror."""
    return _root(s3_root, tmp_path)


def _keys(root: dict[str, Any]) -> list[str]:
    """Every object under the root's prefix, relative to it (listed with boto3 directly)."""
    import boto3

    client = boto3.client("s3")  # the fixture points the AWS_* environment at the server
    bucket = root["url"].split("/")[2]
    prefix = root["prefix"].rstrip("/") + "/"
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"][len(prefix) :] for o in page.get("Contents", [])]
    return sorted(keys)


def _other_machine(root: dict[str, Any], tmp_path: Path, **options: Any) -> CheckpointManager:
    """A manager on the same URL with an empty mirror: what another machine sees."""
    storage = {**root["options"], "cache_dir": str(tmp_path / f"other-{uuid.uuid4().hex[:6]}")}
    return CheckpointManager(
        root["url"],
        options=CheckpointManagerOptions(**options),
        storage_options=storage,
    )


def test_save_commits_with_the_marker_and_restores_elsewhere(
    root: dict[str, Any], tmp_path: Path
) -> None:
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer)
    with CheckpointManager(root["url"], storage_options=root["options"]) as mgr:
        mgr.save(5, {"model": model, "optimizer": optimizer}, metrics={"loss": 1.5})
        assert mgr.all_steps() == [5]
    keys = _keys(root)
    assert "step_00000005/_CHECKPOINT_METADATA" in keys
    assert "step_00000005/model/model.safetensors" in keys
    assert not [k for k in keys if ".orbit-tmp" in k]
    with _other_machine(root, tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [5]
        assert reader.metadata(5).metrics == {"loss": 1.5}
        fresh = _model(1)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters())
        reader.restore(5, {"model": fresh, "optimizer": fresh_optimizer}, verify=True)
    assert _same(fresh, model)
    assert torch.equal(
        fresh_optimizer.state_dict()["state"][0]["exp_avg"],
        optimizer.state_dict()["state"][0]["exp_avg"],
    )


def test_retention_deletes_objects_and_keeps_the_latest(root: dict[str, Any]) -> None:
    options = CheckpointManagerOptions(keep_last_n=2)
    model = _model(0)
    with CheckpointManager(root["url"], options=options, storage_options=root["options"]) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"model": model})
        assert mgr.all_steps() == [4, 5]
    steps = {k.split("/")[0] for k in _keys(root) if k.startswith("step_")}
    assert steps == {"step_00000004", "step_00000005"}


def test_best_n_keeps_the_best_steps(root: dict[str, Any]) -> None:
    options = CheckpointManagerOptions(keep_best_n=1, best_metric="loss", keep_last_n=1)
    model = _model(0)
    with CheckpointManager(root["url"], options=options, storage_options=root["options"]) as mgr:
        for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 5.0)]:
            mgr.save(step, {"model": model}, metrics={"loss": loss})
        assert mgr.all_steps() == [2, 4]
        assert mgr.best_step() == 2


def test_a_reader_sees_new_steps_on_reload(root: dict[str, Any], tmp_path: Path) -> None:
    model = _model(0)
    with CheckpointManager(root["url"], storage_options=root["options"]) as writer:
        writer.save(1, {"model": model})
        with _other_machine(root, tmp_path, read_only=True) as reader:
            assert reader.all_steps() == [1]
            writer.save(2, {"model": model})
            reader.reload()
            assert reader.latest_step() == 2


def test_rollback_moves_replaced_steps_to_superseded(root: dict[str, Any]) -> None:
    first, second = _model(0), _model(1)
    with CheckpointManager(root["url"], storage_options=root["options"]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": first})
        mgr.save(2, {"model": second})
        assert mgr.all_steps() == [1, 2]
        restored = _model(2)
        mgr.restore(2, {"model": restored})
        assert _same(restored, second)
    keys = _keys(root)
    superseded = {k.split("/")[1].split(".")[0] for k in keys if k.startswith("superseded/")}
    assert superseded == {"step_00000002", "step_00000003"}
    assert "step_00000003/_CHECKPOINT_METADATA" not in keys


def test_async_save_commits_in_the_background(root: dict[str, Any], tmp_path: Path) -> None:
    model = _model(0)
    options = CheckpointManagerOptions(async_save=True)
    with CheckpointManager(root["url"], options=options, storage_options=root["options"]) as mgr:
        mgr.save(1, {"model": model})
        want = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
    with _other_machine(root, tmp_path, read_only=True) as reader:
        restored = _model(3)
        reader.restore(1, {"model": restored})
    assert all(torch.equal(v, want[k]) for k, v in restored.state_dict().items())


def test_a_second_writer_is_refused(root: dict[str, Any], tmp_path: Path) -> None:
    no_wait = {**root["options"], "cache_dir": str(tmp_path / "second"), "lease_wait": 0}
    with (
        CheckpointManager(root["url"], storage_options=root["options"]),
        pytest.raises(CheckpointLockedError, match=r"renewed until .* lease_wait=0 s"),
    ):
        CheckpointManager(root["url"], storage_options=no_wait)
    with _other_machine(root, tmp_path) as after:  # released at close
        assert after.all_steps() == []


def test_a_waiting_writer_fails_when_the_holder_renews(
    root: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 35: a writer that finds a live-looking lease waits for it to expire (a log line
    says how long), and fails as soon as the holder renews it: it is alive."""
    options = {**root["options"], "lease_seconds": 3}  # renewed every second
    second = {**options, "cache_dir": str(tmp_path / "second")}
    with CheckpointManager(root["url"], storage_options=options):
        started = time.monotonic()
        with pytest.raises(CheckpointLockedError, match="renewed while this writer waited"):
            CheckpointManager(root["url"], storage_options=second)
        assert time.monotonic() - started < 2.9  # before the lease could have expired
    assert any("waiting up to" in r.getMessage() for r in caplog.records)


def _plant_lease(root: dict[str, Any], document: Any) -> None:
    """A lease object written by someone else (another host's writer, or by hand)."""
    from orbit_pt._storage.objects import open_store

    options = {k: v for k, v in root["options"].items() if k != "cache_dir"}
    store, prefix = open_store(root["url"], options)
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    store.put(f"{prefix}/.orbit-lease", body)


def test_another_hosts_lease_is_waited_for_until_it_expires(
    root: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 35: a requeued job on another node waits out the dead writer's lease (bounded by
    lease_wait), then takes over; a shorter lease_wait fails with the lease's expiry."""
    lease = {"owner": "x", "host": "another-node", "pid": 12345, "expires": time.time() + 2}
    _plant_lease(root, lease)
    short = {**root["options"], "lease_wait": 0.5}
    with pytest.raises(CheckpointLockedError, match="later than this writer waits"):
        CheckpointManager(root["url"], storage_options=short)
    started = time.monotonic()
    with CheckpointManager(root["url"], storage_options=root["options"]) as mgr:
        assert 0.5 < time.monotonic() - started < 30
        mgr.save(1, {"w": torch.zeros(2)})
    messages = [r.getMessage() for r in caplog.records]
    assert any("waiting up to" in m and "another-node" in m for m in messages), messages
    assert any("it expired" in m for m in messages), messages


@pytest.mark.parametrize(
    "document",
    [{"expires": "never"}, {"owner": "x", "expires": float("inf")}, b"garbage", [1, 2]],
    ids=["never", "infinite", "not-json", "a-list"],
)
def test_a_planted_lease_is_taken_over_with_a_warning(
    root: dict[str, Any], document: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 35: a lease no writer wrote (writers always write a well-formed one) blocked
    every writer with a bare ValueError; now it is taken over at once, and said so."""
    if isinstance(document, dict) and document.get("expires") == float("inf"):
        document = b'{"owner": "x", "expires": Infinity}'
    _plant_lease(root, document)
    with CheckpointManager(root["url"], storage_options=root["options"]) as mgr:
        mgr.save(1, {"w": torch.zeros(2)})
    assert any("not a writer's" in r.getMessage() for r in caplog.records)


_DIE_WHILE_HOLDING = textwrap.dedent(
    """
    import os, signal, sys, torch
    from orbit_pt import CheckpointManager
    url, options = sys.argv[1], eval(sys.argv[2])
    mgr = CheckpointManager(url, storage_options=options)
    mgr.save(1, {"w": torch.arange(10.0)})
    print("saved", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_dead_writer_on_this_host_is_taken_over_at_once(
    root: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 35: a requeued job on the node its writer died on reopens the root at once (the
    lease names this host and a pid that is gone), with the default 120 s lease."""
    options = dict(root["options"])
    done = subprocess.run(
        [sys.executable, "-c", _DIE_WHILE_HOLDING, root["url"], repr(options)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "saved" in done.stdout
    started = time.monotonic()
    with _other_machine(root, tmp_path) as successor:
        assert time.monotonic() - started < 10
        assert successor.all_steps() == [1]
        successor.save(2, {"w": torch.arange(3.0)})
    with _other_machine(root, tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [1, 2]
    assert any("is gone" in r.getMessage() for r in caplog.records)


def test_takeover_takes_a_live_lease(root: dict[str, Any], tmp_path: Path) -> None:
    options = {**root["options"], "lease_seconds": 1.5}
    holder = CheckpointManager(root["url"], storage_options=options)
    try:
        storage = {**options, "cache_dir": str(tmp_path / "other"), "takeover": True}
        with CheckpointManager(root["url"], storage_options=storage) as new:
            new.save(1, {"w": torch.zeros(2)})
            time.sleep(1.5)  # the old holder's renewal finds the lease is not its own
            with pytest.raises(CheckpointSaveError, match="lost the lease"):
                holder.save(2, {"w": torch.ones(2)})
            assert new.all_steps() == [1]
    finally:
        holder.close()


def test_a_failing_upload_commits_nothing(s3_faults: Any, tmp_path: Path) -> None:
    proxy, s3 = s3_faults
    root = _root(s3, tmp_path)
    model = _model(0)
    with CheckpointManager(root["url"], storage_options=root["options"]) as mgr:
        mgr.save(1, {"model": model})
        proxy.fail("error", 10_000, status=500)  # every request fails, retries included
        with pytest.raises(CheckpointSaveError, match="nothing of step 2 was committed"):
            mgr.save(2, {"model": model})
        proxy.clear()
        assert mgr.all_steps() == [1]
        mgr.save(3, {"model": model})
        assert mgr.all_steps() == [1, 3]
    steps = {k.split("/")[0] for k in _keys(root) if k.startswith("step_")}
    assert steps == {"step_00000001", "step_00000003"}


def test_throttling_and_dropped_connections_are_retried(s3_faults: Any, tmp_path: Path) -> None:
    proxy, s3 = s3_faults
    root = _root(s3, tmp_path)
    with CheckpointManager(root["url"], storage_options=root["options"]) as mgr:
        proxy.fail("slowdown", 3)
        proxy.fail("drop", 1, method="PUT")
        mgr.save(1, {"w": torch.arange(100.0)})
        assert mgr.all_steps() == [1]
        assert len(proxy.injected) == 4
    with CheckpointManager(root["url"], storage_options=root["options"]) as mgr:
        assert torch.equal(mgr.restore(1, ["w"])["w"], torch.arange(100.0))


_KILLED_MID_UPLOAD = textwrap.dedent(
    """
    import os, signal, sys, threading, torch
    from orbit_pt import CheckpointManager
    from orbit_pt._storage import streaming
    url, options = sys.argv[1], eval(sys.argv[2])
    mgr = CheckpointManager(url, storage_options=options)
    mgr.save(1, {"w": torch.arange(1000.0)})
    real = streaming.StreamingUpload.upload
    def upload_then_die(self, meta):
        real(self, meta)  # every file of step 2 is up; the marker is not
        os.kill(os.getpid(), signal.SIGKILL)
    streaming.StreamingUpload.upload = upload_then_die
    mgr.save(2, {"w": torch.arange(5.0)})
    """
)


def test_a_writer_killed_mid_upload_leaves_the_committed_steps(
    root: dict[str, Any], tmp_path: Path
) -> None:
    options = {**root["options"], "lease_seconds": 1}
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_UPLOAD, root["url"], repr(options)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert any(k.startswith("step_00000002/") for k in _keys(root))
    time.sleep(1.5)
    with _other_machine(root, tmp_path) as successor:  # takes the expired lease, cleans up
        assert successor.all_steps() == [1]
        restored = successor.restore(1, ["w"])["w"]
    assert torch.equal(restored, torch.arange(1000.0))
    assert not any(k.startswith("step_00000002/") for k in _keys(root))


def test_the_retry_policy_is_a_storage_option(s3_faults: Any, tmp_path: Path) -> None:
    proxy, s3 = s3_faults
    root = _root(s3, tmp_path)
    once = {**root["options"], "retry": {"max_attempts": 1}}
    with CheckpointManager(root["url"], storage_options=once) as mgr:
        proxy.fail("slowdown", 1, method="PUT")
        with pytest.raises(CheckpointSaveError, match=r"SlowDown|503"):
            mgr.save(1, {"w": torch.arange(10.0)})  # not retried: one attempt
        assert mgr.all_steps() == []
    patient = {**root["options"], "retry": {"max_attempts": 3, "initial_backoff": 0.001}}
    with CheckpointManager(root["url"], storage_options=patient) as mgr:
        proxy.fail("slowdown", 2, method="PUT")
        mgr.save(1, {"w": torch.arange(10.0)})  # two 503s, then the third attempt goes through
        assert mgr.all_steps() == [1]
    for bad, why in (({"attempts": 2}, "max_attempts"), ("often", "must be a dict"),
                     ({"max_attempts": 0}, "max_attempts must be >= 1")):  # fmt: skip
        with pytest.raises(CheckpointValueError, match=why):
            CheckpointManager(root["url"], storage_options={**root["options"], "retry": bad})


def test_storage_option_errors(root: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(CheckpointValueError, match="not_an_option"):
        CheckpointManager(root["url"], storage_options={**root["options"], "not_an_option": 1})
    with pytest.raises(CheckpointValueError, match="object-store"):
        CheckpointManager(tmp_path / "local", storage_options={"endpoint_url": "x"})
    with pytest.raises(CheckpointValueError, match="lease_seconds"):
        CheckpointManager(root["url"], storage_options={**root["options"], "lease_seconds": -1})


# ------------------------------------------------------------------------------------- FSDP2


def _fsdp_model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    fully_shard(model)
    return model


def _fsdp_save(rank: int, world_size: int, url: str, options: dict[str, Any]) -> None:
    model = _fsdp_model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.manual_seed(10 + rank)
    _train(model, optimizer)
    with CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(1, {"model": model, "optimizer": optimizer})
    full = {k: v.full_tensor().contiguous() for k, v in model.state_dict().items()}
    if rank == 0:
        safetensors.torch.save_file(full, str(Path(options["cache_dir"]).parent / "want.pt"))
    dist.barrier()


def _fsdp_restore(rank: int, world_size: int, url: str, options: dict[str, Any], want: str) -> None:
    model = _fsdp_model(5)
    optimizer = torch.optim.AdamW(model.parameters())
    storage = {**options, "cache_dir": options["cache_dir"] + f"-{world_size}"}
    with CheckpointManager(url, storage_options=storage) as mgr:
        mgr.restore(1, {"model": model, "optimizer": optimizer})
    expected = safetensors.torch.load_file(want)
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[name]), name


def _tp_restore(rank: int, world_size: int, url: str, options: dict[str, Any], want: str) -> None:
    """Onto tensor parallel ranks: the RowwiseParallel weight (Shard(1)) is read by ranged
    requests as rows of the ranks' shares, then moved into their column blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = _model(5)
    mesh = init_device_mesh("cpu", (world_size,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    assert model[2].weight.placements == (Shard(1),)  # type: ignore[index]
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer, steps=1)  # state of its own, to be overwritten
    storage = {**options, "cache_dir": options["cache_dir"] + "-tp"}
    with CheckpointManager(url, storage_options=storage) as mgr:
        mgr.restore(1, {"model": model, "optimizer": optimizer})
    expected = safetensors.torch.load_file(want)
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[name]), name


def test_fsdp2_save_restores_on_1_2_and_3_ranks_and_onto_tensor_parallel(
    root: dict[str, Any], tmp_path: Path
) -> None:
    options = root["options"]
    run_ranks(2, _fsdp_save, root["url"], options, timeout=240)
    want = str(tmp_path / "want.pt")
    for world_size in (1, 2, 3):
        run_ranks(world_size, _fsdp_restore, root["url"], options, want, timeout=240)
    run_ranks(2, _tp_restore, root["url"], options, want, timeout=240)


# --------------------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orbit_pt", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )


def test_the_cli_reads_and_prunes_an_object_store_root(
    root: dict[str, Any], tmp_path: Path
) -> None:
    import json

    options = CheckpointManagerOptions(keep_last_n=3)
    with CheckpointManager(root["url"], options=options, storage_options=root["options"]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": _model(step)}, metrics={"loss": float(step)})
        mgr.save(3, {"model": _model(3)}, metrics={"loss": 3.0})  # saved again: 3 is replaced
    flags = [f"--storage-option=cache_dir={tmp_path / 'cli'}"]
    listed = _cli("ls", root["url"], "--json", *flags)
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    assert [(e["step"], e["status"]) for e in doc["entries"]] == [
        (1, "committed"), (2, "committed"), (3, "committed"), (3, "superseded"),
    ]  # fmt: skip
    assert doc["retention"] == "recorded"  # the writer's record was uploaded beside the steps
    # with the endpoint given as an option instead of the environment
    endpoint = root["options"]["endpoint_url"]
    explicit = _cli("ls", root["url"], *flags, f"--storage-option=endpoint_url={endpoint}")
    assert explicit.returncode == 0, explicit.stderr
    verified = _cli("verify", root["url"], "--all", *flags)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    pruned = _cli("prune", root["url"], "--keep-last-n", "1", *flags)
    assert pruned.returncode == 0, pruned.stderr
    with _other_machine(root, tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [3]
    exported = _cli("export", root["url"], "3", str(tmp_path / "out"), *flags)
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_retention_and_rollback_leave_foreign_objects_alone(s3_root: Any, tmp_path: Path) -> None:
    where = RootUnderTest(
        "s3",
        tmp_path / "mirror",
        tmp_path,
        url=s3_root.url,
        storage_options={**s3_root.storage_options, "cache_dir": str(tmp_path / "mirror")},
    )
    where.put_foreign_objects()
    model = _model(0)
    with where.open(keep_last_n=2) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"model": model})  # retention deletes 1 and 2
        mgr.save(2, {"model": model})  # a rollback: 3 and 4 move to superseded/
        mgr.save(3, {"model": model})
        mgr.delete(2)  # by hand
        assert mgr.all_steps() == [3]
    assert where.foreign_objects_unchanged()
    foreign = {rel.split("/")[0] for rel in FOREIGN_OBJECTS}
    assert where.entries() == foreign | {"step_00000003", "superseded"}  # lease released
