"""RNGState and RecipeState: exact round trips through the state handler."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from orbit_pt import CheckpointManager, RecipeState, RNGState, StateMismatchError


def _draw() -> tuple[float, float, float, list[float]]:
    return (
        random.random(),
        random.gauss(0, 1),
        float(np.random.standard_normal()),
        torch.rand(3).tolist(),
    )


def test_rng_state_round_trips_exactly(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()  # and in numpy's
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"rng": RNGState()}, force=True)
        expected = [_draw() for _ in range(3)]
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(99)
        mgr.restore(1, {"rng": RNGState()})
    assert [_draw() for _ in range(3)] == expected


def test_rng_state_without_a_target_is_plain_state(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"rng": RNGState()}, force=True)
        state = mgr.restore(1)["rng"]
    assert set(state) == {"python", "numpy", "torch"}
    assert state["torch"].dtype == torch.uint8
    assert isinstance(state["python"], tuple)
    assert state["numpy"]["state"]["key"].dtype == np.uint32
    RNGState().load_state_dict(state)


def test_rng_state_needs_python_and_torch() -> None:
    with pytest.raises(StateMismatchError, match="'torch'"):
        RNGState().load_state_dict({"python": random.getstate()})


def test_recipe_state_round_trip_with_stateful_fields(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    recipe = RecipeState(
        step=41, epoch=2, tokens_seen=123_456, best={"loss": 0.5}, rng=RNGState(), sched=sched
    )
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(41, {"recipe": recipe}, force=True)
        opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
        fresh = RecipeState(rng=RNGState(), sched=sched2)
        mgr.restore(41, {"recipe": fresh})
    assert (fresh.step, fresh.epoch) == (41, 2)
    assert fresh.tokens_seen == 123_456
    assert fresh.best == {"loss": 0.5}
    assert fresh.sched is sched2
    assert sched2.state_dict() == sched.state_dict()
    assert "step=41" in repr(fresh)


def test_recipe_state_missing_stateful_field_is_an_error() -> None:
    recipe = RecipeState(rng=RNGState())
    with pytest.raises(StateMismatchError, match=r"no field\(s\) \['rng'\]"):
        recipe.load_state_dict({"step": 1, "epoch": 0})


def test_recipe_state_field_names() -> None:
    with pytest.raises(ValueError, match="cannot start with '_'"):
        RecipeState(_hidden=1)
    assert RecipeState(step=3, lr=0.1).fields() == {"step": 3, "epoch": 0, "lr": 0.1}
