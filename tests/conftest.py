"""Shared test configuration: the test tiers, Hypothesis profiles, a clean environment.

``python3 dev.py test`` runs the quick tier; ``--full`` the full tier (tests marked ``full``
here: several processes, the loopback S3 server, sweeps), which CI runs too. Hypothesis runs
few examples by default; ``HYPOTHESIS_PROFILE=slow`` (with ``-m slow``) runs many more.
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


# Modules whose tests are in the full tier whatever their markers: each test spawns processes,
# kills them or sweeps many cases (measured with --durations; README, "Tests").
FULL_MODULES: frozenset[str] = frozenset(
    {
        # filled from the measured durations
    }
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the full tier: real process groups, the S3 server, the modules above."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_s3 = callspec is not None and callspec.params.get("where") == "s3"
        if (
            item.get_closest_marker("distributed") is not None
            or "moto_s3" in getattr(item, "fixturenames", ())
            or on_s3
            or item.path.name in FULL_MODULES
        ):
            item.add_marker(pytest.mark.full)
