"""orbit_pt.integrations.hf: the HF Trainer saves and resumes through orbit_pt, exactly.

Each training run of examples/hf_trainer_finetune.py is a new process (a tiny GPT-2 with dropout,
AdamW with warm-up, a user's own Trainer subclass with OrbitTrainerMixin in front). A run
stopped after step 5 and resumed with ``resume_from_checkpoint=True`` has the same per-step
losses, bitwise, as the run that never stopped, and the same final weights -- alone, and on 2
gloo ranks (DDP) under torchrun. ``save_total_limit`` keeps what transformers' own rotation
keeps, and with ``load_best_model_at_end`` the run ends with the best step's model, as a plain
Trainer's does. Bad input is a clear orbit_pt error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _examples import REPO, digest, run_example  # noqa: E402

from orbit_pt import CheckpointError, StepNotFoundError  # noqa: E402
from orbit_pt.integrations import hf  # noqa: E402
from orbit_pt.policies import CheckpointInfo  # noqa: E402

EXAMPLE = REPO / "examples" / "hf_trainer_finetune.py"
STEPS = 10  # 6 batches an epoch alone, 3 a rank on 2 ranks: the cut and resume cross epochs


def _run(output_dir: Path, out: Path, *extra: str, ranks: int = 1) -> list[dict[str, Any]]:
    """Run the example (under torchrun with ``ranks`` > 1); each rank's record."""
    return run_example(EXAMPLE, out, str(output_dir), f"--steps={STEPS}", *extra, ranks=ranks)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_stopped_run_resumes_exactly_in_a_new_process(tmp_path: Path, ranks: int) -> None:
    whole = _run(tmp_path / "whole", tmp_path / "whole.json", ranks=ranks)
    first = _run(tmp_path / "cut", tmp_path / "first.json", "--stop=5", ranks=ranks)
    resumed = _run(tmp_path / "cut", tmp_path / "resumed.json", ranks=ranks)
    for rank in range(ranks):
        assert len(whole[rank]["losses"]) == STEPS
        assert first[rank]["losses"][:4] + resumed[rank]["losses"] == whole[rank]["losses"]
        assert resumed[rank]["weights"] == whole[rank]["weights"]
    # What a step holds: only safetensors, JSON and msgpack; nothing the native way.
    root = tmp_path / "whole" / "orbit"
    folder = root / f"step_{STEPS:08d}"
    files = [p for p in folder.rglob("*") if p.is_file()]
    others = [p.name for p in files if p.suffix not in (".safetensors", ".json", ".msgpack")]
    assert others == ["_CHECKPOINT_METADATA"]
    assert (folder / "trainer_state" / "trainer_state.json").is_file()
    saved_args = json.loads((folder / "trainer_state" / "training_args.json").read_text())
    assert saved_args["save_steps"] == 2
    assert not list((tmp_path / "whole").glob("checkpoint-*"))
    model = transformers.GPT2LMHeadModel.from_pretrained(folder / "model")
    assert digest(model) == whole[0]["weights"]


# ------------------------------------------------------------------- retention, as HF keeps


@pytest.mark.parametrize(
    ("limit", "losses"),
    [
        (2, {2: 0.1, 4: 0.5, 6: 0.6, 8: 0.7}),  # HF keeps [2, 8]
        (3, {2: 0.9, 4: 0.1, 6: 0.6, 8: 0.7, 10: 0.8}),
        (3, {2: 0.9, 4: 0.8, 6: 0.1, 8: 0.7, 10: 0.8}),
        (2, {2: 0.9, 4: 0.8, 6: 0.7, 8: 0.1}),  # the best is the newest
        (1, {2: 0.1, 4: 0.8, 6: 0.9}),  # limit 1 with an older best: HF keeps 2
        (2, {2: 0.5, 4: 0.5, 6: 0.9}),  # equal metrics: the earlier is the best
        (2, {2: float("nan"), 4: 0.5}),  # only ranked steps compete
    ],
)
def test_keep_total_with_best_keeps_what_transformers_rotation_keeps(
    tmp_path: Path, limit: int, losses: dict[int, float]
) -> None:
    from transformers.trainer_utils import rotate_checkpoints

    ranked = {step: loss for step, loss in losses.items() if loss == loss}
    best = min(ranked, key=lambda step: (ranked[step], step))
    for step in losses:
        (tmp_path / f"checkpoint-{step}").mkdir()
    rotate_checkpoints(str(tmp_path), limit, str(tmp_path / f"checkpoint-{best}"))
    theirs = sorted(int(p.name.split("-")[1]) for p in tmp_path.iterdir())
    infos = [
        CheckpointInfo(step=s, time=0.0, metrics={} if loss != loss else {"eval_loss": loss})
        for s, loss in losses.items()
    ]
    ours = hf.KeepTotalWithBest(limit, "eval_loss", "min").keep(infos)
    assert sorted(ours) == theirs


