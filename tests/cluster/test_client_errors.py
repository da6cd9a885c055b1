"""Errors from the cluster reach clients clean, over real HTTP: OpenAI's shape, a code,
a short message and a request id, never Ray's actor ids, pids or node addresses; the
details are in the server's log under that id."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cluster.config import config_from_dict

pytestmark = pytest.mark.slow

_TIMEOUT_S = 300.0
# What Ray's actor errors carry: hex actor/worker ids, "pid=", IPv4 addresses, OOM advice.
_INTERNALS = re.compile(r"[0-9a-f]{16,}|pid|\b\d{1,3}(\.\d{1,3}){3}\b|memory|actor",
                        re.IGNORECASE)


@pytest.fixture(scope="module")
def dead_scheduler(serve_apps, tiny_factory) -> Iterator[str]:
    """A served tiny model whose scheduler was killed for good (no restart)."""
    import ray

    from cluster.scheduler_actor import NAMESPACE, scheduler_name

    config = config_from_dict({
        "model": {"path": tiny_factory("llama").path},
        "cache": {"kv_cache_bytes": 8 << 20},
        "cluster": {"name": "client-errors",
                    "pools": [{"role": "mixed", "resources": {"CPU": 0.25}}]}})
    with serve_apps({"/": config}) as url:
        ok = httpx.post(f"{url}/v1/completions", timeout=_TIMEOUT_S, json={
            "model": Path(config.model.path).name, "prompt": [1, 2, 3], "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        ray.kill(ray.get_actor(scheduler_name("client-errors"), namespace=NAMESPACE),
                 no_restart=True)
        yield url


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=_TIMEOUT_S).json()["data"][0]["id"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_lost_scheduler_is_a_clean_503_with_a_request_id(dead_scheduler, stream):
    import ray

    resp = httpx.post(f"{dead_scheduler}/v1/completions", timeout=_TIMEOUT_S, json={
        "model": _model(dead_scheduler), "prompt": [1, 2, 3], "max_tokens": 4,
        "stream": stream})
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "5"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("server_error", "unavailable")
    found = re.search(r"request id ((?:cmpl|err)-[0-9a-f]{32})", error["message"])
    assert found, error["message"]
    request_id = found.group(1)
    assert not _INTERNALS.search(error["message"].replace(request_id, "")), error["message"]
    # The details (Ray's own words) are in the router's log under that id.
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    lines = [line for f in logs.rglob("*") if f.is_file() and f.suffix in (".log", ".err")
             for line in f.read_text(errors="replace").splitlines() if request_id in line]
    assert any("actor" in line.lower() for line in lines), lines


def test_health_and_metrics_say_unavailable_without_internals(dead_scheduler):
    health = httpx.get(f"{dead_scheduler}/health", timeout=_TIMEOUT_S)
    assert health.status_code == 503
    assert health.json() == {"status": "unavailable", "reason": "the scheduler does not answer"}
    metrics = httpx.get(f"{dead_scheduler}/metrics", timeout=_TIMEOUT_S)
    assert (metrics.status_code, metrics.text) == (503, "the scheduler does not answer\n")
