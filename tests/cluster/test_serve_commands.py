"""The two ways to start the server, as a user types them: ``python -m cluster serve``
and ``serve run configs/serve.yaml``. Each starts its own local Ray instance in a
subprocess, answers a chat completion over HTTP on 127.0.0.1, and stops on SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.server_process import popen_stoppable_by_sigint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
_START_TIMEOUT_S = 300.0


def _serve_run(tmp_path: Path, port: int) -> list[str]:
    """``serve run`` of the repository's configs/serve.yaml, on a free port."""
    data = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    data["http_options"]["port"] = port
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    return [str(Path(sys.executable).parent / "serve"), "run", str(path)]


def _log(tmp_path: Path) -> str:
    return (tmp_path / "server.log").read_text(errors="replace")


def _cluster_serve(_: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "cluster", "serve", "--port", str(port)]


@pytest.mark.parametrize("command", [_cluster_serve, _serve_run],
                         ids=["python -m cluster serve", "serve run configs/serve.yaml"])
def test_the_server_starts_answers_and_stops(command, tmp_path, free_ports):
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = (tmp_path / "server.log").open("w")
    proc = popen_stoppable_by_sigint(command(tmp_path, port), cwd=ROOT, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            assert proc.poll() is None, _log(tmp_path)[-3000:]
            assert time.monotonic() < deadline, "the server did not become healthy"
            try:
                healthy = httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                healthy = False
            # `cluster serve` announces itself once serve.run returns, which can come a
            # moment after the router first answers
            if healthy and (command is not _cluster_serve or "Serving" in _log(tmp_path)):
                break
            time.sleep(1)
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert resp.status_code == 200, resp.text
        assert "Paris" in resp.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        log.close()
    assert code in (0, -signal.SIGINT, 130), _log(tmp_path)[-3000:]
    if command is _cluster_serve:
        assert f"Serving SmolLM2-135M-Instruct at {url}/v1" in _log(tmp_path)


def test_a_cell_that_cannot_start_says_why_and_exits(tmp_path, free_ports):
    """A failure inside the cell (here: a host KV tier too small for max_model_len, known
    only once the model's shape is) ends ``cluster serve`` with that reason, not only
    Serve's "Failed to update the deployments"."""
    (port,) = free_ports(1)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "scheduler": {"max_model_len": 4096},
        "long_context": {"enabled": True, "initial_tokens": 64, "local_tokens": 256,
                         "dense_boundary": 512, "offload_boundary": 1024,
                         "retrieval_block_size": 32, "host_kv_bytes": 30_000_000}}))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"] = "1"   # Serve's default 3: ~10 s a retry
    done = subprocess.run([sys.executable, "-m", "cluster", "serve", "--config", str(config),
                           "--port", str(port)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=_START_TIMEOUT_S)
    assert done.returncode == 2, done.stderr[-3000:]
    assert ("error: the server did not start: LLMCell: max_model_len: got 4096, but the host "
            "KV tier holds the middle of at most") in done.stderr, done.stderr[-3000:]
    assert "raise long_context.host_kv_bytes or lower max_model_len" in done.stderr
