"""orbit_pt.integrations.accelerate: a fine-tune through Accelerate resumes exactly.

Each run is a new process of examples/accelerate_finetune.py: a tiny GPT-2 with dropout
on, AdamW, a warm-up scheduler, a shuffling StatefulDataLoader, gradient accumulation and an
object registered for checkpointing, all prepared by an Accelerator. A run cut mid-epoch and
resumed with ``load_state`` sees the same batches and the same per-batch losses, bitwise, as
the uninterrupted run, and ends with the same weights -- alone, and on 2 gloo ranks (DDP)
under torchrun. Retention follows ``ProjectConfiguration(total_limit=...)`` as Accelerate's
own ``save_state`` does, and bad input is a clear orbit_pt error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")
transformers = pytest.importorskip("transformers")

from _examples import REPO, digest, run_example  # noqa: E402

from orbit_pt import (  # noqa: E402
    CheckpointError,
    CheckpointManager,
    CheckpointTypeError,
    StepNotFoundError,
)
from orbit_pt.integrations import accelerate as orbit  # noqa: E402

EXAMPLE = REPO / "examples" / "accelerate_finetune.py"
STEPS = 20  # 12 batches an epoch alone, 6 a rank on 2 ranks: cuts cross epoch boundaries


def _run(root: Path, out: Path, *extra: str, ranks: int = 1) -> list[dict[str, Any]]:
    """Run the example (under torchrun with ``ranks`` > 1); each rank's record."""
    return run_example(EXAMPLE, out, str(root), f"--steps={STEPS}", *extra, ranks=ranks)


def _resumes_exactly(tmp_path: Path, stop: int, ranks: int = 1) -> None:
    whole = _run(tmp_path / "whole", tmp_path / "whole.json", ranks=ranks)
    cut = tmp_path / "cut"
    first = _run(cut, tmp_path / "first.json", f"--stop={stop}", ranks=ranks)
    resumed = _run(cut, tmp_path / "resumed.json", ranks=ranks)
    saved = stop - stop % 2  # the manager saves every 2nd batch
    for rank in range(ranks):
        assert first[rank]["data"][:saved] + resumed[rank]["data"] == whole[rank]["data"]
        assert first[rank]["losses"][:saved] + resumed[rank]["losses"] == whole[rank]["losses"]
        assert resumed[rank]["weights"] == whole[rank]["weights"]
    _check_step_folder(tmp_path / "whole", whole[0]["weights"])


def _check_step_folder(root: Path, weights: str) -> None:
    """Only safetensors, JSON and msgpack; model/ loads in from_pretrained with the weights."""
    with CheckpointManager(root) as mgr:
        latest = mgr.latest_step()
        assert latest == STEPS
        folder = mgr.step_dir(latest)
    files = [path for path in folder.rglob("*") if path.is_file()]
    others = [p.name for p in files if p.suffix not in (".safetensors", ".json", ".msgpack")]
    assert others == ["_CHECKPOINT_METADATA"]  # JSON too
    model = transformers.GPT2LMHeadModel.from_pretrained(folder / "model")
    assert digest(model) == weights


@pytest.mark.parametrize("stop", [7, 15])  # mid-epoch in the first epoch; in the second
def test_a_run_resumed_in_a_new_process_matches_the_uninterrupted_one(
    tmp_path: Path, stop: int
) -> None:
    _resumes_exactly(tmp_path, stop)


@pytest.mark.distributed
@pytest.mark.parametrize("stop", [7, 9])  # just after an epoch's last batch; mid-epoch
def test_ddp_on_two_ranks_resumes_exactly(tmp_path: Path, stop: int) -> None:
    _resumes_exactly(tmp_path, stop, ranks=2)


# ------------------------------------------------------------------------------ in process


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _accelerator(project_dir: Path, total_limit: int | None = None) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

    AcceleratorState._reset_state(True)  # one Accelerator per test, as in a fresh process
    GradientState._reset_state()
    return Accelerator(
        cpu=True,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        project_config=ProjectConfiguration(
            project_dir=str(project_dir),
            automatic_checkpoint_naming=True,
            total_limit=total_limit,
        ),
    )


@pytest.mark.distributed
def test_a_step_from_2_ranks_resumes_in_one_process_only_with_the_per_rank_parts_left_out(
    tmp_path: Path,
) -> None:
    """The RNG and the loader's position are per rank: restoring them on another number of
    ranks is refused with the load_state call that leaves them out; with it, the run resumes
    from the step (the model and optimizer resharded) and trains on."""
    import subprocess
    import sys

    from _examples import example_env

    root = tmp_path / "ckpt"
    _run(root, tmp_path / "two.json", "--steps=4", ranks=2)
    refused = subprocess.run(
        [sys.executable, str(EXAMPLE), str(root), "--steps=8"],
        capture_output=True,
        text=True,
        timeout=240,
        env=example_env(),
    )
    assert refused.returncode != 0
    assert "StateMismatchError" in refused.stderr
    assert (
        'accelerate.load_state(accelerator, mgr, exclude=("recipe.rng", "recipe.dataloader"))'
        in refused.stderr
    ), refused.stderr[-2000:]
    resumed = _run(root, tmp_path / "one.json", "--steps=8", "--other-world-size")[0]
    assert len(resumed["losses"]) == 4  # batches 5..8: it went on from step 4, not from 0
    assert all(0.0 < float.fromhex(loss) < 10.0 for loss in resumed["losses"])


