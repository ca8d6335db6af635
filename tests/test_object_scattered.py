"""An FSDP2 save to object storage from ranks that share no folder (as on several machines).

Each rank gets a mirror of its own, so no rank can see another's files: each writes its part of
the step into a private folder and uploads its own bytes -- whole files it wrote alone, and its
rows of the shared safetensors files as parts of one multipart upload per file, short runs
handed to a part's sender through small staging objects. The tests check that the result is the
same checkpoint (bitwise restores on 1, 2 and 3 ranks, checksums that verify), that a rank
failing at either upload agreement fails the save on every rank and leaves nothing behind,
and that the files really were sent in parts by both ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _distributed import run_ranks

from orbit_pt import CheckpointManager, CheckpointManagerOptions, CheckpointSaveError

pytest.importorskip("moto")

MiB = 2**20


def _model(seed: int) -> torch.nn.Module:
    """A 12 MiB weight (two direct parts of 6 MiB, one per rank) and small tensors whose rows
    interleave between the ranks (one mixed part)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 3072),
        torch.nn.LayerNorm(3072),
        torch.nn.Linear(3072, 8),
        torch.nn.Linear(8, 1024),
    )


def _sharded(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    fully_shard(model)
    return model


def _own(options: dict[str, Any], tag: str, rank: int) -> dict[str, Any]:
    return {**options, "cache_dir": f"{options['cache_dir']}-{tag}-rank{rank}"}


def _save(rank: int, world_size: int, url: str, options: dict[str, Any], fail: str) -> None:
    """Save step 1 from 2 ranks; with ``fail``, one rank fails at that point of the save."""
    from orbit_pt._storage import objects, scattered

    model = _sharded(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(1)
    model(torch.randn(4, 1024)).square().mean().backward()
    optimizer.step()
    with CheckpointManager(url, storage_options=_own(options, "save", rank)) as mgr:
        assert mgr._store.scattered
        failing = 0 if fail == "start_upload" else 1

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise OSError(f"injected failure in {fail}")

        if fail and rank == failing:  # this process only
            owner = objects.S3fsStore if fail == "start_upload" else scattered
            setattr(owner, fail, broken)
        if fail:
            with pytest.raises(CheckpointSaveError, match=f"injected failure in {fail}"):
                mgr.save(1, {"model": model, "optimizer": optimizer})
            assert mgr.all_steps() == []
            return
        mgr.save(1, {"model": model, "optimizer": optimizer})
        assert mgr.all_steps() == [1]
    full = {k: v.full_tensor().contiguous() for k, v in model.state_dict().items()}
    if rank == 0:
        want = Path(options["cache_dir"]).parent / "want.safetensors"
        safetensors.torch.save_file(full, str(want))
    dist.barrier()


def _restore(rank: int, world_size: int, url: str, options: dict[str, Any], want: str) -> None:
    model = _sharded(5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    storage = _own(options, f"restore{world_size}", rank)
    read = CheckpointManagerOptions(read_only=True)
    with CheckpointManager(url, options=read, storage_options=storage) as mgr:
        mgr.restore(1, {"model": model, "optimizer": optimizer}, verify=True)
    expected = safetensors.torch.load_file(want)
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[name]), name


def _objects(s3: Any) -> dict[str, dict[str, Any]]:
    import boto3

    client = boto3.client("s3")
    bucket = s3.url.split("/")[2]
    prefix = s3.prefix.rstrip("/") + "/"
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            found[o["Key"][len(prefix) :]] = o
    return found


def _incomplete_uploads(s3: Any) -> list[str]:
    import boto3

    client = boto3.client("s3")
    answer = client.list_multipart_uploads(Bucket=s3.url.split("/")[2], Prefix=s3.prefix)
    return [u["Key"] for u in answer.get("Uploads", [])]


def test_ranks_without_a_shared_folder_each_upload_their_rows(s3_root: Any, tmp_path: Path) -> None:
    options = {**s3_root.storage_options, "cache_dir": str(tmp_path / "mirror")}
    run_ranks(2, _save, s3_root.url, options, "", timeout=240)
    objects = _objects(s3_root)
    model_file = objects["step_00000001/model/model.safetensors"]
    assert model_file["Size"] > 12 * MiB
    # one multipart upload of 3 parts: rank 0's rows, rank 1's rows, the short runs together
    assert model_file["ETag"].strip('"').endswith("-3"), model_file["ETag"]
    assert not [k for k in objects if "_orbit_parts" in k]  # staging objects are gone
    assert _incomplete_uploads(s3_root) == []
    # no rank kept a partial file where a complete one is expected
    for rank in (0, 1):
        mirror = Path(_own(options, "save", rank)["cache_dir"])
        assert not (mirror / "step_00000001").exists()
    want = str(tmp_path / "want.safetensors")
    for world_size in (1, 2, 3):
        run_ranks(world_size, _restore, s3_root.url, options, want, timeout=240)
    # the recorded checksums are those of the uploaded bytes (verify=True above checked the
    # files it read; here the model file's crc32c, read in full on one process)
    with CheckpointManager(
        s3_root.url,
        options=CheckpointManagerOptions(read_only=True),
        storage_options={**options, "cache_dir": str(tmp_path / "check")},
    ) as mgr:
        meta = mgr.metadata(1)
        assert (meta.files["model/model.safetensors"].checksum or "").startswith("crc32c:")
        assert meta.world_size == 2


@pytest.mark.parametrize("point", ["start_upload", "upload_own", "upload_mixed"])
def test_a_rank_failing_at_an_upload_agreement_fails_every_rank_and_leaves_nothing(
    s3_root: Any, tmp_path: Path, point: str
) -> None:
    """Rank 0 failing to start the uploads (the plan's broadcast), or rank 1 failing in its
    own uploads or in the mixed parts: every rank raises, and the store holds nothing of the
    step -- no object, no incomplete upload."""
    options = {**s3_root.storage_options, "cache_dir": str(tmp_path / "mirror")}
    run_ranks(2, _save, s3_root.url, options, point, timeout=240)
    assert _objects(s3_root) == {} or set(_objects(s3_root)) <= {".orbit-lease"}
    assert _incomplete_uploads(s3_root) == []


def _private_folder_fails(rank: int, world_size: int, url: str, options: dict[str, Any]) -> None:
    from orbit_pt import CheckpointError

    own = _own(options, "open", rank)
    if rank == 1:  # its private folder cannot be made: a file is in the way
        (Path(own["cache_dir"]) / ".orbit-ranks").mkdir(parents=True)
        (Path(own["cache_dir"]) / ".orbit-ranks" / "rank_00001").write_text("in the way")
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\]"):
        CheckpointManager(url, storage_options=own)


def test_a_rank_that_cannot_make_its_private_folder_fails_the_open_everywhere(
    s3_root: Any, tmp_path: Path
) -> None:
    options = {**s3_root.storage_options, "cache_dir": str(tmp_path / "mirror")}
    run_ranks(2, _private_folder_fails, s3_root.url, options, timeout=180)
    # nothing stays locked: a writer opens the root at once
    with CheckpointManager(s3_root.url, storage_options=options) as mgr:
        assert mgr.all_steps() == []
