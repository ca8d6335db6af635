"""Several tensors read at once when their bytes come by ranged requests (remote_files.for_each)."""

from __future__ import annotations

import contextvars
import threading
import time

import pytest
import torch

from orbit_pt._format import remote_files

_marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="unset")


def test_remote_reads_run_at_once_with_the_callers_context_and_no_grad() -> None:
    seen: list[tuple[str, bool, int]] = []
    lock = threading.Lock()
    running = [0, 0]  # now, most at once
    parameter = torch.nn.Parameter(torch.zeros(8))

    def read(index: int) -> None:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        time.sleep(0.05)  # a request's round trip
        parameter.data[index] = index  # an in-place write into a parameter, as a restore does
        parameter[index : index + 1].copy_(torch.tensor([float(index)]))  # needs no_grad
        with lock:
            running[0] -= 1
            seen.append((_marker.get(), torch.is_grad_enabled(), index))

    token = _marker.set("the caller's")
    try:
        remote_files.for_each(list(range(8)), read, remote=True)
    finally:
        _marker.reset(token)
    assert sorted(i for _, _, i in seen) == list(range(8))
    assert {(m, g) for m, g, _ in seen} == {("the caller's", False)}
    assert running[1] > 1  # they overlapped
    assert torch.equal(parameter.detach(), torch.arange(8.0))


def test_local_reads_stay_in_order_on_the_callers_thread() -> None:
    threads: list[int] = []
    order: list[int] = []

    def read(index: int) -> None:
        threads.append(threading.get_ident())
        order.append(index)

    remote_files.for_each([3, 1, 2], read, remote=False)
    assert order == [3, 1, 2]
    assert set(threads) == {threading.get_ident()}


def test_the_first_failure_in_order_is_raised_and_later_reads_are_dropped() -> None:
    started: list[int] = []

    def read(index: int) -> None:
        started.append(index)
        if index in (1, 2):
            time.sleep(0.05 if index == 1 else 0.0)
            raise OSError(f"range {index} failed")
        time.sleep(0.2)

    with pytest.raises(OSError, match="range 1 failed"):
        remote_files.for_each(list(range(40)), read, remote=True)
    assert len(started) < 40  # the queued reads were cancelled, not all run
