"""Exact resume: a run interrupted after step s and resumed in a new process is bitwise the same.

Every run happens in its own process (tests/_exact_resume_worker.py), so nothing but the
checkpoint carries state from the interrupted run to the resumed one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchdata")
pytest.importorskip("numpy")

WORKER = Path(__file__).with_name("_exact_resume_worker.py")
REPO = Path(__file__).resolve().parent.parent


def _run(tmp: Path, name: str, *args: str) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    out = tmp / name
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(WORKER), "--root", str(tmp / "ckpt"), "--out", str(out), *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    losses = {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}
    return losses, safetensors.torch.load_file(out / "params.safetensors")


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _check(tmp: Path, save_at: int, total: int, batch: int, opt: str, *, separate: bool) -> None:
    """Resume from ``save_at`` and compare with a run that never stopped.

    With ``separate``, the reference run never saves and the interrupted run stops right after
    its save (three processes); otherwise one process saves at ``save_at`` and keeps going,
    which also checks that saving does not disturb training.
    """
    common = ["--total", str(total), "--batch", str(batch), "--opt", opt]
    if separate:
        reference, final = _run(tmp, "reference", *common)
        first, _ = _run(tmp, "first", *common, "--save-at", str(save_at), "--stop")
        assert first == {s: reference[s] for s in range(save_at + 1)}
    else:
        reference, final = _run(tmp, "reference", *common, "--save-at", str(save_at))
    resumed, resumed_final = _run(tmp, "resumed", *common, "--resume")
    assert resumed == {s: reference[s] for s in range(save_at + 1, total)}
    _assert_bitwise(final, resumed_final)


def test_resume_in_a_new_process_is_bitwise_identical(tmp_path: Path) -> None:
    _check(tmp_path, save_at=4, total=9, batch=3, opt="adamw", separate=True)


@settings(max_examples=5)
@given(
    total=st.integers(2, 12),
    fraction=st.floats(0, 1),
    batch=st.integers(1, 6),
    opt=st.sampled_from(["adamw", "adam", "sgd"]),
)
def test_resume_property(
    tmp_path_factory: pytest.TempPathFactory, total: int, fraction: float, batch: int, opt: str
) -> None:
    save_at = min(total - 2, int(fraction * (total - 1)))
    _check(tmp_path_factory.mktemp("run"), save_at, total, batch, opt, separate=False)


@pytest.mark.slow
@settings(max_examples=40)
@given(
    total=st.integers(2, 40),
    fraction=st.floats(0, 1),
    batch=st.integers(1, 12),
    opt=st.sampled_from(["adamw", "adam", "sgd"]),
)
def test_resume_property_slow(
    tmp_path_factory: pytest.TempPathFactory, total: int, fraction: float, batch: int, opt: str
) -> None:
    save_at = min(total - 2, int(fraction * (total - 1)))
    _check(tmp_path_factory.mktemp("run"), save_at, total, batch, opt, separate=True)
