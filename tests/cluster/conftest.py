"""A real local Ray instance for the cluster tests: one per session, shut down at the end."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_instance():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        yield ray
        return
    # Room for a 2 + 2 cluster of half-CPU workers next to the session's other actors.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             namespace="llm-cluster-tests")
    try:
        yield ray
    finally:
        ray.shutdown()
