"""A restore from an object-store root reads only the bytes each rank needs, with ranged GETs.

Against a real S3 server (moto's, on loopback) behind the proxy of tests/_s3.py, which counts
what each client downloaded on the wire: a rank reads the header and its own rows of each
``.safetensors`` file straight into its tensors, and nothing of those files lands in the local
mirror (a partial file there would read as zeros). Small files (JSON, msgpack) are still
downloaded whole, and a verifying restore downloads and checks whole files.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from _distributed import run_ranks
from _s3 import FaultProxy, S3Root, S3Server, Transfer

from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointManagerOptions,
    CorruptCheckpointError,
)
from orbit_pt._format import remote_files

pytest.importorskip("moto")

STEP = 1
MODEL_FILE = "model/model.safetensors"
OPTIMIZER_FILE = "optimizer/optimizer.safetensors"
READ_ONLY = CheckpointManagerOptions(read_only=True)


# ------------------------------------------------------------------------------------ models


def _plain(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))


def _llama(seed: int) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=67,
        hidden_size=16,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model: torch.nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for _ in range(2):
        model(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _assert_same(got: torch.nn.Module, want: torch.nn.Module) -> None:
    theirs = want.state_dict()
    for name, value in got.state_dict().items():
        assert torch.equal(value, theirs[name]), name


# ------------------------------------------------------------------------------ what was read


def _gets(transfers: list[Transfer], rel: str, step: int = STEP) -> list[Transfer]:
    """The GETs of the step's file ``rel`` that the proxy relayed."""
    suffix = f"/step_{step:08d}/{rel}"
    return [t for t in transfers if t.method == "GET" and t.path.endswith(suffix)]


def _downloaded(transfers: list[Transfer], rel: str) -> int:
    return sum(t.nbytes for t in _gets(transfers, rel))


def _partial_files(mirror: Path, mgr: CheckpointManager) -> list[str]:
    """Files in the mirror's step folders that are not complete listed files of the step."""
    wrong = []
    for step in mgr.all_steps():
        folder = mirror / f"step_{step:08d}"
        files = mgr.metadata(step).files
        for path in folder.rglob("*") if folder.is_dir() else ():
            if path.is_file():
                rel = path.relative_to(folder).as_posix()
                if rel not in files or path.stat().st_size != files[rel].size:
                    wrong.append(rel)
    return wrong


def _options(server: S3Server, mirror: Path) -> dict[str, Any]:
    return {**server.storage_options, "cache_dir": str(mirror)}


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("build", [_plain, _llama], ids=["plain", "llama"])
def test_a_restore_elsewhere_reads_the_weights_by_range(
    s3_faults: tuple[FaultProxy, S3Root], tmp_path: Path, build: Any
) -> None:
    proxy, s3 = s3_faults
    model = build(0)
    optimizer = torch.optim.AdamW(model.parameters())
    if build is _llama:
        model(torch.randint(0, 67, (2, 5))).logits.square().mean().backward()
    else:
        model(torch.randn(2, 64)).square().mean().backward()
    optimizer.step()
    saved = _options(proxy.server, tmp_path / "writer")
    with CheckpointManager(s3.url, storage_options=saved) as writer:
        writer.save(STEP, {"model": model, "optimizer": optimizer})
        size = writer.metadata(STEP).files[MODEL_FILE].size
        tensors = len(safetensors.torch.load_file(writer.step_dir(STEP) / MODEL_FILE))

        mirror = tmp_path / "elsewhere"  # another machine: an empty mirror
        with CheckpointManager(
            s3.url, options=READ_ONLY, storage_options=_options(proxy.server, mirror)
        ) as reader:
            before = len(proxy.transfers)
            fresh = build(1)
            fresh_optimizer = torch.optim.AdamW(fresh.parameters())
            reader.restore(STEP, {"model": fresh, "optimizer": fresh_optimizer})
            read = proxy.transfers[before:]
            _assert_same(fresh, model)
            for state, want in zip(
                fresh_optimizer.state_dict()["state"].values(),
                optimizer.state_dict()["state"].values(),
                strict=True,
            ):
                assert all(torch.equal(state[k], want[k]) for k in want)
            gets = _gets(read, MODEL_FILE)
            # Every byte once, by range: the header (two reads), then the tensors -- all small
            # in these models, so they come as one run, in one request.
            assert all(t.range is not None and t.status == 206 for t in gets), gets
            assert sum(t.nbytes for t in gets) == size
            assert tensors > 2
            assert len(gets) == 3, gets
            assert not (reader.step_dir(STEP) / MODEL_FILE).exists()  # never in the mirror
            assert _partial_files(mirror, reader) == []
            if build is _llama:  # small files are downloaded whole, as before
                assert (reader.step_dir(STEP) / "model" / "config.json").is_file()

        # The writer's mirror holds the complete files: it reads them from the disk.
        before = len(proxy.transfers)
        again = build(2)
        writer.restore(STEP, {"model": again})
        assert _gets(proxy.transfers[before:], MODEL_FILE) == []
        _assert_same(again, model)


