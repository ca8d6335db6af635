"""orbit_pt.integrations.lightning: Lightning saves and resumes through orbit_pt, exactly.

Each training run of examples/lightning_finetune.py is a new process (a tiny GPT-2 with dropout,
AdamW with warm-up, a shuffling StatefulDataLoader, ModelCheckpoint every 2 steps with top-k by
training loss and ``last``). A run killed after a step (``os._exit``) and resumed with
``fit(ckpt_path="last")`` sees the same batches and per-step losses, bitwise, as the run that
never stopped, and ends with the same weights -- alone, and on 2 gloo ranks (DDP) under
torchrun. ModelCheckpoint keeps the same files as with Lightning's own checkpoints, and the best
one holds the same model. Bad input is a clear orbit_pt error; nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")
transformers = pytest.importorskip("transformers")

from _examples import REPO, digest, run_example  # noqa: E402

from orbit_pt import (  # noqa: E402
    CheckpointError,
    CheckpointManagerOptions,
    CheckpointSaveError,
    CheckpointValueError,
    StepNotFoundError,
)
from orbit_pt.integrations import lightning as orbit_lightning  # noqa: E402

EXAMPLE = REPO / "examples" / "lightning_finetune.py"
STEPS = 10  # 6 batches an epoch alone, 3 a rank on 2 ranks: the cut and resume cross epochs


def _run(output_dir: Path, out: Path, *extra: str, ranks: int = 1) -> list[dict[str, Any]]:
    """Run the example (under torchrun with ``ranks`` > 1); each rank's record."""
    return run_example(EXAMPLE, out, str(output_dir), f"--steps={STEPS}", *extra, ranks=ranks)


def _only_open_formats(step_dir: Path) -> None:
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    others = [p.name for p in files if p.suffix not in (".safetensors", ".json", ".msgpack")]
    assert others == ["_CHECKPOINT_METADATA"]


@pytest.mark.parametrize(
    ("ranks", "stop"),
    [
        (1, 5),  # resumes from step 4, mid-epoch (6 batches an epoch)
        (1, 7),  # resumes from step 6, saved on an epoch's last batch
        pytest.param(2, 5, marks=pytest.mark.distributed),  # from step 4: mid-epoch 2 of 3
        pytest.param(2, 3, marks=pytest.mark.distributed),  # from step 2, then across epochs
    ],
)
def test_a_killed_run_resumes_exactly_in_a_new_process(
    tmp_path: Path, ranks: int, stop: int
) -> None:
    whole = _run(tmp_path / "whole", tmp_path / "whole.json", ranks=ranks)
    first = _run(tmp_path / "cut", tmp_path / "first.json", f"--stop={stop}", ranks=ranks)
    resumed = _run(tmp_path / "cut", tmp_path / "resumed.json", ranks=ranks)
    saved = stop // 2 * 2  # the last step saved before the kill
    for rank in range(ranks):
        assert len(whole[rank]["losses"]) == STEPS
        assert first[rank]["batches"][:saved] + resumed[rank]["batches"] == whole[rank]["batches"]
        assert first[rank]["losses"][:saved] + resumed[rank]["losses"] == whole[rank]["losses"]
        assert resumed[rank]["weights"] == whole[rank]["weights"]
    # Every step holds only safetensors, JSON and msgpack; its model/ is a from_pretrained folder.
    root = tmp_path / "whole" / "orbit"
    last = json.loads((tmp_path / "whole" / "checkpoints" / "last.ckpt").read_text())
    assert last["orbit_step"] == STEPS
    for step_dir in root.glob("step_*"):
        _only_open_formats(step_dir)
    model = transformers.GPT2LMHeadModel.from_pretrained(root / f"step_{STEPS:08d}" / "model")
    assert digest(model) == whole[0]["weights"]


