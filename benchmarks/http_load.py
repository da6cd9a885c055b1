"""HTTP serving load (issue 5): this cluster's OpenAI server against `transformers serve`.

Each server runs as a subprocess on a free 127.0.0.1 port with the default model
(SmolLM2-135M-Instruct, fp32 on the CPU, 2 threads in all): ``python -m cluster serve``
(1 prefill + 1 decode worker, one CPU each) and ``transformers serve
--continuous-batching`` on the engine's own HF conversion of the same GGUF. For each
client count N, N concurrent clients each send K streaming chat completions one after
another (greedy, the same seeded prompts and ``max_tokens`` for both servers); per
request the client times TTFT (send to first content chunk), TPOT ((last content chunk -
first) / (tokens - 1)) and the end-to-end latency. Every level is bounded by
``--timeout-s``; requests cut off there count as unfinished: their tokens count for
throughput, only finished requests for latencies. A warm-up (the peer's CB init, the
cluster's first steps) runs before the first level. Run it when the machine is quiet.

    python -m cluster bench http [--clients 1 8 32 64] [--requests-per-client 2]
        [--max-tokens 64] [--timeout-s 300] [--json] [--skip-peer]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from benchmarks.load_stats import (
    DONE,
    PEER,
    PROJECT,
    LevelStats,
    RequestResult,
    comparisons_of,
    parse_sse_line,
    report,
    summarize,
)
from benchmarks.local_ports import HOST, free_ports

REPO_ROOT = Path(__file__).resolve().parents[1]
# The peer's KV cache: the memory each cluster worker's pool gets on a CPU by default.
PEER_KV_BYTES = 2 << 30
PEER_PAGE_SIZE = 256  # transformers' default continuous-batching page
PEER_MAX_BATCH_TOKENS = 2048  # the cluster's max_num_batched_tokens
SUBJECTS = ("a lighthouse keeper", "a young dragon", "a retired astronaut", "a clockmaker",
            "a lost robot", "two rival bakers", "a village librarian", "a deep-sea diver")
PLOTS = ("who finds a door that was not there yesterday", "who must cross a frozen sea",
         "who loses a very old map", "who is asked to keep a dangerous secret",
         "who wakes up one morning able to hear the thoughts of birds")
PLACES = ("in a mountain town", "on a crowded space station", "in a desert city",
          "on an island with no name", "in a forest that moves at night")


# --- prompts ---------------------------------------------------------------------------------

def make_prompts(count: int, seed: int) -> list[str]:
    """``count`` distinct story prompts drawn from ``seed``: open-ended, so a greedy
    answer runs past any small ``max_tokens`` and both servers produce similar lengths."""
    rng = random.Random(seed)
    return [f"Write a long, detailed story about {rng.choice(SUBJECTS)} {rng.choice(PLOTS)} "
            f"{rng.choice(PLACES)}. Give every character a name. (Story number {i}.)"
            for i in range(count)]


# --- servers -----------------------------------------------------------------------------------

@dataclass
class ServerSpec:
    """How to start one server; ``model`` None: ask its GET /v1/models. ``stop_grace_s``:
    how long it may take to exit after SIGINT before it is killed."""

    name: str
    argv: list[str]
    env: dict[str, str]
    model: str | None = None
    stop_grace_s: float = 60.0


def free_port() -> int:
    return free_ports(1)[0]


def project_spec(port: int, config: str | None) -> ServerSpec:
    """``python -m cluster serve`` of this checkout (its own packages first on the path)."""
    argv = [sys.executable, "-m", "cluster", "serve", "--host", HOST, "--port", str(port)]
    if config:
        argv += ["--config", config]
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return ServerSpec(PROJECT, argv, {"PYTHONPATH": path})


def peer_kv_blocks(config: dict[str, Any], kv_bytes: int = PEER_KV_BYTES) -> int:
    """Whole-model fp32 KV blocks of ``PEER_PAGE_SIZE`` tokens (transformers' ``num_blocks``
    unit) that fit in ``kv_bytes``, from the checkpoint's config.json."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = (2 * 4 * config["num_hidden_layers"] * PEER_PAGE_SIZE
                   * config["num_key_value_heads"] * head_dim)  # K and V, 4 bytes each
    return kv_bytes // block_bytes


