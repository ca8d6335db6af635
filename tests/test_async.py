"""Async saves: the caller blocks only for staging; the step appears once it is durable."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from orbit_pt import CheckpointManager, CheckpointManagerOptions, CheckpointSaveError
from orbit_pt.handlers import StateHandler
from orbit_pt.handlers.base import HandlerContext


def _opts(**kw: Any) -> CheckpointManagerOptions:
    return CheckpointManagerOptions(async_save=True, **kw)


def test_async_round_trip_and_retention(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, options=_opts(keep_last_n=2)) as mgr:
        for step in range(5):
            assert mgr.save(step, {"x": {"w": torch.full((64, 64), float(step)), "step": step}})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]
        restored = mgr.restore()["x"]
        assert restored["step"] == 4
        assert torch.equal(restored["w"], torch.full((64, 64), 4.0))


def test_mutation_after_save_returns_does_not_leak(tmp_path: Path) -> None:
    weights = torch.zeros(256, 256)
    meta = {"step": 0}
    state = {"w": weights, "meta": meta}
    with CheckpointManager(tmp_path, options=_opts()) as mgr:
        for step in range(3):
            weights.fill_(step)
            meta["step"] = step
            mgr.save(step, {"x": state})
            weights.fill_(-1.0)  # the training loop moves on at once
            meta["step"] = -1
        mgr.wait_until_finished()
        for step in range(3):
            restored = mgr.restore(step)["x"]
            assert torch.equal(restored["w"], torch.full((256, 256), float(step)))
            assert restored["meta"]["step"] == step


class _GatedHandler(StateHandler):
    """A state handler whose background write waits for the test to open a gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.fail = False

    def save(self, directory: Path, item: Any, context: HandlerContext) -> dict:
        self.gate.wait(timeout=30)
        if self.fail:
            raise OSError(f"injected write failure at step {context.step}")
        return dict(super().save(directory, item, context))


def test_latest_step_moves_only_once_durable(tmp_path: Path) -> None:
    handler = _GatedHandler()
    with CheckpointManager(tmp_path, options=_opts(), handlers={"x": handler}) as mgr:
        handler.gate.set()
        mgr.save(0, {"x": {"v": 0}})
        mgr.wait_until_finished()
        handler.gate.clear()
        mgr.save(1, {"x": {"v": 1}})
        # The write of step 1 is held: it must not be visible anywhere yet.
        assert mgr.latest_step() == 0
        assert mgr.all_steps() == [0]
        assert not (tmp_path / "step_00000001").exists()
        handler.gate.set()
        mgr.wait_until_finished()
        assert mgr.latest_step() == 1


def test_background_failure_surfaces_at_next_call_and_commits_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handler = _GatedHandler()
    handler.gate.set()
    mgr = CheckpointManager(tmp_path, options=_opts(), handlers={"x": handler})
    mgr.save(0, {"x": {"v": 0}})
    mgr.wait_until_finished()
    handler.fail = True
    with caplog.at_level(logging.ERROR):
        mgr.save(1, {"x": {"v": 1}})  # returns: the failure happens in the background
        with pytest.raises(CheckpointSaveError) as info:
            mgr.save(2, {"x": {"v": 2}})
    assert info.value.step == 1
    assert "injected write failure at step 1" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert mgr.all_steps() == [0]
    assert not list(tmp_path.glob("*.orbit-tmp"))
    assert mgr.restore(0)["x"] == {"v": 0}
    # Raised once: the manager goes on working afterwards.
    handler.fail = False
    mgr.save(3, {"x": {"v": 3}})
    mgr.close()
    assert CheckpointManager(tmp_path).all_steps() == [0, 3]


def test_failure_is_raised_by_wait_and_by_close(tmp_path: Path) -> None:
    handler = _GatedHandler()
    handler.gate.set()
    handler.fail = True
    mgr = CheckpointManager(tmp_path, options=_opts(), handlers={"x": handler})
    mgr.save(0, {"x": {"v": 0}})
    with pytest.raises(CheckpointSaveError, match="step 0"):
        mgr.wait_until_finished()
    mgr.save(1, {"x": {"v": 1}})
    with pytest.raises(CheckpointSaveError, match="step 1"):
        mgr.close()
    # close() released the lock even though it raised.
    CheckpointManager(tmp_path).close()


def test_staging_buffers_are_reused_between_saves(tmp_path: Path) -> None:
    handler = StateHandler()
    state = {"a": torch.randn(128, 128), "b": torch.randn(1000)}
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    with CheckpointManager(tmp_path, options=_opts(), handlers={"x": handler}) as mgr:
        sizes = []
        buffers = []
        for step in range(10):
            mgr.save(step, {"x": state})
            sizes.append(handler._pool.nbytes)
            buffers.append({k: b.data_ptr() for k, b in handler._pool._buffers.items()})
        mgr.wait_until_finished()
    assert sizes == [state_bytes] * 10  # one copy of the state, never more
    assert all(b == buffers[0] for b in buffers)  # the very same buffers every time


def test_waiting_for_the_previous_save_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handler = _GatedHandler()
    with CheckpointManager(tmp_path, options=_opts(), handlers={"x": handler}) as mgr:
        mgr.save(0, {"x": {"v": 0}})
        timer = threading.Timer(0.05, handler.gate.set)
        timer.start()
        with caplog.at_level(logging.INFO, logger="orbit_pt"):
            mgr.save(1, {"x": {"v": 1}})
        timer.join()
    assert any("waited" in r.getMessage() and "step 0" in r.getMessage() for r in caplog.records)


def test_default_handlers_reuse_their_staging_buffers(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    items = {"model": model, "optimizer": optimizer, "extra": {"t": torch.ones(100)}}
    with CheckpointManager(tmp_path, options=_opts()) as mgr:
        pointers = []
        for step in range(4):
            mgr.save(step, items)
            pools = {name: h._pool for name, h in mgr._default_handlers.items()}  # type: ignore[attr-defined]
            pointers.append(
                {
                    (n, k): b.data_ptr()
                    for n, pool in pools.items()
                    for k, b in pool._buffers.items()
                }
            )
        mgr.wait_until_finished()
    assert len(pointers[0]) == 2 + 3 * 2 + 1  # weights, AdamW moments + steps, the extra tensor
    assert all(p == pointers[0] for p in pointers)


def test_training_right_after_save_returns_does_not_leak_into_the_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    first = torch.nn.Linear(32, 32)
    model = torch.nn.Sequential(first, torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def train_step() -> None:
        model(torch.randn(8, 32)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step()
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moment = optimizer.state[first.weight]["exp_avg"].clone()
    with CheckpointManager(tmp_path, options=_opts()) as mgr:
        mgr.save(1, {"model": model, "optimizer": optimizer})
        for _ in range(3):
            train_step()  # in place, while the background thread writes step 1
        mgr.wait_until_finished()
        fresh_first = torch.nn.Linear(32, 32)
        fresh = torch.nn.Sequential(fresh_first, torch.nn.Linear(32, 4))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        mgr.restore(1, {"model": fresh, "optimizer": fresh_opt})
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected_model[key]), key
    assert torch.equal(fresh_opt.state[fresh_first.weight]["exp_avg"], expected_moment)