@pytest.mark.distributed
def test_under_fsdp2_each_rank_saves_its_shards_and_a_killed_run_resumes_exactly(
    tmp_path: Path,
) -> None:
    """OrbitModelParallelStrategy: the module shards its GPT-2 with fully_shard in
    configure_model; every save hands the sharded model and optimizer to orbit_pt on every
    rank (no gather, no DCP folder, no pickle), and a run killed after step 5 resumes from
    step 4 with the same batches, losses and final weights as the run that never stopped."""
    whole = _run(tmp_path / "whole", tmp_path / "whole.json", "--fsdp", ranks=2)
    first = _run(tmp_path / "cut", tmp_path / "first.json", "--fsdp", "--stop=5", ranks=2)
    resumed = _run(tmp_path / "cut", tmp_path / "resumed.json", "--fsdp", ranks=2)
    for rank in range(2):
        assert first[rank]["batches"][:4] + resumed[rank]["batches"] == whole[rank]["batches"]
        assert first[rank]["losses"][:4] + resumed[rank]["losses"] == whole[rank]["losses"]
        assert resumed[rank]["weights"] == whole[rank]["weights"]
    assert resumed[0]["files"] == whole[0]["files"]
    root = tmp_path / "cut" / "orbit"
    step_dir = root / f"step_{STEPS:08d}"
    _only_open_formats(step_dir)
    metadata = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    assert metadata["world_size"] == 2
    # The model is the step's HF folder alone: Lightning's item holds none of its weights.
    from safetensors.torch import load_file

    lightning_tensors = load_file(step_dir / "lightning" / "tensors.safetensors")
    assert not [key for key in lightning_tensors if "model." in key]
    model = transformers.GPT2LMHeadModel.from_pretrained(step_dir / "model")
    assert digest(model) == whole[0]["weights"]


@pytest.mark.distributed
def test_an_fsdp2_step_saved_on_2_ranks_resumes_in_one_process(tmp_path: Path) -> None:
    """A step saved by 2 FSDP2 ranks loads into one process: the model is resharded bitwise,
    and training goes on (the optimizers resharded; the data loaders' positions, which belong
    to the old ranks' samplers, and the per-rank RNG are left out with a warning, instead of
    failing inside torchdata)."""
    two = _run(tmp_path / "run", tmp_path / "two.json", "--fsdp", "--steps=6", ranks=2)
    loaded = _run(tmp_path / "run", tmp_path / "one.json", "--fsdp", "--steps=6")[0]
    assert loaded["losses"] == []  # max_steps already reached: nothing trained
    assert loaded["weights"] == two[0]["weights"]
    more = _run(tmp_path / "run", tmp_path / "more.json", "--fsdp", "--steps=9")[0]
    assert len(more["losses"]) == 3
    assert all(0.0 < float.fromhex(loss) < 10.0 for loss in more["losses"])
    last = json.loads((tmp_path / "run" / "checkpoints" / "last.ckpt").read_text())
    assert last["orbit_step"] == 8
    metadata = json.loads(
        (tmp_path / "run" / "orbit" / "step_00000008" / "_CHECKPOINT_METADATA").read_text()
    )
    assert metadata["world_size"] == 1


def test_after_a_resume_the_files_are_lightnings_and_only_lightning_drifts(tmp_path: Path) -> None:
    """Killed after step 3 (the first save, at 2, was also the first ``last.ckpt``) and
    resumed: ModelCheckpoint goes on with the same files as with Lightning's own checkpoints
    (the pointer of the second save of step 2 carries its ``last_model_path``). Lightning's
    own resume sees the right data but draws other random numbers (no RNG saved)."""
    whole = _run(tmp_path / "whole", tmp_path / "whole.json", "--native")[0]
    _run(tmp_path / "native", tmp_path / "first.json", "--native", "--stop=3")
    native = _run(tmp_path / "native", tmp_path / "native.json", "--native")[0]
    _run(tmp_path / "orbit", tmp_path / "first.json", "--stop=3")
    ours = _run(tmp_path / "orbit", tmp_path / "orbit.json")[0]
    assert ours["files"] == native["files"] == whole["files"]
    assert ours["losses"] == whole["losses"][2:]
    assert native["batches"] == whole["batches"][2:]  # the data is right
    assert native["losses"] != whole["losses"][2:]  # the random numbers are not


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_model_checkpoint_keeps_what_it_keeps_with_lightnings_own_files(
    tmp_path: Path, top_k: int
) -> None:
    native = _run(tmp_path / "native", tmp_path / "native.json", "--native", f"--top-k={top_k}")
    ours = _run(tmp_path / "orbit", tmp_path / "orbit.json", f"--top-k={top_k}")
    assert ours[0]["files"] == native[0]["files"]
    assert ours[0]["best"] == native[0]["best"]
    assert ours[0]["losses"] == native[0]["losses"]
    # The steps kept: those the pointers name, plus the newest (orbit_pt never deletes it).
    folder = tmp_path / "orbit" / "checkpoints"
    named = {orbit_lightning.read_pointer(folder / name) for name in ours[0]["files"]}
    kept = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "orbit" / "orbit").glob("step_*"))
    assert kept == sorted(named | {STEPS})
    # The best checkpoint holds the same model as Lightning's own best file.
    step = orbit_lightning.read_pointer(folder / ours[0]["best"])
    best = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path / "orbit" / "orbit" / f"step_{step:08d}" / "model"
    )
    saved = torch.load(tmp_path / "native" / "checkpoints" / native[0]["best"], weights_only=True)
    weights = {k.removeprefix("model."): v for k, v in saved["state_dict"].items()}
    assert digest(best) == _digest_of(weights)


