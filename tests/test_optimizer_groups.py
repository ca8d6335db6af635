"""Optimizer state keyed by parameter name restores into any param-group layout.

A step saved with one group restores into a decay/no-decay split and back; an optimizer over a
subset or superset of the saved parameters (frozen embeddings) restores with ``strict=False``.
Whose hyperparameters the groups get is ``OptimizerHandler(hyperparameters=...)``'s choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _distributed import run_ranks
from torch import nn

from orbit_pt import CheckpointManager, CheckpointTypeError, StateMismatchError
from orbit_pt.handlers import OptimizerHandler, default_handler

Layout = Callable[[nn.Module], list[dict[str, Any]]]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.norm = nn.LayerNorm(6)
        self.mlp = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.norm(self.embed(x))))  # type: ignore[no-any-return]


def _decay(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("embed")]


def _no_decay(model: nn.Module) -> list[nn.Parameter]:
    decay = {id(p) for p in _decay(model)}
    return [p for p in model.parameters() if id(p) not in decay]


LAYOUTS: dict[str, Layout] = {
    "one": lambda m: [{"params": list(m.parameters())}],
    "split": lambda m: [{"params": _decay(m)}, {"params": _no_decay(m)}],
    "split_reversed": lambda m: [{"params": _no_decay(m)[::-1]}, {"params": _decay(m)}],
    "per_parameter": lambda m: [{"params": [p]} for p in m.parameters()],
}


def _adamw(groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, **{"lr": 0.01, "weight_decay": 0.1, **hyper})


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 10, (4,), generator=g)
        loss = nn.functional.cross_entropy(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _copy(model: Net) -> Net:
    other = Net()
    other.load_state_dict(model.state_dict())
    return other


def _state_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        f"{names[id(p)]}/{key}": torch.as_tensor(value).clone()
        for p, per_param in opt.state.items()
        for key, value in per_param.items()
    }


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def _saved(root: Path, layout: str = "one", **hyper: Any) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    opt = _adamw(LAYOUTS[layout](model), **hyper)
    _train(model, opt, 3, seed=1)
    with CheckpointManager(root) as mgr:
        mgr.save(3, {"model": model, "optimizer": opt}, force=True)
    return model, opt


# ------------------------------------------------------------------------------- any layout


@pytest.mark.parametrize(
    ("saved", "live"),
    [
        ("one", "split"),
        ("split", "one"),
        ("split", "split_reversed"),
        ("one", "per_parameter"),
    ],
)
def test_state_restores_into_any_grouping_and_training_continues_identically(
    tmp_path: Path, saved: str, live: str
) -> None:
    model, opt = _saved(tmp_path, saved)
    restored = _copy(model)
    opt2 = _adamw(LAYOUTS[live](restored))
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(3, {"model": restored, "optimizer": opt2})
    # Adam's per-parameter ``step`` tensors included
    _assert_equal(_state_by_name(restored, opt2), _state_by_name(model, opt))
    _train(model, opt, 2, seed=2)
    _train(restored, opt2, 2, seed=2)
    _assert_equal(dict(restored.state_dict()), dict(model.state_dict()))


def test_a_regrouped_optimizer_keeps_its_own_hyperparameters_by_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt = _saved(tmp_path, "one", lr=0.01, weight_decay=0.1)
    restored = _copy(model)
    groups = LAYOUTS["split"](restored)
    groups[1]["weight_decay"] = 0.0
    opt2 = _adamw(groups, lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 0.5)  # sets initial_lr
    live_groups = list(opt2.param_groups)
    with (
        caplog.at_level(logging.INFO, "orbit_pt.handlers.optimizer"),
        CheckpointManager(tmp_path) as mgr,
    ):
        mgr.restore(3, {"model": restored, "optimizer": opt2})
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt2.param_groups] == [0.01, 0.01]  # 0.02 * 0.5
    assert [g["initial_lr"] for g in opt2.param_groups] == [0.02, 0.02]
    assert all(a is b for a, b in zip(opt2.param_groups, live_groups, strict=True))
    assert "do not correspond one to one" in caplog.text
    assert "group 0 holds 3 of the 9 parameters of saved group 0" in caplog.text
    _assert_equal(_state_by_name(restored, opt2), _state_by_name(model, opt))
    _train(restored, opt2, 1, seed=2)
    sched.step()


def test_a_resumed_lr_schedule_continues_exactly(tmp_path: Path) -> None:
    # The default takes the checkpoint's hyperparameters when the groups correspond: a chainable
    # scheduler (StepLR) derives each lr from the group's current one, so the saved lr is part
    # of the schedule's state.
    torch.manual_seed(0)
    model = Net()
    opt = _adamw(LAYOUTS["split"](model))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(5):
        _train(model, opt, 1, seed=step)
        sched.step()
    items: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(5, items, force=True)
    restored = _copy(model)
    opt2 = _adamw(LAYOUTS["split_reversed"](restored))
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(5, {"model": restored, "optimizer": opt2, "scheduler": sched2})
    assert sorted(g["lr"] for g in opt2.param_groups) == [0.0025, 0.0025]
    for step in range(5, 9):
        for m, o, s in ((model, opt, sched), (restored, opt2, sched2)):
            _train(m, o, 1, seed=step)
            s.step()
    _assert_equal(dict(restored.state_dict()), dict(model.state_dict()))


def test_live_hyperparameters_are_kept_untouched(tmp_path: Path) -> None:
    model, opt = _saved(tmp_path, "split", lr=0.01)
    restored = _copy(model)
    opt2 = _adamw(LAYOUTS["split"](restored), lr=torch.tensor(0.03))
    torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 1.0)
    lr, live_groups = opt2.param_groups[0]["lr"], list(opt2.param_groups)
    handlers = {"optimizer": OptimizerHandler(hyperparameters="live")}
    with CheckpointManager(tmp_path, handlers=handlers) as mgr:
        mgr.restore(3, {"model": restored, "optimizer": opt2})
    assert opt2.param_groups[0]["lr"] is lr  # the very tensor, not a copy
    assert all(a is b for a, b in zip(opt2.param_groups, live_groups, strict=True))
    assert [float(g["initial_lr"]) for g in opt2.param_groups] == pytest.approx([0.03, 0.03])
    _assert_equal(_state_by_name(restored, opt2), _state_by_name(model, opt))


def test_saved_hyperparameters_follow_the_groups_parameters(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(
        [
            {"params": _decay(model), "lr": 0.01, "weight_decay": 0.1},
            {"params": _no_decay(model), "lr": 0.02, "weight_decay": 0.0},
        ]
    )
    _train(model, opt, 2, seed=1)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2, {"model": model, "optimizer": opt}, force=True)
    restored = _copy(model)
    opt2 = _adamw(LAYOUTS["split_reversed"](restored), lr=0.5, weight_decay=0.5)
    handlers = {"optimizer": OptimizerHandler(hyperparameters="saved")}
    with CheckpointManager(tmp_path, handlers=handlers) as mgr:
        mgr.restore(2, {"model": restored, "optimizer": opt2})
    # group 0 is the no-decay group now: it takes the saved no-decay group's values
    assert [(g["lr"], g["weight_decay"]) for g in opt2.param_groups] == [(0.02, 0.0), (0.01, 0.1)]
    assert [len(g["params"]) for g in opt2.param_groups] == [6, 3]
    _train(model, opt, 2, seed=2)
    _train(restored, opt2, 2, seed=2)
    _assert_equal(dict(restored.state_dict()), dict(model.state_dict()))


def test_saved_hyperparameters_need_corresponding_groups(tmp_path: Path) -> None:
    model, _ = _saved(tmp_path, "one")
    restored = _copy(model)
    opt2 = _adamw(LAYOUTS["split"](restored))
    before = opt2.state_dict()
    handlers = {"optimizer": OptimizerHandler(hyperparameters="saved")}
    with (
        CheckpointManager(tmp_path, handlers=handlers) as mgr,
        pytest.raises(StateMismatchError) as info,
    ):
        mgr.restore(3, {"model": restored, "optimizer": opt2})
    message = str(info.value)
    assert "2 param group(s) do not correspond one to one to the checkpoint's 1" in message
    assert "optimizer group 1 holds 6 of the 9 parameters of saved group 0" in message
    assert "hyperparameters='live'" in message
    assert opt2.state_dict() == before


# ------------------------------------------------------------- a subset or superset: strict


def _without_embed(model: nn.Module) -> list[nn.Parameter]:
    model.embed.weight.requires_grad_(False)  # type: ignore[union-attr]
    return [p for p in model.parameters() if p.requires_grad]


def test_strict_refuses_other_parameters_and_says_how_to_allow_them(tmp_path: Path) -> None:
    model, _ = _saved(tmp_path, "one")
    restored = _copy(model)
    opt2 = _adamw([{"params": _without_embed(restored)}])
    _train(restored, opt2, 1, seed=4)
    before = _state_by_name(restored, opt2)
    with CheckpointManager(tmp_path) as mgr, pytest.raises(StateMismatchError) as info:
        mgr.restore(3, {"model": restored, "optimizer": opt2})
    message = str(info.value)
    assert "embed.weight is in the checkpoint but not in the optimizer" in message
    assert "handlers={'optimizer': OptimizerHandler(strict=False)}" in message
    _assert_equal(_state_by_name(restored, opt2), before)


def test_non_strict_restores_a_subset(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _saved(tmp_path, "one")
    restored = _copy(model)
    opt2 = _adamw([{"params": _without_embed(restored)}])
    handlers = {"optimizer": OptimizerHandler(strict=False)}
    with (
        caplog.at_level(logging.WARNING, "orbit_pt.handlers.optimizer"),
        CheckpointManager(tmp_path, handlers=handlers) as mgr,
    ):
        mgr.restore(3, {"model": restored, "optimizer": opt2})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "1 saved parameter(s) are not in the optimizer and were skipped: embed.weight" in (
        warnings[0].getMessage()
    )
    expected = {k: v for k, v in _state_by_name(model, opt).items() if "embed" not in k}
    _assert_equal(_state_by_name(restored, opt2), expected)


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_non_strict_superset_leaves_the_new_parameters_state_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = Wide()
    first: list[torch.Tensor] = list(model.layers[0].parameters())
    opt = torch.optim.Adam(first, lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt}, force=True)
    opt2 = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    opt2.step()
    opt2.step()
    last = model.layers[11].weight
    assert isinstance(last, torch.Tensor)
    kept, kept_value = opt2.state[last]["exp_avg"], opt2.state[last]["exp_avg"].clone()
    handlers = {"optimizer": OptimizerHandler(strict=False)}
    with (
        caplog.at_level(logging.WARNING, "orbit_pt.handlers.optimizer"),
        CheckpointManager(tmp_path, handlers=handlers) as mgr,
    ):
        mgr.restore(1, {"model": model, "optimizer": opt2})
    assert opt2.state[last]["exp_avg"] is kept
    assert torch.equal(kept, kept_value)
    assert float(opt2.state[last]["step"]) == 2.0
    assert float(opt2.state[first[0]]["step"]) == 1.0  # restored from the checkpoint
    message = caplog.records[-1].getMessage()
    assert "22 optimizer parameter(s) have no saved state and keep their current state" in message
    assert "layers.1.weight, layers.1.bias" in message
    assert "and 12 more" in message  # capped


# ------------------------------------------------------------------------ FSDP2, on 2 ranks


def _split_under_fsdp(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    mesh = init_device_mesh("cpu", (world_size,))

    def build(seed: int) -> Net:
        torch.manual_seed(seed)
        model = Net()
        fully_shard(model.mlp, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def state(model: Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        saved: Any = get_optimizer_state_dict(model, opt, options=full)
        return {
            f"{fqn}/{key}": torch.as_tensor(value).clone()
            for fqn, per_param in saved.get("state", {}).items()  # rank 0 only
            for key, value in per_param.items()
        }

    model = build(0)
    opt = _adamw(LAYOUTS["one"](model))
    _train(model, opt, 2, seed=1)
    with CheckpointManager(root) as mgr:
        mgr.save(2, {"model": model, "optimizer": opt}, force=True)
    restored = build(7)
    opt2 = _adamw(LAYOUTS["split_reversed"](restored))
    with CheckpointManager(root) as mgr:
        mgr.restore(2, {"model": restored, "optimizer": opt2})
    weight = restored.mlp[0].weight
    assert isinstance(weight, torch.Tensor)
    assert isinstance(opt2.state[weight]["exp_avg"], DTensor)
    with pytest.raises(CheckpointTypeError, match=r"item 'w' is a DTensor.*full_tensor\(\)"):
        default_handler(weight, item_name="w")  # a bare DTensor: refused
    want, got = state(model, opt), state(restored, opt2)
    _train(model, opt, 2, seed=2)
    _train(restored, opt2, 2, seed=2)
    if rank == 0:
        assert any(key.endswith("/exp_avg") for key in want)
        _assert_equal(got, want)
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor())  # type: ignore[attr-defined]
    dist.barrier()


@pytest.mark.distributed
def test_fsdp2_state_restores_into_other_groups(tmp_path: Path) -> None:
    run_ranks(2, _split_under_fsdp, str(tmp_path / "ckpt"))
