"""Run an example script in a new process (under torchrun for several ranks) and read its record."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).parents[1]


def run_example(example: Path, out: Path, *args: str, ranks: int = 1) -> list[dict[str, Any]]:
    """Run ``example *args --record=out``; each rank's record (``out``, or ``out.rank<N>``)."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    done = subprocess.run(
        [*launcher, str(example), *args, f"--record={out}"],
        capture_output=True,
        text=True,
        timeout=240,
        env=example_env(),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    paths = [out] if ranks == 1 else [Path(f"{out}.rank{r}") for r in range(ranks)]
    return [json.loads(path.read_text()) for path in paths]


# What torchrun (or a framework in this process) sets: the example gets its own or none.
_LAUNCHER_VARIABLES = {
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID",
}  # fmt: skip


def example_env() -> dict[str, str]:
    """The environment an example runs in: this one without launcher variables, the repository
    on the path, one OpenMP thread."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def digest(model: torch.nn.Module) -> str:
    """The examples' digest of a model's weights (names and bytes, in name order)."""
    hasher = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(value.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()