def test_async_saves_point_only_at_committed_steps(tmp_path: Path) -> None:
    sync = _run(tmp_path / "sync", tmp_path / "sync.json")[0]
    run = _run(tmp_path / "async", tmp_path / "async.json", "--async-save")[0]
    assert run["losses"] == sync["losses"]
    assert run["files"] == sync["files"]
    folder = tmp_path / "async" / "checkpoints"
    for name in run["files"]:
        step = orbit_lightning.read_pointer(folder / name)
        assert (tmp_path / "async" / "orbit" / f"step_{step:08d}").is_dir()


def _digest_of(weights: dict[str, torch.Tensor]) -> str:
    """digest() of a module with these weights."""
    hasher = hashlib.sha256()
    for name, value in sorted(weights.items()):
        hasher.update(name.encode())
        hasher.update(value.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


# ------------------------------------------------------------------------------ bad input


class _Tiny(pl.LightningModule):  # type: ignore[name-defined]
    def __init__(self, **hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(batch[0]).pow(2).mean()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2
        )


def _trainer(tmp_path: Path, io: Any, *callbacks: Any, **kwargs: Any) -> Any:
    from pytorch_lightning.callbacks import ModelCheckpoint

    checkpoints = kwargs.pop("checkpoints", None) or ModelCheckpoint(
        dirpath=tmp_path / "checkpoints", every_n_train_steps=2, save_last=True
    )
    kwargs.setdefault("max_steps", 4)
    return pl.Trainer(
        accelerator="cpu", plugins=[io], callbacks=[*callbacks, checkpoints],
        logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def test_a_removed_checkpoints_step_goes_and_is_forgotten_once_deleted(tmp_path: Path) -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint

    io = orbit_lightning.OrbitCheckpointIO(tmp_path / "orbit")
    newest = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2)  # top 1
    _trainer(tmp_path, io, io.callback(), checkpoints=newest, max_steps=6).fit(_Tiny())
    assert [p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")] == ["epoch=1-step=6.ckpt"]
    assert [p.name for p in (tmp_path / "orbit").glob("step_*")] == ["step_00000006"]
    # Steps 2 and 4 were released, then deleted: the record beside the pointers forgets them,
    # so that a step saved again under their number is never taken for them.
    record = json.loads((tmp_path / "checkpoints" / orbit_lightning.RELEASED_FILE).read_text())
    assert record["steps"] == []


def test_a_foreign_ckpt_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    foreign = tmp_path / "foreign.ckpt"
    # A pickle whose loading would create the marker: Lightning's own format is such a file.
    foreign.write_bytes(pickle.dumps(_Touch(str(marker))))
    torch.save({"state_dict": {}}, tmp_path / "zip.ckpt")
    io = orbit_lightning.OrbitCheckpointIO(tmp_path / "orbit")
    for path in (foreign, tmp_path / "zip.ckpt"):
        trainer = _trainer(tmp_path, io, io.callback())
        with pytest.raises(CheckpointError, match=r"torch pickle.*never unpickles") as caught:
            trainer.fit(_Tiny(), ckpt_path=path)
        assert re.escape(str(path)) in re.escape(str(caught.value))
    assert not marker.exists()
    text = tmp_path / "text.ckpt"
    text.write_text('{"something": "else"}')
    with pytest.raises(CheckpointError, match="is not an orbit_pt pointer"):
        orbit_lightning.read_pointer(text)


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (Path.touch, (Path(self.path),))


def test_a_pointer_to_a_step_that_does_not_exist_is_step_not_found(tmp_path: Path) -> None:
    io = orbit_lightning.OrbitCheckpointIO(tmp_path / "orbit")
    trainer = _trainer(tmp_path, io, io.callback())
    trainer.fit(_Tiny())
    assert io.root == tmp_path / "orbit"
    pointer = tmp_path / "checkpoints" / "last.ckpt"
    record = json.loads(pointer.read_text())
    assert record["orbit_step"] == 4
    record["orbit_step"] = 99
    pointer.write_text(json.dumps(record))
    trainer = _trainer(tmp_path, io, io.callback(), max_steps=6)
    with pytest.raises(StepNotFoundError, match="99"):
        trainer.fit(_Tiny(), ckpt_path=pointer)


def test_hyperparameters_that_msgpack_cannot_hold_are_named(tmp_path: Path) -> None:
    io = orbit_lightning.OrbitCheckpointIO(tmp_path / "orbit")
    trainer = _trainer(tmp_path, io, io.callback())
    with pytest.raises(CheckpointSaveError, match="hyper_parameters/tokenizer"):
        trainer.fit(_Tiny(tokenizer=object()))
    assert not list((tmp_path / "orbit").glob("step_*"))  # nothing committed
    assert not list((tmp_path / "checkpoints").glob("*.ckpt"))  # and no pointer


def test_wrong_set_ups_are_clear_errors(tmp_path: Path) -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    with pytest.raises(CheckpointValueError, match="keeps what ModelCheckpoint keeps"):
        orbit_lightning.OrbitCheckpointIO(tmp_path, CheckpointManagerOptions(keep_last_n=2))
    io = orbit_lightning.OrbitCheckpointIO(tmp_path / "orbit")
    with pytest.raises(CheckpointValueError, match="async_save=True"):
        pl.Trainer(
            accelerator="cpu", max_steps=2, plugins=[AsyncCheckpointIO(io)],
            callbacks=[io.callback()], logger=False, enable_progress_bar=False,
        ).fit(_Tiny())  # fmt: skip
    io = orbit_lightning.OrbitCheckpointIO(tmp_path / "orbit")
    weights_only = ModelCheckpoint(tmp_path / "w", every_n_train_steps=2, save_weights_only=True)
    with pytest.raises(CheckpointValueError, match="save_weights_only"):
        _trainer(tmp_path, io, io.callback(), checkpoints=weights_only).fit(_Tiny())
    io = orbit_lightning.OrbitCheckpointIO(tmp_path / "orbit")
    with pytest.raises(CheckpointValueError, match="model_attr"):
        _trainer(tmp_path, io, io.callback(model_attr="net")).fit(_Tiny())
    io = orbit_lightning.OrbitCheckpointIO(tmp_path / "orbit")
    with pytest.raises(CheckpointError, match=r"io\.callback\(\)"):
        _trainer(tmp_path, io).fit(_Tiny())  # the plugin without its callback
    assert not list((tmp_path / "orbit").glob("step_*"))


def test_strategies_that_write_their_own_checkpoints_are_refused(tmp_path: Path) -> None:
    from pytorch_lightning.strategies import ModelParallelStrategy

    io = orbit_lightning.OrbitCheckpointIO(tmp_path / "orbit")
    trainer = _trainer(tmp_path, io, io.callback(), strategy=ModelParallelStrategy(), devices=1)
    try:
        with pytest.raises(CheckpointValueError, match="not ModelParallelStrategy"):
            trainer.fit(_Tiny())
    finally:  # the strategy set up a (one-process) default group: leave none behind
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert not list((tmp_path / "orbit").glob("step_*"))


def test_the_orbit_strategy_needs_the_plugin_and_takes_no_dcp_option(tmp_path: Path) -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint

    strategy_class = orbit_lightning.OrbitModelParallelStrategy
    with pytest.raises(CheckpointValueError, match="no save_distributed_checkpoint"):
        strategy_class(save_distributed_checkpoint=False)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy_class(), max_steps=2,
        callbacks=[checkpoints], logger=False, enable_progress_bar=False,
    )  # fmt: skip
    try:
        with pytest.raises(CheckpointValueError, match=r"plugins=\[OrbitCheckpointIO"):
            trainer.fit(_Tiny())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert not (tmp_path / "checkpoints").exists()  # nothing saved the default way


# --------------------------------------------------------------- a failure on one rank


def _state_fails_on_rank_0(rank: int, world_size: int, root: str) -> None:
    from orbit_pt import CheckpointManager, CheckpointSaveError

    handlers = {orbit_lightning.LIGHTNING: orbit_lightning._LightningStateHandler()}
    # rank 0 writes Lightning's state; an object msgpack cannot hold fails its write there
    state = {"hyper_parameters": {"tokenizer": object() if rank == 0 else "ok"}}
    with CheckpointManager(root, handlers=handlers) as mgr:
        with pytest.raises(CheckpointSaveError, match="tokenizer"):
            mgr.save(1, {orbit_lightning.LIGHTNING: state}, force=True)
        assert mgr.all_steps() == []


@pytest.mark.distributed
def test_a_failed_lightning_state_write_on_rank_0_fails_every_rank(tmp_path: Path) -> None:
    from _distributed import run_ranks

    run_ranks(2, _state_fails_on_rank_0, str(tmp_path / "ckpt"), timeout=120.0)


class _ShardedTiny(_Tiny):
    """_Tiny with its model sharded by FSDP2 (fully_shard) in configure_model: 4 rows, so that
    each of 2 ranks holds (and writes) some."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(4, 4)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.device_mesh is not None:
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])


def _fsdp2_write_fails_on_rank_1(rank: int, world_size: int, root: str) -> None:
    import os

    from pytorch_lightning.callbacks import ModelCheckpoint

    from orbit_pt._format import direct_io, sharding

    # The ranks are up (gloo, run_ranks); Lightning joins that group as under torchrun.
    os.environ.update(
        TORCHELASTIC_RUN_ID="orbit-test", RANK=str(rank), LOCAL_RANK=str(rank),
        GROUP_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    if rank == 1:  # its rows of the model files cannot be written: that node's disk is full

        class Full(direct_io.RangeWriter):
            def write(self, *args: Any, **kwargs: Any) -> Any:
                raise OSError(28, "No space left on device (injected)")

        sharding.RangeWriter = Full  # type: ignore[attr-defined]
    io = orbit_lightning.OrbitCheckpointIO(Path(root) / "orbit")
    checkpoints = ModelCheckpoint(dirpath=Path(root) / "checkpoints", every_n_train_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_steps=4, logger=False,
        strategy=orbit_lightning.OrbitModelParallelStrategy(
            data_parallel_size=world_size, tensor_parallel_size=1
        ),
        plugins=[io], callbacks=[io.callback(), checkpoints], enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(CheckpointSaveError) as raised:
        trainer.fit(_ShardedTiny())
    message = str(raised.value)
    assert "on rank(s) [1] of 2" in message, message  # the same on both ranks
    assert "No space left" in message, message
    # Nothing committed, and no pointer names a step that is not there.
    assert not list((Path(root) / "orbit").glob("step_*[0-9]"))
    assert not list((Path(root) / "checkpoints").glob("*.ckpt"))


@pytest.mark.distributed
def test_under_fsdp2_a_write_failing_on_one_rank_fails_the_save_on_every_rank(
    tmp_path: Path,
) -> None:
    """Every rank writes its own shards: when rank 1's write fails (ENOSPC), both ranks' fit
    raises the same CheckpointSaveError naming rank 1, nothing is committed and no ModelCheckpoint
    pointer is written -- and no rank is left waiting in the save (run_ranks' hard timeout)."""
    from _distributed import run_ranks

    run_ranks(2, _fsdp2_write_fails_on_rank_1, str(tmp_path), timeout=180.0)


def _fsdp2_read_fails_on_rank_1(rank: int, world_size: int, root: str) -> None:
    import os

    from pytorch_lightning.callbacks import ModelCheckpoint

    from orbit_pt._format.safetensors import SafetensorsReader

    os.environ.update(
        TORCHELASTIC_RUN_ID="orbit-test", RANK=str(rank), LOCAL_RANK=str(rank),
        GROUP_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip

    def fit(max_steps: int, ckpt_path: str | None) -> None:
        io = orbit_lightning.OrbitCheckpointIO(Path(root) / "orbit")
        checkpoints = ModelCheckpoint(
            dirpath=Path(root) / "checkpoints", every_n_train_steps=2, save_last=True
        )
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, max_steps=max_steps, logger=False,
            strategy=orbit_lightning.OrbitModelParallelStrategy(
                data_parallel_size=world_size, tensor_parallel_size=1
            ),
            plugins=[io], callbacks=[io.callback(), checkpoints], enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(_ShardedTiny(), ckpt_path=ckpt_path)

    fit(2, None)  # step 2 committed by both ranks
    if rank == 1:  # its rows of the model file cannot be read back: a disk error on that node

        def unreadable(self: Any, offset: int, view: memoryview) -> None:
            raise OSError(5, "Input/output error (injected)")

        SafetensorsReader.read_range = unreadable  # type: ignore[method-assign]
    with pytest.raises(CheckpointError) as raised:
        fit(4, "last")
    message = str(raised.value)
    # As every agreed restore: the failing rank raises its own error, the others one naming it.
    assert ("rank(s) [1]" in message) == (rank == 0), message
    assert "Input/output error" in message, message


@pytest.mark.distributed
def test_under_fsdp2_a_read_failing_on_one_rank_fails_the_resume_on_every_rank(
    tmp_path: Path,
) -> None:
    """Every rank reads its own rows on a resume: when rank 1's read fails, rank 1's fit raises
    that error and rank 0's one naming rank 1 and its cause -- no rank trains on with a
    half-restored model, and none is left waiting (run_ranks' hard timeout)."""
    from _distributed import run_ranks

    run_ranks(2, _fsdp2_read_fails_on_rank_1, str(tmp_path), timeout=180.0)
