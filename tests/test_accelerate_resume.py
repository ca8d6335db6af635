"""An Accelerate-prepared StatefulDataLoader resumes exactly (the data position before the RNG).

Accelerate's prepared loader answers ``state_dict()`` from a copy it caches, so asking it for its
state after a restore never reached the ``StatefulDataLoader`` inside: that loader built its
resumed iterator on first use, drawing a seed from the generators orbit_pt had already put back,
and the resumed run drifted (by 7.4e-3 in the loss, measured). Each run here is a new process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")

WORKER = Path(__file__).with_name("_accelerate_resume_worker.py")


def _run(root: Path, mode: str, out: Path, *, steps: int, stop: int = 0) -> dict[str, Any]:
    command = [sys.executable, str(WORKER), str(root), mode, f"--steps={steps}"]
    done = subprocess.run(
        [*command, f"--stop={stop}", f"--out={out}"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(out.read_text()))


@pytest.mark.parametrize("stop", [5, 7])  # mid-epoch in the first epoch; in the second
def test_a_run_resumed_in_a_new_process_matches_the_uninterrupted_one(
    tmp_path: Path, stop: int
) -> None:
    steps = 10  # across the epoch boundary (6 batches an epoch)
    whole = _run(tmp_path / "whole", "first", tmp_path / "whole.json", steps=steps)
    first = _run(tmp_path / "cut", "first", tmp_path / "first.json", steps=steps, stop=stop)
    resumed = _run(tmp_path / "cut", "resume", tmp_path / "resumed.json", steps=steps)
    saved = stop - stop % 2  # the latest step saved before the cut
    assert first["losses"][:saved] + resumed["losses"] == whole["losses"]
    assert resumed["weights"] == whole["weights"]


def test_a_prepared_loader_that_is_not_stateful_is_a_clear_error(tmp_path: Path) -> None:
    import torch
    from accelerate import Accelerator

    from orbit_pt import CheckpointManager, CheckpointSaveError, RecipeState, RNGState

    accelerator = Accelerator(cpu=True)  # use_stateful_dataloader is off by default
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    recipe = RecipeState(step=0, rng=RNGState(), dataloader=loader)
    with CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(1, {"recipe": RecipeState(step=1)})
        with pytest.raises(CheckpointSaveError, match="use_stateful_dataloader=True"):
            mgr.save(2, {"recipe": recipe})
        assert mgr.all_steps() == [1]  # nothing of step 2, the committed step untouched
