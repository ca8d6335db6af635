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


# Tests in the full tier whatever their markers, by module or by module::function: each resumes
# a run in a new process, sweeps many cases, or drives a whole framework's trainer, and together
# they were ~3.7 of the quick tier's 6.2 minutes (--durations, 2-core machine; README, "Tests").
FULL_MODULES: frozenset[str] = frozenset(
    {
        "test_exact_resume.py",  # the resume property sweep and the new-process resume
        "test_accelerate_resume.py",  # Accelerate runs resumed in new processes
    }
)
FULL_TESTS: frozenset[str] = frozenset(
    {
        "test_integration_lightning.py::test_after_a_resume_the_files_are_lightnings_and_only_lightning_drifts",
        "test_integration_lightning.py::test_a_killed_run_resumes_exactly_in_a_new_process",
        "test_integration_lightning.py::test_async_saves_point_only_at_committed_steps",
        "test_integration_lightning.py::test_model_checkpoint_keeps_what_it_keeps_with_lightnings_own_files",
        "test_integration_accelerate.py::test_a_run_resumed_in_a_new_process_matches_the_uninterrupted_one",
        "test_integration_hf.py::test_a_stopped_run_resumes_exactly_in_a_new_process",
        "test_export_merge.py::test_the_cli_merges",
    }
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the full tier: real process groups, the S3 server, the tests listed above."""
    modules = {item.path.name for item in items}
    names = {f"{item.path.name}::{getattr(item, 'originalname', item.name)}" for item in items}
    # A renamed test would silently move back to the quick tier: a stale entry is an error.
    stale = sorted(n for n in FULL_TESTS if n.split("::")[0] in modules and n not in names)
    if stale:
        raise pytest.UsageError(f"FULL_TESTS in tests/conftest.py names no test: {stale}")
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_s3 = callspec is not None and callspec.params.get("where") == "s3"
        if (
            item.get_closest_marker("distributed") is not None
            or "moto_s3" in getattr(item, "fixturenames", ())
            or on_s3
            or item.path.name in FULL_MODULES
            or f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in FULL_TESTS
        ):
            item.add_marker(pytest.mark.full)
