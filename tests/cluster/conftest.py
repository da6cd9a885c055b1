"""A real local Ray instance for the cluster tests: one per session, shut down at the end."""

from __future__ import annotations

import socket
from collections.abc import Callable

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


@pytest.fixture(scope="session")
def free_ports() -> Callable[[int], list[int]]:
    """``free_ports(n)``: n distinct ports free on 127.0.0.1 (all bound at once, so no
    two are the same), for servers the tests start."""
    def get(n: int) -> list[int]:
        socks = [socket.socket() for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return ports

    return get
