"""Losing a part of the control plane under load (issue 17): per victim, SIGKILL its
process while 24 greedy chat streams run, then report the seconds until ``/health`` is
ready again, the requests that failed, and the extra latency of the interrupted
requests against the same requests undisturbed.

The server is the one ``python -m cluster serve`` runs (the default model,
SmolLM2-135M-Instruct, on 1 prefill + 1 decode worker), started in this process on a
local Ray instance and a free 127.0.0.1 port. Per victim: one undisturbed round, then
one round with the kill once every stream has streamed text (the same prompts), with
``/health`` polled from the kill on. The tests use the same round (``stream_round``).

    flock /tmp/bench.lock python -m benchmarks.control_plane_loss
        [--victims worker scheduler] [--streams 24] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.local_ports import free_ports

SUBJECTS = ["the sea", "a CPU", "Paris", "prime numbers", "the moon", "a violin",
            "autumn", "a compiler", "bees", "the desert", "trains", "tea"]
CLUSTER = "control-plane-loss"
HEALTH_POLL_S = 0.2
_TIMEOUT_S = 600.0


def questions(n: int) -> list[str]:
    """``n`` distinct chat questions."""
    kinds = ["Write one sentence about {}.", "Describe {} in a few words."]
    return [kinds[i // len(SUBJECTS) % 2].format(SUBJECTS[i % len(SUBJECTS)])
            for i in range(n)]


@dataclass
class StreamResult:
    text: str = ""
    error: dict[str, Any] | None = None   # an error chunk, or the exception's text
    started: float = 0.0
    ended: float = 0.0
    chunks: int = 0   # with text
    done: bool = False   # [DONE] came

    @property
    def latency_s(self) -> float:
        return self.ended - self.started


@dataclass
class Round:
    results: list[StreamResult]
    killed_at: float | None = None   # monotonic
    health_back_s: float | None = None   # from the kill to the first ready /health
    health_seen_down: bool = False
    statuses: list[int] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(r.error is not None or not r.done for r in self.results)


async def _stream(client: httpx.AsyncClient, url: str, model: str, question: str,
                  max_tokens: int, out: StreamResult, on_chunk: Callable[[], None]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "temperature": 0.0, "max_tokens": max_tokens, "stream": True}
    out.started = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                out.error = json.loads(await resp.aread())
                return
            async for line in resp.aiter_lines():
                out.done = out.done or line == "data: [DONE]"
                if not line.startswith("data: ") or out.done:
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk
                    continue
                text = "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                if text:
                    out.text += text
                    out.chunks += 1
                    on_chunk()
    except httpx.HTTPError as e:
        out.error = {"exception": repr(e)}
    finally:
        out.ended = time.monotonic()


async def _health_back(client: httpx.AsyncClient, url: str, since: float,
                       rnd: Round, timeout_s: float) -> None:
    while time.monotonic() - since < timeout_s:
        try:
            status = (await client.get(f"{url}/health", timeout=10)).status_code
        except httpx.HTTPError:
            status = 0
        rnd.statuses.append(status)
        if status == 200:
            rnd.health_back_s = time.monotonic() - since
            return
        rnd.health_seen_down = True
        await asyncio.sleep(HEALTH_POLL_S)


async def stream_round(url: str, model: str, n: int, max_tokens: int,
                       kill: Callable[[], None] | None = None,
                       health_timeout_s: float = 120.0) -> Round:
    """``n`` concurrent greedy chat streams; ``kill`` (if given) runs once every stream
    has streamed a chunk, and ``/health`` is polled from then until it is ready."""
    results = [StreamResult() for _ in range(n)]
    rnd = Round(results)
    health: list[asyncio.Task] = []

    def on_chunk() -> None:
        if kill is None or rnd.killed_at is not None or any(r.chunks == 0 for r in results):
            return
        kill()
        rnd.killed_at = time.monotonic()
        health.append(asyncio.create_task(_health_back(client, url, rnd.killed_at, rnd,
                                                       health_timeout_s)))

    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(*(_stream(client, url, model, q, max_tokens, r, on_chunk)
                               for q, r in zip(questions(n), results)))
        await asyncio.gather(*health)
    return rnd


# ---- victims --------------------------------------------------------------------------
def _pid(actor: Any) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def scheduler_actor(cluster: str) -> Any:
    import ray

    from cluster.scheduler_actor import NAMESPACE, scheduler_name

    return ray.get_actor(scheduler_name(cluster), namespace=NAMESPACE)


def decode_worker_actor(cluster: str) -> Any:
    """The actor of the cell's first live decode worker, as its scheduler holds it."""
    import ray

    def find(gs: Any) -> Any:
        return next(w.handle.actor for w in gs.workers if w.alive and w.role == "decode")

    return ray.get(scheduler_actor(cluster).__ray_call__.remote(find))