def _trainer(cls: Any, output_dir: Path, **extra: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    tokens = torch.randint(0, 50, (12, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=8,
        per_device_train_batch_size=2,
        learning_rate=5e-2,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **extra,
    )
    model = transformers.GPT2LMHeadModel(config)
    return cls(model=model, args=args, train_dataset=data, eval_dataset=data[:4])


def test_save_total_limit_and_the_best_model_as_the_plain_trainer(tmp_path: Path) -> None:
    extra = {"save_total_limit": 2, "load_best_model_at_end": True, "greater_is_better": True,
             "metric_for_best_model": "loss"}  # fmt: skip  # the worst loss: an older best
    native = _trainer(transformers.Trainer, tmp_path / "native", **extra)
    native.train()
    ours = _trainer(hf.OrbitTrainer, tmp_path / "orbit", **extra)
    ours.train()
    kept = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "native").glob("checkpoint-*"))
    mgr = ours.checkpoint_manager
    assert mgr.all_steps() == kept
    assert len(kept) == 2
    assert ours.state.best_global_step == native.state.best_global_step < 8
    best = ours.state.best_global_step
    assert ours.state.best_model_checkpoint == str(mgr.step_dir(best) / "model")
    assert digest(ours.model) == digest(native.model)  # the best step's model, loaded
    assert not list((tmp_path / "orbit").glob("checkpoint-*"))


def test_async_saves_are_durable_when_train_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import Trainer

    from orbit_pt import CheckpointManagerOptions

    class AsyncTrainer(hf.OrbitTrainerMixin, Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            options = CheckpointManagerOptions(async_save=True, preemption_signals=())
            super().__init__(*args, orbit_options=options, **kwargs)

    trainer = _trainer(AsyncTrainer, tmp_path / "out")
    with caplog.at_level("WARNING", logger="orbit_pt"):
        trainer.train()
    assert "saving synchronously" not in caplog.text  # every item can be staged
    mgr = trainer.checkpoint_manager
    assert mgr.all_steps() == [2, 4, 6, 8]
    state = json.loads((mgr.step_dir(8) / "trainer_state" / "trainer_state.json").read_text())
    assert state["global_step"] == 8


def test_bad_resume_arguments_are_clear_errors(tmp_path: Path) -> None:
    trainer = _trainer(hf.OrbitTrainer, tmp_path / "out")
    with pytest.raises(StepNotFoundError, match="no committed checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    trainer.train()
    with pytest.raises(StepNotFoundError, match="step 99 is not"):
        trainer.train(resume_from_checkpoint=99)
    with pytest.raises(CheckpointError, match="is not a step folder"):
        trainer.train(resume_from_checkpoint=str(tmp_path))
    step_folder = trainer.checkpoint_manager.step_dir(4)
    assert trainer._orbit_resume_path(str(step_folder / "model")) == str(
        step_folder / "trainer_state"
    )


@pytest.mark.distributed
def test_on_another_number_of_ranks_the_rng_is_left_as_seeded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The RNG of a step saved by 2 ranks is per rank: a one-process resume keeps the seeds it
    set (as the Trainer does when it finds no RNG file for its rank) and warns, rather than
    load rank 0's streams; the same world size restores them."""
    out = tmp_path / "out"
    _run(out, tmp_path / "two.json", "--steps=4", ranks=2)
    trainer = _trainer(hf.OrbitTrainer, out)
    resume = trainer._orbit_resume_path(True)
    torch.manual_seed(123)
    seeded = torch.get_rng_state()
    with caplog.at_level("WARNING", logger="orbit_pt.integrations.hf"):
        trainer._load_rng_state(resume)
    assert torch.equal(torch.get_rng_state(), seeded)
    assert "saved by 2 rank(s), this run has 1: the RNG is not restored" in caplog.text
    trainer.checkpoint_manager.close()
    # Same world size: the saved streams come back.
    _run(tmp_path / "one", tmp_path / "one.json", "--steps=4")
    alone = _trainer(hf.OrbitTrainer, tmp_path / "one")
    torch.manual_seed(123)
    alone._load_rng_state(alone._orbit_resume_path(True))
    assert not torch.equal(torch.get_rng_state(), seeded)
    alone.checkpoint_manager.close()


def test_importing_the_integrations_imports_no_framework() -> None:
    code = (
        "import sys, orbit_pt, orbit_pt.integrations\n"
        "import orbit_pt.integrations.hf, orbit_pt.integrations.accelerate\n"
        "import orbit_pt.integrations.lightning\n"
        "frameworks = ('accelerate', 'lightning', 'pytorch_lightning', 'transformers')\n"
        "loaded = [m for m in frameworks if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr


def _trainer_files_fail_on_rank_0(rank: int, world_size: int, root: str) -> None:
    from orbit_pt import CheckpointManager, CheckpointSaveError

    handlers = {hf.TRAINER_STATE: hf._TrainerStateHandler()}
    # rank 0 writes the files; a state that is not text fails its write
    state: Any = 12345 if rank == 0 else "{}"
    with CheckpointManager(root, handlers=handlers) as mgr:
        with pytest.raises(CheckpointSaveError):
            mgr.save(1, {hf.TRAINER_STATE: hf.TrainerFiles(state, "{}")}, force=True)
        assert mgr.all_steps() == []


@pytest.mark.distributed
def test_a_failed_trainer_state_write_on_rank_0_fails_every_rank(tmp_path: Path) -> None:
    from _distributed import run_ranks

    run_ranks(2, _trainer_files_fail_on_rank_0, str(tmp_path / "ckpt"), timeout=120.0)