def test_total_limit_keeps_the_steps_accelerate_keeps(tmp_path: Path) -> None:
    accelerator = _accelerator(tmp_path / "native", total_limit=2)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    options = orbit.options_from_project_config(accelerator, save_interval_steps=2)
    assert options.keep_last_n == 2
    saved_at = [2, 4, 6, 8, 10]
    with CheckpointManager(tmp_path / "orbit", options=options) as mgr:
        for step in range(1, 11):
            with torch.no_grad():
                model.weight.add_(1.0)
            if step in saved_at:
                accelerator.save_state()  # Accelerate's own: checkpoint_<n-th save>
            assert orbit.save_state(accelerator, mgr, step) == (step in saved_at)
        kept = mgr.all_steps()
    native = sorted(p.name for p in (tmp_path / "native" / "checkpoints").iterdir())
    assert native == ["checkpoint_3", "checkpoint_4"]
    assert kept == [saved_at[3], saved_at[4]]  # the same saves


def test_load_state_restores_the_accelerator_and_registered_objects(tmp_path: Path) -> None:
    accelerator = _accelerator(tmp_path)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert orbit.load_state(accelerator, mgr) is None  # an empty root: a fresh run
        counter.n, accelerator.step = 5, 3
        assert orbit.save_state(accelerator, mgr, 5, force=True)
        want = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.zero_()
        counter.n, accelerator.step = 0, 0
        assert orbit.load_state(accelerator, mgr) == 5
        assert torch.equal(model.weight, want)
        assert (counter.n, accelerator.step) == (5, 3)
        with pytest.raises(StepNotFoundError, match="99"):
            orbit.load_state(accelerator, mgr, step=99)


def test_a_prepared_loader_that_is_not_stateful_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)  # use_stateful_dataloader is off by default
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(CheckpointTypeError, match="use_stateful_dataloader=True"):
            orbit.save_state(accelerator, mgr, 1, force=True)
        assert mgr.all_steps() == []


def _loader_not_stateful_on_rank_1(rank: int, world_size: int, root: str) -> None:
    from accelerate import Accelerator, DataLoaderConfiguration

    from orbit_pt import CheckpointSaveError

    config = DataLoaderConfiguration(use_stateful_dataloader=rank == 0)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=2))
    with CheckpointManager(root) as mgr:
        # Rank 0's loader is fine: it fails too, at once, naming rank 1 and why.
        with pytest.raises(CheckpointSaveError, match=r"rank 1.*use_stateful_dataloader=True"):
            orbit.save_state(accelerator, mgr, 2, force=True)
        assert mgr.all_steps() == []
        with pytest.raises(CheckpointError, match=r"rank 1.*use_stateful_dataloader=True"):
            orbit.load_state(accelerator, mgr, step=2)


@pytest.mark.distributed
def test_a_loader_that_is_not_stateful_on_one_rank_fails_the_save_on_every_rank(
    tmp_path: Path,
) -> None:
    from _distributed import run_ranks

    # agreement_timeout is gloo's 30 minutes: a rank left waiting would hit run_ranks' timeout.
    run_ranks(2, _loader_not_stateful_on_rank_1, str(tmp_path / "ckpt"), timeout=120.0)


def test_a_prepared_loaders_epoch_is_saved_as_its_next_iter_will_use_it(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from orbit_pt import RecipeState
    from orbit_pt.recipe import WRAPPER_EPOCH_KEY

    accelerator = _accelerator(tmp_path)
    data = torch.arange(4.0)
    loader = accelerator.prepare(StatefulDataLoader(data, batch_size=2))
    recipe = RecipeState(dataloader=loader)
    inside = [recipe.state_dict()["dataloader"][WRAPPER_EPOCH_KEY] for _ in loader]
    after = recipe.state_dict()
    # After the epoch's last batch, inside the loop, the next iter() is already the 2nd epoch.
    assert inside == [0, 1]
    assert after["dataloader"][WRAPPER_EPOCH_KEY] == 1
    fresh = accelerator.prepare(StatefulDataLoader(data, batch_size=2))
    RecipeState(dataloader=fresh).load_state_dict(after)
    assert fresh.iteration == 1


def test_a_distributed_shuffle_that_cannot_be_redrawn_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from accelerate.utils import DataLoaderConfiguration
    from torchdata.stateful_dataloader import StatefulDataLoader

    from orbit_pt.integrations.accelerate import _innermost_sampler, _warn_if_shuffle_is_lost

    accelerator = _accelerator(tmp_path)
    data = torch.arange(8.0)
    # torchdata's own sampler draws each epoch's order from a generator: not redrawable
    shuffled = accelerator.prepare(StatefulDataLoader(data, batch_size=2, shuffle=True))
    with caplog.at_level("WARNING", logger="orbit_pt"):
        _warn_if_shuffle_is_lost(shuffled, 0)
        _warn_if_shuffle_is_lost(shuffled, 0)
    assert caplog.text.count("use_seedable_sampler=True") == 1
    caplog.clear()
    # Accelerate's seedable sampler draws it from the epoch number: no warning
    accelerator.dataloader_config = DataLoaderConfiguration(
        use_stateful_dataloader=True, use_seedable_sampler=True
    )
    sampler = torch.utils.data.RandomSampler(data)
    seeded = accelerator.prepare(StatefulDataLoader(data, batch_size=2, sampler=sampler))
    assert type(_innermost_sampler(seeded)).__name__ == "SeedableRandomSampler"
    with caplog.at_level("WARNING", logger="orbit_pt"):
        _warn_if_shuffle_is_lost(seeded, 0)
    assert caplog.text == ""