def test_some_items_restore_elsewhere(s3_root: S3Root, tmp_path: Path) -> None:
    """Only the items asked for are fetched, and only their files are checked in the mirror."""
    model = _plain(0)
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer)
    saved = _options(s3_root.server, tmp_path / "w")
    with CheckpointManager(s3_root.url, storage_options=saved) as writer:
        writer.save(STEP, {"model": model, "optimizer": optimizer, "extra": {"n": torch.ones(3)}})
    mirror = tmp_path / "elsewhere"
    with CheckpointManager(
        s3_root.url, options=READ_ONLY, storage_options=_options(s3_root.server, mirror)
    ) as reader:
        fresh = _plain(1)
        reader.restore(STEP, {"model": fresh})
        _assert_same(fresh, model)
        assert not (reader.step_dir(STEP) / "optimizer").exists()
        assert torch.equal(reader.restore(STEP, ["extra"])["extra"]["n"], torch.ones(3))


class _OwnFormat:
    """A handler of the user's that reads its safetensors file itself, whole."""

    name = "own-format"

    def save(self, directory: Path, item: Any, context: Any) -> dict[str, Any]:
        safetensors.torch.save_file(item, str(directory / "weights.safetensors"))
        return {}

    def restore(self, directory: Path, target: Any, context: Any) -> Any:
        return safetensors.torch.load_file(str(directory / "weights.safetensors"))