def peer_spec(port: int) -> ServerSpec:
    """``transformers serve --continuous-batching`` on the engine's HF conversion of the
    default GGUF, offline, fp32, 2 threads, its default attention. Its KV cache gets what
    a cluster worker's gets (left alone it takes 90% of the machine's RAM; sized for only
    the requests in flight it stalled new ones at 64 clients)."""
    from benchmarks.peers.common import NUM_THREADS, default_hf_dir

    model = default_hf_dir()
    blocks = peer_kv_blocks(json.loads((model / "config.json").read_text(encoding="utf-8")))
    argv = [str(Path(sys.executable).with_name("transformers")), "serve", str(model),
            "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--cb-num-blocks", str(blocks),
            "--cb-max-batch-tokens", str(PEER_MAX_BATCH_TOKENS),
            "--host", HOST, "--port", str(port)]
    threads = str(NUM_THREADS)
    # Its GET /v1/models scans the hub cache and fails without one: name the model instead.
    # After SIGINT uvicorn stops but the process stays (the continuous-batching thread is
    # never stopped), so it is killed soon.
    return ServerSpec(PEER, argv, {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads,
                                   "MKL_NUM_THREADS": threads}, model=str(model),
                      stop_grace_s=10.0)


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    """GET without any proxy (the servers are local)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def _log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop_process_tree(proc: subprocess.Popen[bytes], grace_s: float) -> list[int]:
    """SIGINT the server (the cluster server then shuts its own Ray instance down), wait,
    then kill whatever of its process tree is still there; returns the pids killed.

    The tree is listed before the signal, so Ray's processes are found even after their
    parent is gone; only those pids are ever signalled."""
    tree: list[psutil.Process] = []
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    proc.wait()
    return [p.pid for p in alive]


@contextlib.contextmanager
def running_server(spec: ServerSpec, ready_timeout_s: float) -> Iterator[tuple[str, str]]:
    """Start ``spec``, wait for GET /health to answer 200, yield (base URL, model id),
    and stop it on the way out whatever happened."""
    port = spec.argv[spec.argv.index("--port") + 1]
    base = f"http://{HOST}:{port}"
    with tempfile.NamedTemporaryFile(prefix=f"http-load-{spec.name}-", suffix=".log",
                                     delete=False) as log:
        log_path = Path(log.name)
        proc = subprocess.Popen(spec.argv, cwd=REPO_ROOT, env={**os.environ, **spec.env},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{spec.name} exited with {proc.returncode} before it was "
                                   f"ready; log {log_path}:\n{_log_tail(log_path)}")
            # Not yet listening (OSError), or something else answering on the port.
            with contextlib.suppress(OSError, http.client.HTTPException):
                if _get(f"{base}/health", 5)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{spec.name} not ready after {ready_timeout_s:.0f} s; "
                                   f"log {log_path}:\n{_log_tail(log_path)}")
            time.sleep(1.0)
        model = spec.model or json.loads(_get(f"{base}/v1/models", 30)[1])["data"][0]["id"]
        yield base, model
    finally:
        killed = stop_process_tree(proc, spec.stop_grace_s)
        if killed:
            print(f"{spec.name}: killed {len(killed)} leftover processes {killed}",
                  file=sys.stderr)
    log_path.unlink()


# --- load ----------------------------------------------------------------------------------

async def stream_chat(session: aiohttp.ClientSession, base: str, model: str, prompt: str,
                      max_tokens: int, deadline: float) -> RequestResult:
    """One greedy streaming chat completion, timed chunk by chunk; gives up at ``deadline``
    (``time.perf_counter`` seconds)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult(sent=time.perf_counter())
    timeout = aiohttp.ClientTimeout(total=deadline - result.sent)
    try:
        async with session.post(f"{base}/v1/chat/completions", json=body,
                                timeout=timeout) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                event = parse_sse_line(raw.decode())
                if event == DONE:
                    break
                if isinstance(event, dict):
                    result.observe(event, time.perf_counter())
        result.end = time.perf_counter()
        if result.first is None:
            result.error = "no content streamed"
    except asyncio.TimeoutError:
        result.error = "cut off by the level's time bound"
    except (aiohttp.ClientError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_level(base: str, model: str, prompts: Sequence[str], clients: int,
                    max_tokens: int, timeout_s: float) -> LevelStats:
    """``clients`` concurrent clients; client i sends prompts i, i + clients, ... one after
    another until its share is done or the level's time bound passes."""
    start = time.perf_counter()
    deadline = start + timeout_s
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def client(own: Iterable[str]) -> list[RequestResult]:
            results = []
            for prompt in own:
                if time.perf_counter() >= deadline:
                    break
                results.append(await stream_chat(session, base, model, prompt, max_tokens,
                                                  deadline))
            return results

        per_client = await asyncio.gather(*(client(prompts[i::clients])
                                            for i in range(clients)))
    wall = time.perf_counter() - start
    return summarize(clients, [r for rs in per_client for r in rs], wall)


def measure(spec: ServerSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Start one server, warm it up, run every level, stop it: ``{"levels": [...]}``, or
    ``{"error": why}`` when it could not start."""
    try:
        with running_server(spec, args.ready_timeout_s) as (base, model):
            warmup = make_prompts(args.warmup, seed=args.seed + 1000)
            asyncio.run(run_level(base, model, warmup, len(warmup), 8, args.timeout_s))
            levels = []
            for n in args.clients:
                prompts = make_prompts(n * args.requests_per_client, seed=args.seed + n)
                stats = asyncio.run(run_level(base, model, prompts, n, args.max_tokens,
                                              args.timeout_s))
                print(f"{spec.name} {n} clients: {stats.finished}/{stats.sent} finished, "
                      f"{stats.tokens_per_s:.1f} tok/s, {stats.wall_s:.1f} s", file=sys.stderr)
                levels.append(stats)
            return {"levels": levels}
    except RuntimeError as e:
        print(f"{spec.name}: {e}", file=sys.stderr)
        return {"error": str(e).splitlines()[0]}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=300.0,
                    help="time bound of each client count on each server")
    ap.add_argument("--ready-timeout-s", type=float, default=600.0,
                    help="how long a server may take to answer GET /health")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests (8 tokens each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", help="cluster config for `python -m cluster serve`")
    ap.add_argument("--skip-peer", action="store_true", help="run only this cluster's server")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    return ap


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    if str(REPO_ROOT) not in sys.path:  # run as a script: the benchmarks package is here
        sys.path.insert(0, str(REPO_ROOT))
    specs = [project_spec(free_port(), args.config)]
    if not args.skip_peer:
        specs.append(peer_spec(free_port()))
    runs = {spec.name: measure(spec, args) for spec in specs}
    if args.json:
        print(json.dumps({name: {"levels": [asdict(s) for s in run["levels"]]} if "levels" in run
                          else run for name, run in runs.items()} |
                         {"ratios": [asdict(c) for c in comparisons_of(runs)]}, indent=1))
        return 0
    print(f"{time.strftime('%Y-%m-%d')}: {args.requests_per_client} requests per client, "
          f"max_tokens {args.max_tokens}, greedy, at most {args.timeout_s:.0f} s per level\n")
    print(report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
