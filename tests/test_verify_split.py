"""A verifying restore on several ranks checks each large file once, on one rank.

Before, every rank read every file of the step in full for ``verify=True``: N ranks read the
step N times (from an object store, N whole downloads) to load 1/N of it each. Now the
``.safetensors`` files are split between the ranks (``orbit_pt._storage.verifiers``); the
restore is one agreement, so a bad checksum on the rank that checks a file fails the restore on
every rank before anything is loaded. Real FSDP2 models on 2 gloo ranks, a local root and a
real S3 server (moto's, on loopback) behind a counting proxy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _distributed import run_ranks

from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointManagerOptions,
    CorruptCheckpointError,
)
from orbit_pt._format import checksum as _checksum
from orbit_pt._storage import verifiers
from orbit_pt.handlers import ModelHandler

STEP = 3
WIDTH = 640  # weights over 1 MiB: read by rows, not in runs of small tensors
SHARD_BYTES = 2_000_000  # a file per layer


# ------------------------------------------------------------------------------- assignment


def test_every_file_is_checked_by_exactly_one_rank_and_the_load_is_balanced() -> None:
    sizes = {f"model/model-{i:05d}.safetensors": (i * 7919) % 1000 + 100 for i in range(23)}
    for world_size in (1, 2, 3, 8, 40):
        owners = verifiers.assign(sizes, world_size)
        assert set(owners) == set(sizes)
        assert all(0 <= rank < world_size for rank in owners.values())
        load = [sum(sizes[f] for f, r in owners.items() if r == rank) for rank in range(world_size)]
        # Largest first to the least loaded: no rank ends more than one file above another.
        assert max(load) - min(load) <= max(sizes.values()), load
        assert verifiers.assign(dict(reversed(list(sizes.items()))), world_size) == owners
    assert set(verifiers.assign(sizes, 1).values()) == {0}
    assert verifiers.assign({}, 4) == {}
    with pytest.raises(ValueError, match="world_size"):
        verifiers.assign(sizes, 0)


# ------------------------------------------------------------------------------- 2 ranks


def _model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _items(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model, "optimizer": optimizer}


def _handlers() -> dict[str, Any]:
    return {"model": ModelHandler(max_shard_size=SHARD_BYTES)}  # several model files


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _save(rank: int, world_size: int, root: str, options: dict[str, Any], want: str) -> None:
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer)
    with CheckpointManager(root, handlers=_handlers(), storage_options=options or None) as mgr:
        mgr.save(STEP, _items(model, optimizer))
    full = {k: v.full_tensor().contiguous() for k, v in model.state_dict().items()}
    if rank == 0:
        safetensors.torch.save_file(full, want)
    dist.barrier()


def _spy_on_checksums(record: list[str]) -> None:
    """Record the name of every file whose checksum this process computes (then compute it)."""
    real = _checksum.of_file

    def of_file(path: Any, *args: Any, **kwargs: Any) -> Any:
        record.append(Path(path).name)
        return real(path, *args, **kwargs)

    _checksum.of_file = of_file


def _restore(
    rank: int, world_size: int, root: str, options: list[dict[str, Any]], want: str, out: str
) -> None:
    checked: list[str] = []
    _spy_on_checksums(checked)
    model = _model(5)
    optimizer = torch.optim.AdamW(model.parameters())
    with CheckpointManager(
        root, handlers=_handlers(), storage_options=options[rank] or None
    ) as mgr:
        mgr.restore(STEP, _items(model, optimizer), verify=True)
    expected = safetensors.torch.load_file(want)
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[name]), name
    Path(out, f"checked-{rank}.json").write_text(json.dumps(checked))


def _restore_fails(
    rank: int, world_size: int, root: str, options: list[dict[str, Any]], bad: str, bad_rank: int
) -> None:
    model = _model(5)
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    with (
        CheckpointManager(root, handlers=_handlers(), storage_options=options[rank] or None) as mgr,
        pytest.raises(CheckpointError) as raised,
    ):
        mgr.restore(STEP, _items(model, optimizer), verify=True)
    message = str(raised.value)
    assert bad.split("/")[-1] in message, message
    if rank == bad_rank:
        assert isinstance(raised.value, CorruptCheckpointError), repr(raised.value)
        assert "checksum" in message, message
    else:
        assert f"rank(s) [{bad_rank}]" in message, message
    # Nothing was loaded, on either rank.
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), before[name]), name
    assert not optimizer.state


def _tensor_files(
    root: Path | str, storage_options: dict[str, Any] | None = None
) -> dict[str, int]:
    read_only = CheckpointManagerOptions(read_only=True)
    with CheckpointManager(root, options=read_only, storage_options=storage_options) as mgr:
        files = mgr.metadata(STEP).files
    return {rel: f.size for rel, f in files.items() if rel.endswith(".safetensors")}


@pytest.mark.distributed
def test_two_ranks_split_the_checksums_of_a_local_step(tmp_path: Path) -> None:
    root, want = str(tmp_path / "root"), str(tmp_path / "want.safetensors")
    run_ranks(2, _save, root, {}, want, timeout=240)
    files = _tensor_files(tmp_path / "root")
    assert sum(rel.startswith("model/") for rel in files) >= 3, files

    run_ranks(2, _restore, root, [{}, {}], want, str(tmp_path), timeout=240)
    checked = [json.loads((tmp_path / f"checked-{r}.json").read_text()) for r in range(2)]
    tensors = [[name for name in c if name.endswith(".safetensors")] for c in checked]
    print(f"checked on rank 0: {tensors[0]}; on rank 1: {tensors[1]}")
    # Every tensor file once, over both ranks; neither rank reads them all.
    assert sorted(tensors[0] + tensors[1]) == sorted(Path(rel).name for rel in files)
    assert tensors[0]
    assert tensors[1]
    owners = verifiers.assign(files, 2)
    for rank in range(2):
        assert sorted(tensors[rank]) == sorted(
            Path(rel).name for rel, owner in owners.items() if owner == rank
        )


@pytest.mark.distributed
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_bad_checksum_on_the_rank_that_checks_it_fails_every_rank(
    tmp_path: Path, bad_rank: int
) -> None:
    root, want = str(tmp_path / "root"), str(tmp_path / "want.safetensors")
    run_ranks(2, _save, root, {}, want, timeout=240)
    files = _tensor_files(tmp_path / "root")
    owners = verifiers.assign(files, 2)
    bad = next(rel for rel, owner in sorted(owners.items()) if owner == bad_rank)
    path = tmp_path / "root" / f"step_{STEP:08d}" / bad
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # same size, other bytes: only the checksum sees it
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    run_ranks(2, _restore_fails, root, [{}, {}], bad, bad_rank, timeout=240)


@pytest.mark.distributed
def test_two_machines_download_each_tensor_file_once_to_verify_it(
    s3_root: Any, tmp_path: Path
) -> None:
    from _s3 import FaultProxy

    want = str(tmp_path / "want.safetensors")
    server = s3_root.server
    saved = {**server.storage_options, "cache_dir": str(tmp_path / "save-mirror")}
    run_ranks(2, _save, s3_root.url, saved, want, timeout=240)
    files = _tensor_files(s3_root.url, saved)
    proxies = [FaultProxy(server) for _ in range(2)]
    try:
        # Two machines: a proxy and an empty mirror each (not shared: each rank its own).
        options = [
            {**p.server.storage_options, "cache_dir": str(tmp_path / f"machine-{r}")}
            for r, p in enumerate(proxies)
        ]
        run_ranks(2, _restore, s3_root.url, options, want, str(tmp_path), timeout=240)
        owners = verifiers.assign(files, 2)
        for rel, size in files.items():
            suffix = f"/step_{STEP:08d}/{rel}"
            got = [
                sum(t.nbytes for t in p.transfers if t.method == "GET" and t.path.endswith(suffix))
                for p in proxies
            ]
            # The rank that checks it downloads it whole; the other reads its own rows only.
            assert got[owners[rel]] == size, (rel, got, size)
            assert got[1 - owners[rel]] < 0.75 * size, (rel, got, size)
        total = sum(files.values())
        downloaded = sum(
            t.nbytes
            for p in proxies
            for t in p.transfers
            if t.method == "GET" and t.path.endswith(".safetensors")
        )
        print(f"tensor files {total} B; downloaded by both ranks together {downloaded} B")
        assert downloaded < 1.6 * total  # it was 2x: every rank downloaded every file
    finally:
        for proxy in proxies:
            proxy.close()


def _restore_alone(root: str, options: dict[str, Any]) -> None:
    """One process (read-only: it checks every file itself) fills ``options``' mirror."""
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)])
    read_only = CheckpointManagerOptions(read_only=True)
    with CheckpointManager(
        root, options=read_only, handlers=_handlers(), storage_options=options
    ) as mgr:
        mgr.restore(STEP, {"model": model}, verify=True)


