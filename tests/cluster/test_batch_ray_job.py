"""``python -m cluster batch`` run the way users run it on a cluster: ``ray job submit``
against a ``ray start --head`` node of this module's own, stopped with ``ray job stop``
midway and submitted again. Both inputs, a file of prompts (Parquet out) and a file of
OpenAI batch requests (JSONL out), must end with each row once, and no actor left.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cluster.batch_store import OutputStore
from cluster.config import config_from_dict, served_model_name
from tests.cluster.test_batch import _write_jsonl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
JOB_ROWS = 100


@dataclass
class Head:
    address: str            # the dashboard's, for `ray job`
    env: dict[str, str]


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except ProcessLookupError:
                pass
    return pids


@pytest.fixture(scope="module")
def ray_head(free_ports) -> Iterator[Head]:
    """A head node of our own (own ports, temp dir and session), apart from the test
    session's Ray instance, shared by the module's jobs (each checks that it leaves no
    actor behind); stopped by killing exactly its processes, never `ray stop`."""
    temp_dir = tempfile.mkdtemp(prefix="rb-", dir="/tmp")   # short: socket paths
    gcs, dash, listen, grpc, metrics, env_agent, node, objects, client = free_ports(9)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")
           and k != "PYTHONPATH"}   # the job must import the uploaded working dir
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # What `ray start --head` turns on; the head refuses to start without a token, and a
    # fresh machine has no ~/.ray/auth_token, so the head and its clients share our own.
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    log_path = Path(temp_dir) / "ray-start.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", f"--temp-dir={temp_dir}", f"--port={gcs}",
             "--num-cpus=2", "--object-store-memory=200000000", "--include-dashboard=true",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
             f"--dashboard-agent-listen-port={listen}", f"--dashboard-agent-grpc-port={grpc}",
             f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
             f"--node-manager-port={node}", f"--object-manager-port={objects}",
             f"--ray-client-server-port={client}", "--disable-usage-stats"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    head = Head(address, {**env, "RAY_ADDRESS": address})
    try:
        deadline = time.monotonic() + 240
        while subprocess.run([RAY, "job", "list"], env=head.env, capture_output=True,
                             timeout=120).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head failed: {log_path.read_text()}")
            time.sleep(2)
        yield head
    finally:
        with contextlib.suppress(ProcessLookupError):   # a head that failed to start is gone
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        deadline = time.monotonic() + 30
        while (left := _session_pids(proc.pid)) and time.monotonic() < deadline:
            time.sleep(1)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _job(head: Head, *args: str) -> str:
    """``ray job ARGS`` run from the repository root, as a user would; its output."""
    done = subprocess.run([RAY, "job", *args], cwd=REPO, env=head.env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _status(head: Head, job_id: str) -> str:
    out = re.sub(r"\x1b\[[0-9;]*m", "", _job(head, "status", job_id))
    for status, words in (("SUCCEEDED", "succeeded"), ("STOPPED", "was stopped"),
                          ("FAILED", "failed")):
        if f"Job '{job_id}' {words}" in out:
            return status
    match = re.search(r"Status for job '[^']+': (\w+)", out)
    assert match is not None, out
    return match.group(1)


def _live_actors(head: Head) -> list[str]:
    """The classes of the head's live actors (``ray list actors``)."""
    done = subprocess.run([RAY, "list", "actors", "-f", "state=ALIVE", "--format", "json"],
                          env=head.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip()
    return [a["class_name"] for a in json.loads(out)] if out.startswith("[") else []


def _job_input(tmp_path: Path, fmt: str) -> tuple[Path, Path]:
    """JOB_ROWS prompts of 12 tokens each, EOS ignored, as rows of prompts (Parquet out)
    or as OpenAI batch requests (JSONL out); the input and output paths."""
    prompts = [f"Item {i}: the number {i} is" for i in range(JOB_ROWS)]
    if fmt == "rows":
        rows = [{"prompt": p, "ignore_eos": True} for p in prompts]
        return _write_jsonl(tmp_path / "prompts.jsonl", rows), tmp_path / "results.parquet"
    model = served_model_name(config_from_dict({}))
    lines = [{"custom_id": str(i), "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": p, "max_tokens": 12, "ignore_eos": True}}
             for i, p in enumerate(prompts)]
    return _write_jsonl(tmp_path / "requests.jsonl", lines), tmp_path / "answers.jsonl"


def _job_output(out: Path) -> dict[str, int]:
    """Each output row's id and its completion tokens (None for an error)."""
    if out.suffix == ".parquet":
        rows = pq.read_table(out).to_pylist()
        got = {r["id"]: None if r["error"] else r["completion_tokens"] for r in rows}
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        got = {a["custom_id"]: a["response"]["body"]["usage"]["completion_tokens"]
               if a["response"]["status_code"] == 200 else None for a in rows}
    assert len(got) == len(rows)   # each id once
    return got


@pytest.mark.parametrize("fmt", ["rows", "requests"])
def test_ray_job_interrupted_and_resumed_holds_each_row_once(ray_head, tmp_path, fmt):
    # 12 tokens a row, EOS ignored: the job runs for about 20 s, so `ray job stop`
    # (a CLI that takes seconds to start) still finds it running after the first flush.
    src, out = _job_input(tmp_path, fmt)
    parts = out.with_name(out.name + ".parts")
    command = ["--working-dir", ".", "--", "python", "-m", "cluster", "batch",
               "--input", str(src), "--output", str(out), "--max-tokens", "12",
               "--window", "8", "--flush-rows", "5", "--no-progress"]
    first, resume = f"batch-first-{fmt}", f"batch-resume-{fmt}"

    _job(ray_head, "submit", "--submission-id", first, "--no-wait", *command)
    deadline = last_check = time.monotonic()
    deadline += 600
    while not any(parts.glob(f"*{out.suffix}")):   # interrupt once some rows are flushed
        if time.monotonic() - last_check > 10:
            last_check = time.monotonic()
            assert _status(ray_head, first) in ("PENDING", "RUNNING"), \
                _job(ray_head, "logs", first)
        assert time.monotonic() < deadline, _job(ray_head, "logs", first)
        time.sleep(0.2)
    _job(ray_head, "stop", first)
    assert _status(ray_head, first) == "STOPPED"
    assert "batch: interrupted" in _job(ray_head, "logs", first)   # SIGTERM handled
    assert not {"GlobalScheduler", "Worker"} & set(_live_actors(ray_head))
    assert not out.exists()
    flushed = OutputStore(out).done_ids()
    assert 0 < len(flushed) < JOB_ROWS

    logs = _job(ray_head, "submit", "--submission-id", resume, *command)
    assert _status(ray_head, resume) == "SUCCEEDED", logs
    assert f"{JOB_ROWS - len(flushed)} new, 0 errors, {len(flushed)} already done" in logs
    assert _job_output(out) == {str(i): 12 for i in range(JOB_ROWS)}
    assert not parts.exists()
    assert not {"GlobalScheduler", "Worker"} & set(_live_actors(ray_head))
