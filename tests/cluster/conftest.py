"""A real local Ray instance for the cluster tests: one per session, shut down at the end."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from benchmarks import local_ports


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
    """``free_ports(n)``: n distinct ports free on 127.0.0.1, for servers the tests start
    (``benchmarks.local_ports``: drawn below the kernel's ephemeral range, the one in
    which Ray's own processes bind theirs)."""
    return local_ports.free_ports


@pytest.fixture(scope="session")
def serve_apps(ray_instance, free_ports) -> Callable[..., contextlib.AbstractContextManager]:
    """``with serve_apps({"/": config, "/tiny": other}) as base``: Ray Serve on a free port
    of 127.0.0.1 with one app of ``cluster.serve_app`` per route prefix; ``base`` is its
    URL. Serve (and every cell it started) is shut down on the way out."""

    @contextlib.contextmanager
    def run(apps: dict[str, Any]) -> Iterator[str]:
        from ray import serve

        from cluster.serve_app import app_for

        (port,) = free_ports(1)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            for prefix, config in apps.items():
                serve.run(app_for(config), name=prefix.strip("/") or "default",
                          route_prefix=prefix)
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()

    return run


@pytest.fixture(scope="session")
def openai_client() -> Callable[[str, float], Any]:
    """``openai_client(base, timeout_s)``: the OpenAI SDK's client of a server the tests
    started (``base`` with its route prefix)."""
    openai = pytest.importorskip("openai")

    def make(base: str, timeout_s: float) -> Any:
        return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=timeout_s)

    return make


class MidRunKill:
    """An ``on_output(seen)`` callback that ``ray.kill``s one worker of a running cluster
    at the first streamed output at which the worker holds sequences.

    A decode worker has streamed tokens of some of them by then, and decodes each for
    many steps. A prefill worker can be done with every prompt before the first output
    reaches the test, so it is frozen (SIGSTOP) from the start: its calls hang, and it
    still holds its prompts when it is killed.
    """

    def __init__(self, engine: Any, victim: str) -> None:
        import ray

        self.engine, self.victim = engine, victim
        self.killed_at: int | None = None
        if victim.startswith("prefill"):
            actor = engine.workers[victim]
            os.kill(ray.get(actor.__ray_call__.remote(lambda _: os.getpid())), signal.SIGSTOP)

    def holds_sequences(self) -> bool:
        w = next(w for w in self.engine.stats().workers if w.worker_id == self.victim)
        return w.num_running + w.num_waiting > 0

    def __call__(self, seen: int) -> None:
        import ray

        if self.killed_at is None and self.holds_sequences():
            # A frozen worker may be found lost, killed and replaced by the cell's pool
            # manager before this: then it is gone already.
            actor = self.engine.workers.get(self.victim)
            if actor is not None:
                ray.kill(actor)
            self.killed_at = seen


@pytest.fixture
def mid_run_kill(ray_instance) -> type[MidRunKill]:
    return MidRunKill
