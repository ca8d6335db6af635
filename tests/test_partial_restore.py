"""Partial restores: seed steps with missing items (``missing_ok``), and ``exclude`` of items and
of fields inside an item. Every check runs before anything is loaded, and under
torch.distributed a failure on one rank fails the restore on every rank."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _distributed import gather as _gather
from _distributed import run_ranks
from torchdata.stateful_dataloader import StatefulDataLoader

from orbit_pt import (
    CheckpointError,
    CheckpointManager,
    CheckpointTypeError,
    CheckpointValueError,
    ItemNotFoundError,
    RecipeState,
    RNGState,
)
from orbit_pt.manager import RestoreInfo


def _model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _trained(seed: int) -> tuple[torch.nn.Linear, torch.optim.Optimizer, RecipeState]:
    """A model, an optimizer with state, and a recipe with a scheduler and a data loader, all
    advanced a few steps (their state depends on ``seed``)."""
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = _loader(seed)
    batches = iter(loader)
    for _ in range(3 + seed % 3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        next(batches)
    recipe = RecipeState(step=10 + seed, epoch=seed, scheduler=sched, dataloader=loader, lr=0.1)
    return model, opt, recipe


def _loader(seed: int) -> StatefulDataLoader:
    data = list(range(32))
    sampler = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(seed))
    return StatefulDataLoader(data, batch_size=2, sampler=sampler)


def _items(parts: tuple[torch.nn.Module, torch.optim.Optimizer, RecipeState]) -> dict[str, Any]:
    model, opt, recipe = parts
    return {"model": model, "optimizer": opt, "recipe": recipe}


def _snapshot(parts: tuple[torch.nn.Module, torch.optim.Optimizer, RecipeState]) -> Any:
    """Everything observable about the live objects, to assert that a restore left them be."""
    model, opt, recipe = parts
    return _plain(
        [
            model.state_dict(),
            opt.state_dict(),
            [recipe.step, recipe.epoch, recipe.lr],
            recipe.scheduler.state_dict(),
            recipe.dataloader.state_dict(),
        ]
    )


def _plain(value: Any) -> Any:
    """``value`` with every tensor as a list, so that ``==`` compares contents."""
    if isinstance(value, torch.Tensor):
        return [str(value.dtype), value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------- seed steps


def test_a_model_only_seed_step_restores_with_missing_ok(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seed_model = _model(0)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(0, {"model": seed_model}, force=True)  # the seed checkpoint
        live = _trained(1)
        before = _snapshot(live)
        with pytest.raises(ItemNotFoundError) as info:
            mgr.restore(None, _items(live))
        assert "no item(s) ['optimizer', 'recipe']" in str(info.value)
        assert "missing_ok=True" in str(info.value)
        assert _snapshot(live) == before  # refused before anything was loaded

        with caplog.at_level(logging.WARNING, logger="orbit_pt"):
            restored = mgr.restore(None, _items(live), missing_ok=True)
        assert list(restored) == ["model"]
        assert restored["model"] is live[0]
        assert torch.equal(live[0].weight, seed_model.weight)
        after = _snapshot(live)
        assert after[1:] == before[1:]  # optimizer and recipe untouched
        assert mgr.last_restore == RestoreInfo(
            step=0, items=("model",), missing=("optimizer", "recipe")
        )
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("['optimizer', 'recipe']" in m and "missing_ok=True" in m for m in warnings)

        # The run goes on and saves everything; the next resume needs no missing_ok.
        mgr.save(5, _items(live), force=True)
        fresh = _trained(2)
        mgr.restore(None, _items(fresh))
        assert _snapshot(fresh) == _snapshot(live)
        assert mgr.last_restore is not None
        assert mgr.last_restore.missing == ()


def test_missing_ok_with_a_sequence_of_names_returns_what_the_step_holds(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(0, {"model": _model(0)}, force=True)
        restored = mgr.restore(0, ["model", "optimizer"], missing_ok=True)
    assert list(restored) == ["model"]
    assert torch.equal(restored["model"]["weight"], _model(0).weight)


# -------------------------------------------------------------------------------- exclude


def test_excluded_items_and_fields_keep_their_live_values(tmp_path: Path) -> None:
    saved = _trained(1)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(7, _items(saved), force=True)
        live = _trained(2)
        before = _snapshot(live)
        exclude = ("optimizer", "recipe.dataloader", "recipe.scheduler")
        restored = mgr.restore(7, _items(live), exclude=exclude)
        assert mgr.last_restore == RestoreInfo(step=7, items=("model", "recipe"), excluded=exclude)
    assert list(restored) == ["model", "recipe"]
    after, expected = _snapshot(live), _snapshot(saved)
    assert after[0] == expected[0]  # the model was restored
    assert after[2] == expected[2]  # step, epoch and plain fields too
    assert after[1] == before[1]  # the optimizer was left out
    assert after[3:] == before[3:]  # and so were the scheduler and the data loader


def test_excluded_fields_of_plain_state_and_of_stateful_objects(tmp_path: Path) -> None:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"d": {"a": torch.ones(2), "b": torch.ones(3)}, "sched": sched}, force=True)
        target = {"a": torch.zeros(2), "b": torch.zeros(3)}
        mgr.restore(1, {"d": target}, exclude=("d.b",))
        assert torch.equal(target["a"], torch.ones(2))
        assert torch.equal(target["b"], torch.zeros(3))
        # Without a target, the returned state lacks the field.
        assert set(mgr.restore(1, ["d"], exclude=("d.b",))["d"]) == {"a"}
        # Any stateful object: the field keeps its live value, the others are restored.
        opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=3.0)
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
        mgr.restore(1, {"sched": sched2}, exclude=("sched.base_lrs",))
    assert sched2.last_epoch == sched.last_epoch == 1
    assert sched2.base_lrs == [3.0]


def test_item_names_with_dots_resolve_to_the_longest_item(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        items = {"ema": {"w": torch.ones(1)}, "ema.v2": {"w": torch.ones(1), "n": 3}}
        mgr.save(1, items, force=True)
        assert list(mgr.restore(1, exclude=("ema.v2",))) == ["ema"]
        assert mgr.restore(1, exclude=("ema.v2.n",))["ema.v2"] == {"w": torch.ones(1)}


@pytest.mark.parametrize(
    ("exclude", "cls", "message"),
    [
        (("optimiser",), CheckpointValueError, r"'optimiser' names no item of step 7"),
        (("recipe.rgn",), CheckpointValueError, r"field\(s\) \['rgn'\] of item 'recipe'"),
        (("recipe._kinds",), CheckpointValueError, r"its fields are \['step', 'epoch'"),
        (("model.weight",), CheckpointValueError, r"has no named fields.*exclude=\('model',\)"),
        (("extra",), CheckpointValueError, r"does not hold.*pass missing_ok=True"),
        ("optimizer", CheckpointTypeError, r"trailing comma: exclude=\(\"optimizer\",\)"),
        ((3,), CheckpointTypeError, r"non-empty strings"),
    ],
)
def test_a_bad_exclude_is_refused_before_anything_is_loaded(
    tmp_path: Path, exclude: Any, cls: type[CheckpointError], message: str
) -> None:
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(7, _items(_trained(1)), force=True)
        live = _trained(2)
        before = _snapshot(live)
        items = {**_items(live), "extra": {"x": 1}} if "extra" in exclude else _items(live)
        with pytest.raises(cls, match=message):
            mgr.restore(7, items, exclude=exclude)
        assert mgr.last_restore is None
    assert _snapshot(live) == before


def test_an_absent_item_may_be_excluded_with_missing_ok(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(0, {"model": _model(0)}, force=True)
        live = _trained(2)
        before = _snapshot(live)
        mgr.restore(0, _items(live), missing_ok=True, exclude=("recipe.rng", "optimizer"))
        assert mgr.last_restore == RestoreInfo(
            step=0, items=("model",), missing=("recipe",), excluded=("recipe.rng", "optimizer")
        )
    assert _snapshot(live)[1:] == before[1:]


# ----------------------------------------------------------------- agreed on every rank


def _bad_exclude_on_one_rank(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    with CheckpointManager(root) as mgr:
        mgr.save(0, {"model": torch.nn.Linear(3, 2), "recipe": RecipeState(step=4, lr=0.5)})
        target = torch.nn.Linear(3, 2)
        recipe = RecipeState(lr=1.0)
        before = target.weight.detach().clone()
        # Only rank 1 misspells a field: every rank fails, before anything is loaded.
        exclude: tuple[str, ...] = ("recipe.lrr",) if rank == 1 else ("recipe.lr",)
        items = {"model": target, "recipe": recipe}
        if rank == 1:
            with pytest.raises(CheckpointValueError, match=r"\['lrr'\] of item 'recipe'"):
                mgr.restore(0, items, exclude=exclude)
        else:
            with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\].*'lrr'"):
                mgr.restore(0, items, exclude=exclude)
        assert torch.equal(target.weight, before)
        assert recipe.step == 0
        # Valid but different exclusions on the ranks are refused everywhere too.
        exclude = ("recipe.lr",) if rank == 0 else ()
        with pytest.raises(CheckpointValueError, match="different restores of step 0"):
            mgr.restore(0, items, exclude=exclude)
        assert torch.equal(target.weight, before)
        # Seed flow on two ranks: a model-only step into model + recipe.
        mgr.save(1, {"model": torch.nn.Linear(3, 2)})
        mgr.restore(None, items, missing_ok=True, exclude=("recipe.lr",))
        assert _gather(mgr.last_restore) == [mgr.last_restore] * world_size
        assert mgr.last_restore == RestoreInfo(
            step=1, items=("model",), missing=("recipe",), excluded=("recipe.lr",)
        )
        # And a good restore works on both ranks afterwards.
        mgr.restore(0, items, exclude=("recipe.lr",))
        assert (recipe.step, recipe.lr) == (4, 1.0)


@pytest.mark.distributed
def test_a_bad_exclude_on_one_rank_fails_the_restore_on_every_rank(tmp_path: Path) -> None:
    run_ranks(2, _bad_exclude_on_one_rank, str(tmp_path), timeout=120)


def test_rng_fields_are_excluded_like_any_field(tmp_path: Path) -> None:
    torch.manual_seed(1)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"recipe": RecipeState(step=3, rng=RNGState())}, force=True)
        torch.manual_seed(2)
        state = torch.get_rng_state()
        fresh = RecipeState()
        mgr.restore(1, {"recipe": fresh}, exclude=("recipe.rng",))
    assert fresh.step == 3
    assert "rng" not in fresh.fields()
    assert torch.equal(torch.get_rng_state(), state)
