"""The optimizer handler: state keyed by parameter name, pairing with the model, bad input."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import safetensors.torch
import torch
from torch import nn

from orbit_pt import (
    CheckpointManager,
    CheckpointTypeError,
    CheckpointValueError,
    StateMismatchError,
)
from orbit_pt.handlers import HandlerContext, OptimizerHandler, default_handler

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


class Net(nn.Module):
    def __init__(self, width: int = 6, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.head = nn.Linear(width, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.embed(x)))  # type: ignore[no-any-return]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 10, (4,), generator=g)
        loss = nn.functional.cross_entropy(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _copy(model: Net, width: int = 6, tied: bool = False) -> Net:
    other = Net(width, tied)
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_round_trip_continues_identically(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[kind](list(model.parameters()))
    _train(model, opt, 3, seed=1)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, {"model": model, "optimizer": opt}, force=True)
        model2 = Net()
        opt2 = OPTIMIZERS[kind](list(model2.parameters()))
        mgr.restore(3, {"model": model2, "optimizer": opt2})
    _train(model, opt, 2, seed=2)
    _train(model2, opt2, 2, seed=2)
    assert _same_params(model, model2)


def test_on_disk_keys_are_parameter_names(tmp_path: Path) -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1, seed=0)
    OptimizerHandler().save(tmp_path, opt, HandlerContext(step=1, items={"m": model, "o": opt}))
    keys = set(safetensors.torch.load_file(tmp_path / "optimizer.safetensors"))
    assert "mlp.0.weight/exp_avg" in keys
    assert "mlp.0.weight/step" in keys
    structure = msgpack.unpackb((tmp_path / "optimizer.msgpack").read_bytes(), raw=False)
    assert structure["param_groups"][0]["params"][:2] == ["embed.weight", "mlp.0.weight"]
    plain = OptimizerHandler().restore(tmp_path, None, HandlerContext(step=1))
    assert set(plain["state"]) == {name for name, _ in model.named_parameters()}
    assert plain["param_groups"][0]["betas"] == (0.9, 0.999)


def test_survives_reordering_compile_and_activation_checkpointing(tmp_path: Path) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = Net()
    decay: list[torch.Tensor] = [model.mlp[0].weight, model.mlp[2].weight]  # type: ignore[list-item]
    rest: list[torch.Tensor] = [p for p in model.parameters() if all(p is not d for d in decay)]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups)
    _train(model, opt, 3, seed=1)
    items = {"model": model, "optimizer": opt}
    OptimizerHandler().save(tmp_path, opt, HandlerContext(step=3, items=items))

    inner = _copy(model)
    inner.mlp = checkpoint_wrapper(inner.mlp)  # type: ignore[assignment]
    wrapped = torch.compile(inner)
    seq = inner.mlp._checkpoint_wrapped_module
    decay2: list[torch.Tensor] = [seq[2].weight, seq[0].weight]  # type: ignore[index,union-attr]
    rest2: list[torch.Tensor] = [
        p for p in reversed(list(inner.parameters())) if all(p is not d for d in decay2)
    ]
    groups2: list[dict[str, Any]] = [{"params": decay2}, {"params": rest2, "weight_decay": 0}]
    opt2 = torch.optim.AdamW(groups2)
    OptimizerHandler().restore(
        tmp_path, opt2, HandlerContext(step=3, items={"model": wrapped, "optimizer": opt2})
    )
    _train(model, opt, 2, seed=2)
    _train(inner, opt2, 2, seed=2)
    assert _same_params(model, inner)


def test_tied_parameters_use_the_models_kept_name(tmp_path: Path) -> None:
    model = Net(tied=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 1, seed=0)
    OptimizerHandler().save(tmp_path, opt, HandlerContext(step=1, items={"model": model}))
    keys = set(safetensors.torch.load_file(tmp_path / "optimizer.safetensors"))
    assert "embed.weight/momentum_buffer" in keys
    assert not any(k.startswith("head.weight") for k in keys)


def test_an_optimizer_that_never_stepped(tmp_path: Path) -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(0, {"model": model, "optimizer": opt}, force=True)
        assert opt.state_dict()["state"] == {}  # saving did not create state
        model2 = _copy(model)
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
        mgr.restore(0, {"model": model2, "optimizer": opt2})
    assert opt2.param_groups[0]["lr"] == 0.5
    assert opt2.state_dict()["state"] == {}


def test_default_handler_for_optimizers() -> None:
    opt = torch.optim.SGD(Net().parameters(), lr=0.1)
    assert isinstance(default_handler(opt, item_name="optimizer"), OptimizerHandler)


# ------------------------------------------------------------------------------ finding the model


def test_no_model_among_the_items_is_a_clear_error(tmp_path: Path) -> None:
    opt = torch.optim.SGD(Net().parameters(), lr=0.1)
    with (
        CheckpointManager(tmp_path / "ckpt") as mgr,
        pytest.raises(Exception, match=r"exactly one torch\.nn\.Module; they hold none"),
    ):
        mgr.save(1, {"optimizer": opt}, force=True)


def test_several_models_need_model_item(tmp_path: Path) -> None:
    model, teacher = Net(), Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 1, seed=0)
    items = {"model": model, "teacher": teacher, "optimizer": opt}
    with CheckpointManager(tmp_path / "a") as mgr, pytest.raises(Exception, match="model_item"):
        mgr.save(1, items, force=True)
    handlers = {"optimizer": OptimizerHandler(model_item="model")}
    with CheckpointManager(tmp_path / "b", handlers=handlers) as mgr:
        mgr.save(1, items, force=True)
        model2 = _copy(model)
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
        mgr.restore(1, {"model": model2, "teacher": Net(), "optimizer": opt2})
    _train(model, opt, 1, seed=1)
    _train(model2, opt2, 1, seed=1)
    assert _same_params(model, model2)


def test_model_item_must_be_present_and_a_module() -> None:
    opt = torch.optim.SGD(Net().parameters(), lr=0.1)
    handler = OptimizerHandler(model_item="model")
    with pytest.raises(CheckpointValueError, match=r"model_item='model'.*\['optimizer'\]"):
        handler.save(Path("/nonexistent"), opt, HandlerContext(step=0, items={"optimizer": opt}))
    with pytest.raises(CheckpointTypeError, match=r"live torch\.nn\.Module"):
        handler.save(Path("/nonexistent"), opt, HandlerContext(step=0, items={"model": None}))


def test_parameters_outside_the_model_are_refused() -> None:
    model = Net()
    stray = nn.Parameter(torch.zeros(3, 2))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with pytest.raises(CheckpointValueError, match=r"1 parameter\(s\) that are not.*\[3, 2\]"):
        OptimizerHandler().save(Path("/nonexistent"), opt, HandlerContext(0, {"model": model}))


# ---------------------------------------------------------------------------------- bad input


def test_shape_and_membership_mismatches_are_listed(tmp_path: Path) -> None:
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    _train(model, opt, 1, seed=0)
    OptimizerHandler().save(tmp_path, opt, HandlerContext(1, {"model": model}))
    other = Net(width=4)
    other.extra = nn.Linear(2, 2)
    opt2 = torch.optim.Adam(other.parameters())
    before = opt2.state_dict()
    with pytest.raises(StateMismatchError) as info:
        OptimizerHandler().restore(tmp_path, opt2, HandlerContext(1, {"model": other}))
    message = str(info.value)
    assert "mlp.0.weight: saved for shape [6, 6], the parameter is [4, 4]" in message
    assert "extra.weight is in the optimizer but not in the checkpoint" in message
    assert "OptimizerHandler(strict=False)" in message
    assert opt2.state_dict() == before


def test_handler_options_are_validated() -> None:
    with pytest.raises(CheckpointValueError, match=r"hyperparameters must be one of.*'newest'"):
        OptimizerHandler(hyperparameters="newest")  # type: ignore[arg-type]
    with pytest.raises(CheckpointTypeError, match="strict must be True or False"):
        OptimizerHandler(strict="no")  # type: ignore[arg-type]


def test_handler_rejects_non_optimizers() -> None:
    with pytest.raises(CheckpointTypeError, match=r"torch\.optim\.Optimizer"):
        OptimizerHandler().save(Path("/nonexistent"), {"a": 1}, HandlerContext(0))


def test_async_save_stages_model_and_optimizer(tmp_path: Path) -> None:
    from orbit_pt import CheckpointManagerOptions
    from orbit_pt.handlers import ModelHandler
    from orbit_pt.handlers.base import StagingHandler

    assert isinstance(ModelHandler(), StagingHandler)
    assert isinstance(OptimizerHandler(), StagingHandler)
    torch.manual_seed(0)
    model = Net(tied=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 2, seed=1)
    expected_model = _copy(model, tied=True)
    expected_opt = torch.optim.AdamW(expected_model.parameters(), lr=0.01)
    expected_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    options = CheckpointManagerOptions(async_save=True)
    with CheckpointManager(tmp_path / "ckpt", options=options) as mgr:
        for step in (2, 3):
            mgr.save(step, {"model": model, "optimizer": opt}, force=True)
            _train(model, opt, 1, seed=step)  # changes the live objects while the write runs
        mgr.wait_until_finished()
        restored = Net(tied=True)
        restored_opt = torch.optim.AdamW(restored.parameters(), lr=0.01)
        mgr.restore(2, {"model": restored, "optimizer": restored_opt})
    assert _same_params(restored, expected_model)
    _train(restored, restored_opt, 1, seed=9)
    _train(expected_model, expected_opt, 1, seed=9)
    assert _same_params(restored, expected_model)


# ------------------------------------------------------------------ the optimizer's class and keys


def _saved(tmp_path: Path, opt_factory: OptimizerFactory, steps: int = 2) -> tuple[Path, Net]:
    """A step saved through the manager from a trained ``Net`` and its optimizer."""
    torch.manual_seed(0)
    model = Net()
    opt = opt_factory(list(model.parameters()))
    _train(model, opt, steps, seed=1)
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(steps, {"model": model, "optimizer": opt}, force=True)
    return root, model


def _snapshot(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


def _assert_unchanged(opt: torch.optim.Optimizer, before: dict[str, Any]) -> None:
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert after["state"].keys() == before["state"].keys()
    for index, per_param in before["state"].items():
        assert after["state"][index].keys() == per_param.keys()
        for key, value in per_param.items():
            assert torch.equal(torch.as_tensor(after["state"][index][key]), torch.as_tensor(value))


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
def test_another_optimizer_class_is_refused_before_anything_changes(
    tmp_path: Path, stepped: bool
) -> None:
    root, model = _saved(tmp_path, lambda ps: torch.optim.AdamW(ps, lr=0.01))
    live = _copy(model)
    opt = torch.optim.SGD(live.parameters(), lr=0.1, momentum=0.9)
    if stepped:
        _train(live, opt, 1, seed=5)
    before = _snapshot(opt)
    with CheckpointManager(root) as mgr, pytest.raises(StateMismatchError) as info:
        mgr.restore(2, {"model": live, "optimizer": opt})
    message = str(info.value)
    assert "torch.optim.adamw.AdamW" in message
    assert "torch.optim.sgd.SGD" in message
    assert "[exp_avg, exp_avg_sq, step]" in message
    assert "[momentum_buffer]" in message
    _assert_unchanged(opt, before)
    _train(live, opt, 1, seed=6)  # still usable: no KeyError: 'momentum_buffer' or 'momentum'


@pytest.mark.parametrize(
    ("saved_amsgrad", "live_amsgrad", "stepped", "where"),
    [
        (True, False, False, "only in the checkpoint: [max_exp_avg_sq]"),
        (True, False, True, "only in the checkpoint: [max_exp_avg_sq]"),
        (False, True, False, "not in the checkpoint: [max_exp_avg_sq]"),
        (False, True, True, "not in the checkpoint: [max_exp_avg_sq]"),
    ],
)
def test_state_keys_that_differ_are_refused(
    tmp_path: Path, saved_amsgrad: bool, live_amsgrad: bool, stepped: bool, where: str
) -> None:
    root, model = _saved(tmp_path, lambda ps: torch.optim.Adam(ps, amsgrad=saved_amsgrad))
    live = _copy(model)
    opt = torch.optim.Adam(live.parameters(), amsgrad=live_amsgrad)
    if stepped:
        _train(live, opt, 1, seed=5)
    before = _snapshot(opt)
    with CheckpointManager(root) as mgr, pytest.raises(StateMismatchError) as info:
        mgr.restore(2, {"model": live, "optimizer": opt})
    message = str(info.value)
    assert where in message, message
    assert "embed.weight, mlp.0.weight" in message  # the parameters, not one line each
    assert "amsgrad" in message  # the fix
    _assert_unchanged(opt, before)


def test_the_probe_runs_no_step_hooks_and_leaves_the_optimizer_alone(tmp_path: Path) -> None:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    root, model = _saved(tmp_path, lambda ps: torch.optim.Adam(ps, lr=0.01))
    calls: list[str] = []
    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(type(o).__name__))
    try:
        live = _copy(model)
        opt = torch.optim.Adam(live.parameters(), lr=0.01)
        with CheckpointManager(root) as mgr:
            mgr.restore(2, {"model": live, "optimizer": opt})
    finally:
        handle.remove()
    assert calls == []
    assert len(opt.state) == len(list(live.parameters()))


def test_class_and_state_keys_are_recorded(tmp_path: Path) -> None:
    root, _ = _saved(tmp_path, lambda ps: torch.optim.Adam(ps, amsgrad=True))
    with CheckpointManager(root) as mgr:
        info = mgr.metadata(2).items["optimizer"].info
    assert info["optimizer_class"] == "torch.optim.adam.Adam"
    assert info["state_keys"] == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    structure = msgpack.unpackb(
        (root / "step_00000002" / "optimizer" / "optimizer.msgpack").read_bytes(), raw=False
    )
    assert structure["optimizer_class"] == "torch.optim.adam.Adam"


def test_steps_saved_without_the_class_are_not_class_checked(tmp_path: Path) -> None:
    # Adam and AdamW keep the same state keys: only the class tells them apart.
    root, model = _saved(tmp_path, lambda ps: torch.optim.Adam(ps, lr=0.01))
    live = _copy(model)
    items = {"model": live, "optimizer": torch.optim.AdamW(live.parameters())}
    with CheckpointManager(root) as mgr, pytest.raises(StateMismatchError, match="AdamW"):
        mgr.restore(2, items)
    path = root / "step_00000002" / "optimizer" / "optimizer.msgpack"
    structure = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    del structure["optimizer_class"]  # as written before the class was recorded
    path.write_bytes(msgpack.packb(structure, use_bin_type=True))
    live = _copy(model)
    opt = torch.optim.AdamW(live.parameters(), lr=0.01)
    context = HandlerContext(2, {"model": live, "optimizer": opt})
    OptimizerHandler().restore(path.parent, opt, context)
    assert len(opt.state) == len(list(live.parameters()))


def test_only_torchs_own_optimizers_are_probed(tmp_path: Path) -> None:
    # A user class may count or log its steps: it is never stepped by the restore, so a fresh one
    # gets the class check only (its first step then fails as it would with torch alone).
    class CountingAdam(torch.optim.Adam):
        steps = 0

        def step(self, closure: Any = None) -> Any:
            CountingAdam.steps += 1
            return super().step(closure)

    root, model = _saved(tmp_path, lambda ps: CountingAdam(ps, amsgrad=True))
    live = _copy(model)
    opt = CountingAdam(live.parameters(), amsgrad=False)
    with CheckpointManager(root) as mgr:
        mgr.restore(2, {"model": live, "optimizer": opt})
    assert CountingAdam.steps == 2  # the two training steps before the save, no probe
    # one that has stepped is checked against its own state
    stepped_model = _copy(model)
    stepped = CountingAdam(stepped_model.parameters(), amsgrad=False)
    _train(stepped_model, stepped, 1, seed=3)
    items = {"model": stepped_model, "optimizer": stepped}
    with CheckpointManager(root) as mgr, pytest.raises(StateMismatchError, match="max_exp_avg_sq"):
        mgr.restore(2, items)
