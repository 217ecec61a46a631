"""Ray fixtures: one local Ray instance shared by the tests of a session, stopped at the end."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """A private local Ray instance (4 logical CPUs on any machine), shared and shut down once."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    yield ray
    ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