def test_other_handlers_get_their_files_whole(s3_root: S3Root, tmp_path: Path) -> None:
    """Only the built-in handlers read by range; any other finds its files on disk."""
    tensors = {"a": torch.arange(10.0), "b": torch.ones(3, 4)}
    handlers = {"own": _OwnFormat()}
    saved = _options(s3_root.server, tmp_path / "w")
    with CheckpointManager(s3_root.url, handlers=handlers, storage_options=saved) as writer:
        writer.save(STEP, {"own": tensors})
    mirror = tmp_path / "elsewhere"
    with CheckpointManager(
        s3_root.url,
        options=READ_ONLY,
        handlers=handlers,
        storage_options=_options(s3_root.server, mirror),
    ) as reader:
        got = reader.restore(STEP, ["own"])["own"]
        assert (reader.step_dir(STEP) / "own" / "weights.safetensors").is_file()
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("via", ["argument", "option"])
def test_verify_downloads_and_checks_whole_files(
    s3_faults: tuple[FaultProxy, S3Root], tmp_path: Path, via: str
) -> None:
    proxy, s3 = s3_faults
    model = _plain(0)
    with CheckpointManager(s3.url, storage_options=_options(proxy.server, tmp_path / "w")) as mgr:
        mgr.save(STEP, {"model": model})
        size = mgr.metadata(STEP).files[MODEL_FILE].size
    options = CheckpointManagerOptions(read_only=True, verify_on_restore=via == "option")
    verify = True if via == "argument" else None

    def restore_elsewhere() -> tuple[CheckpointManager, torch.nn.Module]:
        mirror = tmp_path / f"elsewhere-{uuid.uuid4().hex[:6]}"
        reader = CheckpointManager(
            s3.url, options=options, storage_options=_options(proxy.server, mirror)
        )
        fresh = _plain(1)
        try:
            reader.restore(STEP, {"model": fresh}, verify=verify)
        except BaseException:
            reader.close()
            raise
        return reader, fresh

    before = len(proxy.transfers)
    reader, fresh = restore_elsewhere()
    with reader:
        _assert_same(fresh, model)
        assert _downloaded(proxy.transfers[before:], MODEL_FILE) == size
        assert (reader.step_dir(STEP) / MODEL_FILE).stat().st_size == size  # whole, in the mirror

    # Same size, other bytes: only the checksum can tell, and verify checks it.
    import boto3

    key = f"{s3.prefix}/step_{STEP:08d}/{MODEL_FILE}"
    client = boto3.client("s3", endpoint_url=s3.server.endpoint_url)
    data = bytearray(client.get_object(Bucket=s3.server.bucket, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=s3.server.bucket, Key=key, Body=bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        restore_elsewhere()


@pytest.mark.parametrize("change", ["deleted", "overwritten"])
def test_an_object_changed_between_plan_and_read_fails_naming_it(
    s3_root: S3Root, tmp_path: Path, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    from orbit_pt._storage.store import StepStore

    model = _plain(0)
    saved = _options(s3_root.server, tmp_path / "w")
    with CheckpointManager(s3_root.url, storage_options=saved) as writer:
        writer.save(STEP, {"model": model})
    key = f"{s3_root.prefix}/step_{STEP:08d}/{MODEL_FILE}"
    client = boto3.client("s3", endpoint_url=s3_root.server.endpoint_url)
    planned = StepStore.fetch

    def fetch_then_change(self: StepStore, *args: Any, **kwargs: Any) -> Any:
        files = planned(self, *args, **kwargs)  # the restore has looked the object up
        if change == "deleted":
            client.delete_object(Bucket=s3_root.server.bucket, Key=key)
        else:
            client.put_object(Bucket=s3_root.server.bucket, Key=key, Body=b"x" * 100)
        return files

    monkeypatch.setattr(StepStore, "fetch", fetch_then_change)
    mirror = tmp_path / "elsewhere"
    with CheckpointManager(
        s3_root.url, options=READ_ONLY, storage_options=_options(s3_root.server, mirror)
    ) as reader:
        where = re.escape(f"{s3_root.url}/step_00000001/{MODEL_FILE}")
        with pytest.raises(CheckpointError, match=where):
            reader.restore(STEP, {"model": _plain(1)})
        assert _partial_files(mirror, reader) == []


# ------------------------------------------------------------------------------------ FSDP2


@pytest.fixture
def proxies(moto_s3: S3Server) -> Iterator[list[FaultProxy]]:
    """One counting proxy per rank (up to 3): what each rank downloaded, counted apart."""
    started = [FaultProxy(moto_s3) for _ in range(3)]
    try:
        yield started
    finally:
        for proxy in started:
            proxy.close()


def _wide(seed: int) -> torch.nn.Module:
    """A first weight over remote_files.SMALL_TENSOR (read by rows), the rest small (in runs)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 4500), torch.nn.ReLU(), torch.nn.Linear(4500, 16)
    )


def _fsdp_model(seed: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _wide(seed)
    fully_shard(model)
    return model


def _fsdp_save(rank: int, world_size: int, url: str, options: dict[str, Any], want: str) -> None:
    model = _fsdp_model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.manual_seed(10 + rank)
    _train(model, optimizer)
    with CheckpointManager(url, storage_options=options) as mgr:
        mgr.save(STEP, {"model": model, "optimizer": optimizer})
    full = {k: v.full_tensor().contiguous() for k, v in model.state_dict().items()}
    if rank == 0:
        safetensors.torch.save_file(full, want)
    dist.barrier()


def _fsdp_restore(
    rank: int, world_size: int, url: str, options: list[dict[str, Any]], want: str
) -> None:
    """Every rank a machine of its own: its own empty mirror, its own proxy."""
    model = _fsdp_model(5)
    optimizer = torch.optim.AdamW(model.parameters())
    with CheckpointManager(url, options=READ_ONLY, storage_options=options[rank]) as mgr:
        mgr.restore(STEP, {"model": model, "optimizer": optimizer})
        assert not (mgr.step_dir(STEP) / MODEL_FILE).exists()
        assert _partial_files(Path(options[rank]["cache_dir"]), mgr) == []
    expected = safetensors.torch.load_file(want)
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[name]), name


@pytest.mark.distributed
def test_fsdp2_ranks_download_only_their_rows(
    s3_root: S3Root, proxies: list[FaultProxy], tmp_path: Path
) -> None:
    want = str(tmp_path / "want.safetensors")
    saved = _options(s3_root.server, tmp_path / "save-mirror")
    run_ranks(2, _fsdp_save, s3_root.url, saved, want, timeout=240)
    with CheckpointManager(s3_root.url, options=READ_ONLY, storage_options=saved) as mgr:
        files = mgr.metadata(STEP).files
    model_size, optimizer_size = files[MODEL_FILE].size, files[OPTIMIZER_FILE].size
    with (tmp_path / "save-mirror" / f"step_{STEP:08d}" / MODEL_FILE).open("rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
        entries = json.loads(f.read(header - 8))
    entries.pop("__metadata__", None)
    spans = [(header + a, header + b) for a, b in (e["data_offsets"] for e in entries.values())]
    # Runs of small tensors are read whole, by every rank that needs a row of them.
    runs = remote_files._runs_of(spans)
    in_runs = sum(end - start for start, end in runs)
    assert 0 < in_runs < model_size / 2
    alone = [span for span in spans if not any(a <= span[0] < b for a, b in runs)]

    for world_size in (1, 2, 3):
        for proxy in proxies:
            proxy.transfers.clear()
        options = [
            _options(proxies[rank].server, tmp_path / f"machine-{world_size}-{rank}")
            for rank in range(world_size)
        ]
        run_ranks(world_size, _fsdp_restore, s3_root.url, options, want, timeout=240)
        model_bytes = [_downloaded(proxies[r].transfers, MODEL_FILE) for r in range(world_size)]
        optimizer_bytes = [
            _downloaded(proxies[r].transfers, OPTIMIZER_FILE) for r in range(world_size)
        ]
        print(
            f"{world_size} rank(s): model file {model_size} B, downloaded per rank {model_bytes}; "
            f"optimizer file {optimizer_size} B, per rank {optimizer_bytes}"
        )
        # Each row of the large tensors once over the ranks; the header and the runs of small
        # tensors once per rank.
        assert sum(model_bytes) == model_size + (world_size - 1) * (header + in_runs)
        # One request per run and per other tensor (each under a part), two for the header.
        requests = [len(_gets(proxies[r].transfers, MODEL_FILE)) for r in range(world_size)]
        assert requests == [2 + len(runs) + len(alone)] * world_size
        if world_size > 1:
            assert max(model_bytes) < 0.75 * model_size, model_bytes
            assert max(optimizer_bytes) < 0.75 * optimizer_size, optimizer_bytes


def _one_rank_cannot_read(
    rank: int, world_size: int, url: str, options: list[dict[str, Any]]
) -> None:
    model = _fsdp_model(5)
    # A writer on each rank: a restore is then one agreement over the ranks.
    with (
        CheckpointManager(url, storage_options=options[rank]) as mgr,
        pytest.raises(CheckpointError) as raised,
    ):
        mgr.restore(STEP, {"model": model})
    message = str(raised.value)
    assert f"{url}/step_{STEP:08d}/{MODEL_FILE}" in message, message
    assert "after 8 attempts" in message, message  # retried first
    if rank == 0:
        assert "rank(s) [1]" in message, message


@pytest.mark.distributed
def test_a_rank_that_cannot_read_its_rows_fails_every_rank(
    s3_root: S3Root, proxies: list[FaultProxy], tmp_path: Path
) -> None:
    want = str(tmp_path / "want.safetensors")
    saved = _options(s3_root.server, tmp_path / "save-mirror")
    run_ranks(2, _fsdp_save, s3_root.url, saved, want, timeout=240)
    # Rank 1's reads of the weights fail, every attempt; its other requests go through.
    proxies[1].fail("error", 10_000, method="GET", path=MODEL_FILE, status=500)
    shared = tmp_path / "restore-mirror"  # writers' ranks share their mirror
    options = [_options(proxies[rank].server, shared) for rank in range(2)]
    run_ranks(2, _one_rank_cannot_read, s3_root.url, options, timeout=240)
    assert proxies[1].injected
    assert not _gets(proxies[1].transfers, MODEL_FILE)
