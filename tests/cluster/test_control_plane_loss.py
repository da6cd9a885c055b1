"""The service survives the loss of a part of its control plane (issue 17), over real
HTTP on a real local Ray instance: a process SIGKILLed while 24 greedy streams run
(the global scheduler, a decode worker, or the ``LLMCell`` Serve replica) costs no
stream anything (each ends with the text of an undisturbed run), ``/health`` is ready
again within 30 s, and afterwards no worker holds a KV block or a sequence."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from benchmarks.control_plane_loss import (
    CLUSTER,
    app_config,
    cell_stats,
    replicas,
    sigkill,
    stream_round,
    victim_pid,
    wait_idle,
    wait_replaced,
)

pytestmark = pytest.mark.slow

STREAMS, MAX_TOKENS = 24, 24
APP = "default"   # the name serve_apps gives the app at "/"
_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def server(serve_apps) -> Iterator[tuple[str, str]]:
    """(url, model id) of the served default model, 1 prefill + 1 decode worker."""
    with serve_apps({"/": app_config()}) as url:
        model = httpx.get(f"{url}/v1/models", timeout=_TIMEOUT_S).json()["data"][0]["id"]
        yield url, model


@pytest.fixture(scope="module")
def undisturbed(server) -> list[str]:
    url, model = server
    rnd = asyncio.run(stream_round(url, model, STREAMS, MAX_TOKENS))
    assert [r.error for r in rnd.results] == [None] * STREAMS
    assert all(r.text for r in rnd.results)
    return [r.text for r in rnd.results]


@pytest.mark.parametrize("victim", ["scheduler", "cell", "worker"])
def test_a_killed_process_mid_streams_changes_no_text(server, undisturbed, victim):
    url, model = server
    pid, cells = victim_pid(victim, app=APP), replicas(APP, "LLMCell")
    workers = sorted(w.worker_id for w in cell_stats().live())
    rnd = asyncio.run(stream_round(url, model, STREAMS, MAX_TOKENS, sigkill(pid),
                                   health_timeout_s=_TIMEOUT_S))
    assert rnd.killed_at is not None
    assert [r.error for r in rnd.results] == [None] * STREAMS
    assert [r.text for r in rnd.results] == undisturbed
    assert rnd.health_back_s is not None and rnd.health_back_s < 30.0, rnd.statuses
    stats = wait_idle(CLUSTER)
    assert [(w.worker_id, w.num_used_blocks, w.worker_num_seqs) for w in stats.live()] == \
        [(w.worker_id, 0, 0) for w in stats.live()]
    if victim == "scheduler":   # Ray restarted it: another process serves now
        assert victim_pid("scheduler") != pid
        assert rnd.health_seen_down, rnd.statuses
    if victim == "cell":   # Serve restarted it, and it adopted the running workers
        wait_replaced(APP, "LLMCell", cells)
        assert sorted(w.worker_id for w in wait_idle(CLUSTER).live()) == workers


def test_a_killed_router_replica_ends_only_its_streams_and_leaves_no_sequence(
        server, undisturbed):
    """The streams the dead replica held end (cut off); the other replica's complete
    with the undisturbed text; the scheduler drops the dead one's requests (aborts
    those running) once its lease runs out, so no sequence holds blocks."""
    url, model = server
    routers = replicas(APP, "Router")
    assert len(routers) == 2
    rnd = asyncio.run(stream_round(url, model, STREAMS, MAX_TOKENS,
                                   sigkill(victim_pid("router", app=APP))))
    cut = [i for i, r in enumerate(rnd.results) if r.error is not None or not r.done]
    assert 0 < len(cut) < STREAMS
    assert [r.text for i, r in enumerate(rnd.results) if i not in cut] == \
        [t for i, t in enumerate(undisturbed) if i not in cut]
    # Finished or not, the dead replica's requests stay until the scheduler reaps them.
    deadline = time.monotonic() + 120.0
    while cell_stats().num_requests and time.monotonic() < deadline:
        time.sleep(0.5)
    stats = wait_idle(CLUSTER)
    assert stats.num_requests == 0
    assert [(w.num_used_blocks, w.worker_num_seqs) for w in stats.live()] == \
        [(0, 0)] * len(stats.live())
    wait_replaced(APP, "Router", routers)
    assert asyncio.run(stream_round(url, model, 2, 4)).failed == 0   # served again


def test_a_cell_really_gone_is_relaunched_and_the_routers_find_it(server, undisturbed):
    """Scheduler (for good), workers and ``LLMCell`` replica all killed: the restarted
    replica finds nothing to adopt and launches a new cell; the routers re-attach to
    its scheduler by name and serve the same text as before."""
    import ray

    from benchmarks.control_plane_loss import scheduler_actor
    from cluster.pools import worker_name
    from cluster.scheduler_actor import NAMESPACE

    url, model = server
    cells = replicas(APP, "LLMCell")
    workers = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(worker_name(CLUSTER, ""))]
    assert workers
    ray.kill(scheduler_actor(CLUSTER), no_restart=True)
    for name in workers:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    sigkill(victim_pid("cell", app=APP))()
    wait_replaced(APP, "LLMCell", cells)
    assert httpx.get(f"{url}/health", timeout=_TIMEOUT_S).status_code == 200
    rnd = asyncio.run(stream_round(url, model, STREAMS, MAX_TOKENS))
    assert [r.error for r in rnd.results] == [None] * STREAMS
    assert [r.text for r in rnd.results] == undisturbed
