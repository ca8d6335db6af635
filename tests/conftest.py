"""Shared test configuration.

Hypothesis runs few examples by default so that CI stays fast; ``--hypothesis-profile=slow``
(used with ``-m slow``) runs many more.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["_s3", "_roots"]  # the loopback S3 server (tests/_s3.py); `where` (_roots.py)

# database=None: no .hypothesis/ folder written into the current directory.
settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "slow",
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Every test leaves ``os.environ`` as it found it. A framework run in this process (a
    Lightning Trainer with a model-parallel strategy) sets MASTER_PORT, WORLD_SIZE, RANK...;
    left behind, they make a later example run in a new process join a job that is gone."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
