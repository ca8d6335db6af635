"""RNGState and RecipeState: exact round trips through the state handler."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from orbit_pt import (
    CheckpointManager,
    CheckpointSaveError,
    CheckpointTypeError,
    RecipeState,
    RNGState,
    StateMismatchError,
)


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
    assert isinstance(fresh.rng, RNGState)
    assert "step=41" in repr(fresh)


def test_recipe_state_missing_stateful_field_is_an_error() -> None:
    recipe = RecipeState(rng=RNGState())
    with pytest.raises(StateMismatchError, match=r"no field\(s\) \['rng'\]"):
        recipe.load_state_dict({"step": 1, "epoch": 0})


def test_recipe_state_field_names() -> None:
    with pytest.raises(ValueError, match="cannot start with '_'"):
        RecipeState(_hidden=1)
    assert RecipeState(step=3, lr=0.1).fields() == {"step": 3, "epoch": 0, "lr": 0.1}


# ------------------------------------------------------------ restoring into another RecipeState


def _loader(seed: int = 0) -> StatefulDataLoader:
    data = list(range(20))
    sampler = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(seed))
    return StatefulDataLoader(data, batch_size=2, sampler=sampler)


@pytest.mark.parametrize("live_rng", ["missing", "None"])
def test_a_missing_rng_field_is_restored_as_an_rng_state(tmp_path: Path, live_rng: str) -> None:
    torch.manual_seed(3)
    random.seed(4)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"recipe": RecipeState(step=1, rng=RNGState())}, force=True)
        expected = [_draw() for _ in range(2)]
        fresh = RecipeState() if live_rng == "missing" else RecipeState(rng=None)
        mgr.restore(1, {"recipe": fresh})
        assert [_draw() for _ in range(2)] == expected  # the generators were restored
        assert isinstance(fresh.rng, RNGState)
        # ... and the next save captures the generators again, not a stale dict
        mgr.save(2, {"recipe": fresh}, force=True)
        after = [_draw() for _ in range(2)]
        mgr.restore(2, {"recipe": RecipeState()})
        assert [_draw() for _ in range(2)] == after


def test_a_step_saved_before_kinds_were_recorded_restores_its_rng(tmp_path: Path) -> None:
    torch.manual_seed(5)
    old_format = {"step": 1, "epoch": 0, "rng": RNGState().state_dict()}  # no "_kinds"
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"recipe": old_format}, force=True)
        expected = torch.rand(3)
        fresh = RecipeState()
        mgr.restore(1, {"recipe": fresh})
    assert isinstance(fresh.rng, RNGState)
    assert torch.equal(torch.rand(3), expected)


def test_a_missing_stateful_field_is_an_error_naming_the_field(tmp_path: Path) -> None:
    loader = _loader()
    batches = iter(loader)
    next(batches)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"recipe": RecipeState(step=1, rng=RNGState(), data=loader)}, force=True)
        fresh = RecipeState(step=0)
        state = torch.get_rng_state()
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(1, {"recipe": fresh})
    message = str(info.value)
    assert "data: saved from a torchdata.stateful_dataloader" in message
    assert "StatefulDataLoader's state_dict(), but the field is missing here" in message
    assert "RecipeState(..., dataloader=loader" in message
    assert "without a target" in message
    assert fresh.step == 0  # nothing was loaded
    assert "rng" not in fresh.fields()
    assert torch.equal(torch.get_rng_state(), state)


def test_a_stateful_field_of_another_class_is_an_error(tmp_path: Path) -> None:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"recipe": RecipeState(data=_loader())}, force=True)
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(1, {"recipe": RecipeState(data=sched)})
        mgr.save(2, {"recipe": RecipeState(rng=RNGState())}, force=True)
        with pytest.raises(StateMismatchError, match="rng: saved from an RNGState, but the field"):
            mgr.restore(2, {"recipe": RecipeState(rng=sched)})
    message = str(info.value)
    assert "data: saved from a torchdata.stateful_dataloader" in message
    assert "the field holds a torch.optim.lr_scheduler.StepLR" in message


def test_a_stateful_data_loader_resumes_its_position(tmp_path: Path) -> None:
    loader = _loader(seed=1)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, {"recipe": RecipeState(step=3, data=loader)}, force=True)
        rest = [b.tolist() for b in batches]
        fresh_loader = _loader(seed=1)
        mgr.restore(3, {"recipe": RecipeState(data=fresh_loader)})
    assert [b.tolist() for b in fresh_loader] == rest


def test_a_plain_data_loader_is_refused_naming_the_alternatives(tmp_path: Path) -> None:
    loader: torch.utils.data.DataLoader[int] = torch.utils.data.DataLoader(
        range(8),  # type: ignore[arg-type]  # a sequence is a map-style dataset
        batch_size=2,
    )
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(CheckpointSaveError) as info:
            mgr.save(1, {"recipe": RecipeState(dataloader=loader)}, force=True)
        with pytest.raises(CheckpointTypeError) as bare:
            mgr.save(1, {"loader": loader}, force=True)
    for message in (str(info.value), str(bare.value)):
        assert "torchdata.stateful_dataloader.StatefulDataLoader" in message
        assert "record the number of batches consumed" in message
        assert "seeded sampler" in message
    assert "at dataloader" in str(info.value)