def replicas(app: str, deployment: str) -> list[str]:
    """The Ray names of a deployment's replica actors."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve"
                  and a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#"))


def wait_replaced(app: str, deployment: str, old: list[str],
                  timeout_s: float = 300.0) -> list[str]:
    """The deployment's replicas once as many as ``old`` serve and one is new."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = replicas(app, deployment)
        status = serve.status().applications[app].deployments[deployment].status
        if len(names) == len(old) and names != old and status == "HEALTHY":
            return names
        time.sleep(0.5)
    raise TimeoutError(f"{deployment} of {app!r} has no new replica after {timeout_s} s")


def victim_pid(victim: str, cluster: str = CLUSTER, app: str = "bench") -> int:
    """The process of ``victim``: ``scheduler``, ``worker`` (a decode worker), ``cell``
    (the application's ``LLMCell`` replica) or ``router`` (one of its ``Router``
    replicas)."""
    import ray

    if victim == "scheduler":
        return _pid(scheduler_actor(cluster))
    if victim == "worker":
        return _pid(decode_worker_actor(cluster))
    if victim in ("cell", "router"):
        name = replicas(app, "LLMCell" if victim == "cell" else "Router")[0]
        return _pid(ray.get_actor(name, namespace="serve"))
    raise ValueError(f"victim: got {victim!r}; expected scheduler, worker, cell or router")


def sigkill(pid: int) -> Callable[[], None]:
    return lambda: os.kill(pid, signal.SIGKILL)


def cell_stats(cluster: str = CLUSTER) -> Any:
    import ray

    return ray.get(scheduler_actor(cluster).stats.remote(), timeout=60)


def wait_idle(cluster: str = CLUSTER, timeout_s: float = 60.0) -> Any:
    """The cell's stats once every live worker holds no block and no sequence (drops go
    out with a worker's next step, so this can lag the last output a little)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cell_stats(cluster)
        live = stats.live()
        if all(w.num_used_blocks == 0 and w.worker_num_seqs == 0 for w in live) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def app_config(cluster: str = CLUSTER) -> Any:
    """1 prefill + 1 decode worker behind two router replicas."""
    from cluster.config import config_from_dict, with_default_pools

    return with_default_pools(config_from_dict({
        "cache": {"kv_cache_bytes": 256 << 20},
        "cluster": {"name": cluster,
                    "pools": [{"role": "prefill", "resources": {"CPU": 0.5}},
                              {"role": "decode", "resources": {"CPU": 0.5}}]},
        "serving": {"min_replicas": 2, "max_replicas": 2}}))


# ---- the benchmark --------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--victims", nargs="+",
                        default=["worker", "scheduler", "cell", "router"])
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    import ray
    from ray import serve

    from cluster.serve_app import app_for

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    (port,) = free_ports(1)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        serve.run(app_for(app_config()), name="bench", route_prefix="/")
        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        asyncio.run(stream_round(url, model, 2, 4))   # warm-up
        print("| victim | /health ready again (s) | requests failed | text changed | "
              "interrupted | their latency, median (s) | undisturbed, median (s) | "
              "extra per request, median / max (s) |")
        print("|---|---|---|---|---|---|---|---|")
        for victim in args.victims:
            base = asyncio.run(stream_round(url, model, args.streams, args.max_tokens))
            deployment = {"cell": "LLMCell", "router": "Router"}.get(victim)
            before = replicas("bench", deployment) if deployment else []
            pid = victim_pid(victim)
            hit = asyncio.run(stream_round(url, model, args.streams, args.max_tokens,
                                           sigkill(pid)))
            if deployment:
                wait_replaced("bench", deployment, before)
            wait_idle()
            changed = sum(a.text != b.text for a, b in zip(base.results, hit.results))
            # Interrupted: still running at the kill; against the same request undisturbed.
            hurt = [i for i, r in enumerate(hit.results)
                    if r.ended > (hit.killed_at or 0) and r.done and r.error is None]
            extra = [hit.results[i].latency_s - base.results[i].latency_s for i in hurt]
            back = f"{hit.health_back_s:.2f}" if hit.health_back_s is not None else "never"
            print(f"| {victim} | {back} | {hit.failed} / {args.streams} | {changed} | "
                  f"{len(hurt)} | "
                  f"{statistics.median(hit.results[i].latency_s for i in hurt):.2f} | "
                  f"{statistics.median(base.results[i].latency_s for i in hurt):.2f} | "
                  f"{statistics.median(extra):+.2f} / {max(extra):+.2f} |", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