def _restore_model_fails(
    rank: int, world_size: int, root: str, options: list[dict[str, Any]], bad: str, bad_rank: int
) -> None:
    model = _model(5)
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    with (
        CheckpointManager(root, handlers=_handlers(), storage_options=options[rank]) as mgr,
        pytest.raises(CheckpointError) as raised,
    ):
        mgr.restore(STEP, {"model": model}, verify=True)
    message = str(raised.value)
    assert bad.split("/")[-1] in message, message
    if rank == bad_rank:
        assert isinstance(raised.value, CorruptCheckpointError), repr(raised.value)
    else:
        assert f"rank(s) [{bad_rank}]" in message, message
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), before[name]), name


@pytest.mark.distributed
def test_a_machine_checks_its_own_mirror_copy_of_a_file_another_rank_checks(
    s3_root: Any, tmp_path: Path
) -> None:
    """Mirrors not shared: rank 1's local copy of a file rank 0 checks is not the bytes rank 0
    read, so rank 1 checks it too; a copy damaged on rank 1's disk fails the restore."""
    want = str(tmp_path / "want.safetensors")
    server = s3_root.server
    saved = {**server.storage_options, "cache_dir": str(tmp_path / "save-mirror")}
    run_ranks(2, _save, s3_root.url, saved, want, timeout=240)
    options = [
        {**server.storage_options, "cache_dir": str(tmp_path / f"machine-{r}")} for r in range(2)
    ]
    _restore_alone(s3_root.url, options[1])  # machine 1's mirror now holds every model file
    files = {r: n for r, n in _tensor_files(s3_root.url, saved).items() if r.startswith("model/")}
    owners = verifiers.assign(files, 2)  # the files of the items restored: the model's
    bad = next(rel for rel in sorted(files) if owners[rel] == 0)
    copy = tmp_path / "machine-1" / f"step_{STEP:08d}" / bad
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0x01  # same size: only a checksum sees it; the store's object is intact
    copy.chmod(0o644)
    copy.write_bytes(bytes(data))
    run_ranks(2, _restore_model_fails, s3_root.url, options, bad, 1, timeout=240)
