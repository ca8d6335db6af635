"""Elastic resume of a RecipeState: saved on 2 ranks, restored on 1, 2 and 3.

Fields that every rank saved identically (step, epoch, scheduler, plain values) restore on any
number of ranks; per-rank fields (RNG streams, a data loader's position) restore on the same
number of ranks, each rank its own, and must be excluded on another -- the error names each one
and the exclude=(...) that accepts it, before anything is loaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _distributed import gather as _gather
from _distributed import run_ranks
from torchdata.stateful_dataloader import StatefulDataLoader

from orbit_pt import CheckpointManager, RecipeState, RNGState, StateMismatchError

pytestmark = pytest.mark.distributed

STEP = 7
EXCLUDE = ("recipe.rng", "recipe.dataloader")


def _loader(seed: int) -> StatefulDataLoader:
    # shuffle=True: torchdata's own stateful sampler, whose state holds its generator's.
    generator = torch.Generator().manual_seed(seed)
    return StatefulDataLoader(list(range(40)), batch_size=2, shuffle=True, generator=generator)


def _model_and_scheduler() -> tuple[torch.nn.Linear, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)  # the same model on every rank (data parallel)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return model, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _seed(rank: int) -> None:
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)


def _fresh(rank: int) -> tuple[torch.nn.Linear, RecipeState]:
    """What a resumed job builds before restoring: new objects, its own per-rank seeds."""
    model, sched = _model_and_scheduler()
    torch.nn.init.zeros_(model.weight)
    _seed(1000 + rank)
    recipe = RecipeState(scheduler=sched, rng=RNGState(), dataloader=_loader(1000 + rank))
    return model, recipe


def _draws() -> list[float]:
    return [random.random(), float(np.random.standard_normal()), *torch.rand(2).tolist()]


def _save_on_two_ranks(rank: int, world_size: int, root: str) -> None:
    model, sched = _model_and_scheduler()
    for _ in range(5):
        sched.optimizer.step()
        sched.step()
    _seed(rank)  # per-rank seeds: RNG and data order differ between the ranks
    loader = _loader(rank)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    recipe = RecipeState(
        step=STEP, epoch=2, scheduler=sched, rng=RNGState(), dataloader=loader, tokens=12_345
    )
    # A recipe whose data loader every rank saved identically: still a per-rank position.
    same_loader = _loader(0)
    next(iter(same_loader))
    with CheckpointManager(root) as mgr:
        mgr.save(STEP, {"model": model, "recipe": recipe, "same": RecipeState(data=same_loader)})
    expected = {
        "scheduler": sched.state_dict(),
        "draws": _draws(),
        "batches": [b.tolist() for b in batches],
    }
    (Path(root).parent / f"expected_rank{rank}.json").write_text(json.dumps(expected))


def _expected(root: str, rank: int) -> dict[str, Any]:
    return json.loads((Path(root).parent / f"expected_rank{rank}.json").read_text())  # type: ignore[no-any-return]


def _check_elastic_restore(rank: int, world_size: int, root: str) -> None:
    """Restore the 2-rank step on ``world_size`` != 2 ranks (run in-process when 1)."""
    model, recipe = _fresh(rank)
    live_rng = torch.get_rng_state()
    with CheckpointManager(root) as mgr:
        # Without the exclusion: refused on every rank, naming both fields and the exclude.
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(None, {"model": model, "recipe": recipe})
        message = str(info.value)
        assert f"step {STEP} was saved on 2 rank(s) and is restored on {world_size}" in message
        assert "recipe.rng: holds per-rank state that differs between the 2 ranks" in message
        assert "recipe.dataloader: holds per-rank state that differs" in message
        assert 'exclude=("recipe.rng", "recipe.dataloader")' in message
        # Checked before anything was loaded: the model and the step are untouched.
        assert torch.count_nonzero(model.weight) == 0
        assert recipe.step == 0
        assert torch.equal(torch.get_rng_state(), live_rng)

        restored = mgr.restore(None, {"model": model, "recipe": recipe}, exclude=EXCLUDE)
        assert restored["recipe"] is recipe
        info_ = mgr.last_restore
        assert info_ is not None
        assert (info_.step, info_.excluded) == (STEP, EXCLUDE)

        # A data loader saved identically by every rank is still a per-rank position.
        with pytest.raises(StateMismatchError, match=r"same\.data: is a data loader's position"):
            mgr.restore(None, {"same": RecipeState(data=_loader(5))})
    assert torch.count_nonzero(model.weight) > 0  # the model restored (resharding is FSDP's)
    # The step is never lost; the fields every rank saved alike restore exactly.
    assert (recipe.step, recipe.epoch, recipe.tokens) == (STEP, 2, 12_345)
    assert recipe.scheduler.state_dict() == _expected(root, 0)["scheduler"]
    assert recipe.scheduler.get_last_lr() == _expected(root, 0)["scheduler"]["_last_lr"]
    # The excluded fields kept their live values: this rank's fresh seeds, data from the start.
    assert torch.equal(torch.get_rng_state(), live_rng)
    assert [b.tolist() for b in recipe.dataloader][:2] == [
        b.tolist() for b in list(_loader(1000 + rank))[:2]
    ]
    if world_size > 1:
        assert _gather((recipe.step, recipe.epoch)) == [(STEP, 2)] * world_size


def _check_same_world_size(rank: int, world_size: int, root: str) -> None:
    """On the world size it was saved with, each rank gets its own RNG and data position."""
    model, recipe = _fresh(rank)
    with CheckpointManager(root) as mgr:
        mgr.restore(None, {"model": model, "recipe": recipe})
        assert mgr.last_restore is not None
        assert mgr.last_restore.excluded == ()
    expected = _expected(root, rank)
    assert recipe.step == STEP
    assert recipe.scheduler.state_dict() == expected["scheduler"]
    assert _draws() == expected["draws"]
    assert [b.tolist() for b in recipe.dataloader] == expected["batches"]


def test_a_recipe_saved_on_two_ranks_restores_on_one_and_on_three(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(2, _save_on_two_ranks, root, timeout=120)
    _check_elastic_restore(0, 1, root)  # one process
    run_ranks(3, _check_elastic_restore, root, timeout=180)
    run_ranks(2, _check_same_world_size, root, timeout=120)
