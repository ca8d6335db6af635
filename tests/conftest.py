"""Shared test configuration.

Hypothesis runs few examples by default so that CI stays fast; ``--hypothesis-profile=slow``
(used with ``-m slow``) runs many more.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["_s3"]  # the loopback S3 server and its fault proxy (tests/_s3.py)

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
