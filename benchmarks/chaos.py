"""A chaos run of the OpenAI server: many mixed requests, a share of whose clients leave
early, then checks that nothing was left behind.

It starts ``python -m cluster serve`` (this checkout, ``--config`` if given) on a free
127.0.0.1 port and sends ``--requests`` seeded random requests, ``--concurrency`` at a
time: completions and chats, streamed or not, with ``n``, logprobs, stop strings, seeds,
JSON schemas, choices, regexes and forced tool calls. ``--cut`` of the clients leave:
a stream after its first events, a plain request after 0.3 s. ``--long`` adds prompts of
900 and 1,800 words, for a long-context config. Then, once the server is idle:

- no response was a 5xx, and the server counted no ``internal_error``;
- every structured answer that ended by EOS or a tool call obeys its constraint;
- both KV tiers hold what they held before (free device blocks, host-tier usage), and
  no KV transfer failed;
- a greedy completion asked before and after is the same.

    python -m cluster bench chaos [--requests 400] [--concurrency 24] [--cut 0.3]
        [--seed 7] [--long] [--config FILE] [--json PATH]

Exit status 1 when a check fails. It sends traffic only to the server it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx

from benchmarks.http_load import free_port, project_spec, running_server
from benchmarks.metric_samples import scrape, total

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "judge", "boxing", "matches", "near", "river")
PERSON = {"type": "object", "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONSTRAINTS = (
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
    {"response_format": {"type": "json_object"}},
    {"guided_choice": ["yes", "no", "maybe"]},
    {"guided_regex": "[a-z]{3,8}( [a-z]{2,6}){2}"},
    {"tools": WEATHER, "tool_choice": "required"},
)
# Server-side series whose values must be back where they started once it is idle.
RESTORED = ("llm_cluster_kv_cache_free_blocks", "llm_cluster_host_kv_usage_ratio")


def make_request(rng: random.Random, model: str, long: bool) -> tuple[str, dict[str, Any]]:
    """One random request: (path, body), valid for the endpoint it names."""
    chat = rng.random() < 0.5
    words = rng.choice((3, 30, 300, 900, 1800) if long else (3, 30, 300))
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.choice((1, 4, 16, 64)),
                            "temperature": rng.choice((0, 0.7, 1.0)),
                            "stream": rng.random() < 0.6}
    if rng.random() < 0.3:
        body["n"] = rng.choice((2, 3))
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.1:
        body["seed"] = rng.randrange(100)
    if not chat:
        if rng.random() < 0.2:
            body["logprobs"] = 2
        return "/v1/completions", {**body, "prompt": text}
    if rng.random() < 0.2:
        body.update(logprobs=True, top_logprobs=2)
    if rng.random() < 0.4:
        body.update(rng.choice(CONSTRAINTS), max_tokens=128)
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


def checkable(choice: dict[str, Any]) -> bool:
    """Whether a chat choice ended where its constraint let it: by EOS or a tool call. A
    stop string the request also gave (vLLM's ``stop_reason`` names it) or the length
    limit cuts the answer short of what the constraint would complete, as it should."""
    return (choice["finish_reason"] in ("stop", "tool_calls")
            and not isinstance(choice.get("stop_reason"), str))


def obeys(body: dict[str, Any], choice: dict[str, Any]) -> bool:
    """Whether a finished chat choice keeps to its request's constraint."""
    message = choice["message"]
    if body.get("tool_choice") == "required":
        return bool(message.get("tool_calls"))
    text = message.get("content") or ""
    if "guided_choice" in body:
        return text in body["guided_choice"]
    if "guided_regex" in body:
        return re.fullmatch(body["guided_regex"], text) is not None
    kind = body.get("response_format", {}).get("type")
    try:
        value = json.loads(text) if kind else None
    except json.JSONDecodeError:
        return False
    if kind == "json_schema":
        return isinstance(value.get("name"), str) and isinstance(value.get("age"), int)
    return kind != "json_object" or isinstance(value, dict)


async def one(client: httpx.AsyncClient, base: str, path: str, body: dict[str, Any],
              cut: bool, tally: Counter) -> None:
    """Send one request, leaving early when ``cut``; count how it went in ``tally``."""
    if body["stream"]:
        async with client.stream("POST", base + path, json=body) as resp:
            tally[resp.status_code // 100 * 100] += 1
            events = 0
            async for _ in resp.aiter_lines():
                events += 1
                if cut and events > 2:
                    tally["cut"] += 1
                    return
        return
    try:
        resp = await client.post(base + path, json=body, timeout=0.3 if cut else None)
    except httpx.TimeoutException:
        tally["cut"] += 1
        return
    tally[resp.status_code // 100 * 100] += 1
    if resp.status_code == 200 and path == "/v1/chat/completions" and any(
            k in body for k in ("response_format", "guided_choice", "guided_regex", "tools")):
        for choice in filter(checkable, resp.json()["choices"]):
            tally["checked"] += 1
            tally["violations"] += not obeys(body, choice)


async def _traffic(base: str, model: str, args: argparse.Namespace) -> Counter:
    rng = random.Random(args.seed)
    jobs = [(*make_request(rng, model, args.long), rng.random() < args.cut)
            for _ in range(args.requests)]
    tally: Counter = Counter()
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def guarded(path: str, body: dict[str, Any], cut: bool) -> None:
            async with gate:
                await one(client, base, path, body, cut, tally)
        await asyncio.gather(*(guarded(*job) for job in jobs))
    return tally


def run(base: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    greedy = {"model": model, "prompt": "The capital of France is", "max_tokens": 12,
              "temperature": 0}

    def answer() -> str:
        return httpx.post(f"{base}/v1/completions", json=greedy,
                          timeout=300).json()["choices"][0]["text"]

    before_text, before = answer(), scrape(base)
    start = time.monotonic()
    tally = asyncio.run(_traffic(base, model, args))
    seconds = time.monotonic() - start
    deadline = time.monotonic() + 120
    while True:   # idle: nothing running or waiting (drops reach workers with a step)
        after = scrape(base)
        busy = (total(after, "vllm:num_requests_running")
                + total(after, "vllm:num_requests_waiting"))
        restored = all(after.get(k) == before.get(k) for k in before if k[0] in RESTORED)
        if (not busy and restored) or time.monotonic() > deadline:
            break
        time.sleep(1)
    checks = {
        "no 5xx": tally[500] == 0,
        "no internal errors": total(after, "llm_cluster_errors_total", kind="internal_error")
        == total(before, "llm_cluster_errors_total", kind="internal_error"),
        "constraints kept": tally["violations"] == 0,
        "tiers restored": restored,
        "idle": busy == 0,
        "no transfer failures": total(after, "llm_cluster_kv_transfer_failures_total")
        == total(before, "llm_cluster_kv_transfer_failures_total"),
        "greedy unchanged": answer() == before_text,
    }
    return {"requests": args.requests, "seconds": round(seconds, 1),
            "responses": {str(k): v for k, v in sorted(tally.items(), key=str)},
            "preemptions": total(after, "vllm:num_preemptions_total")
            - total(before, "vllm:num_preemptions_total"),
            "recomputed tokens": total(after, "llm_cluster_recomputed_tokens_total")
            - total(before, "llm_cluster_recomputed_tokens_total"),
            "checks": checks}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--cut", type=float, default=0.3, help="share of clients that leave early")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--long", action="store_true", help="add 900- and 1,800-word prompts")
    p.add_argument("--config", help="the server's config file (default: the serving default)")
    p.add_argument("--json", help="also write the report to this file")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    with running_server(project_spec(free_port(), args.config), 600) as (base, model):
        report = run(base, model, args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if all(report["checks"].values()) else 1
