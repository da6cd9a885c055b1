"""The batch job: JSONL and Parquet in, Parquet out, per-row errors, resume.

The oracle is ``LLM.generate`` / ``LLM.chat`` on the same prompts (greedy): the batch
job must write exactly their text, each input row exactly once, however often it is
interrupted. The one-process engine on the default model carries the local tests;
``test_ray_job_interrupted_and_resumed`` runs the command the way users do, as a
``ray job submit`` against a ``ray start --head`` node of its own.
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
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster import LLM, SamplingParams
from cluster.batch import BatchOptions, batch_config, run_batch
from cluster.batch_store import OutputStore
from cluster.config import config_from_dict, served_model_name

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "The sky is",
           "Water boils at"]
QUESTION = "Name a planet."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", kv_cache_bytes=128 << 20, max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def oracle(llm) -> dict[str, str]:
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    texts = {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, greedy))}
    texts[QUESTION] = llm.chat([{"role": "user", "content": QUESTION}], greedy)[0] \
        .outputs[0].text
    return texts


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict[str, Any]]:
    return sorted(pq.read_table(path).to_pylist(), key=lambda r: r["row"])


def _run(llm: LLM, src: Path, out: Path, **kw: Any):
    return run_batch(llm, BatchOptions(src, out, {"max_tokens": MAX_TOKENS,
                                                   "temperature": 0.0}, progress=False, **kw))


def test_jsonl_rows_equal_generate_and_chat(llm, oracle, tmp_path):
    rows = [{"prompt": p} for p in PROMPTS]
    rows.insert(2, {"messages": [{"role": "user", "content": QUESTION}], "id": "chat"})
    out = tmp_path / "out.parquet"
    summary = _run(llm, _write_jsonl(tmp_path / "in.jsonl", rows), out, window=3)
    got = _read(out)
    assert [r["id"] for r in got] == ["0", "1", "chat", "3", "4", "5"]
    expected = [oracle[r.get("prompt", QUESTION)] for r in rows]
    assert [r["text"] for r in got] == expected
    assert all(r["error"] is None and r["finish_reason"] == "length" for r in got)
    assert all(r["completion_tokens"] == MAX_TOKENS and r["prompt_tokens"] > 0 for r in got)
    assert (summary.rows, summary.new, summary.errors) == (6, 6, 0)
    assert summary.completion_tokens == 6 * MAX_TOKENS
    assert not (tmp_path / "out.parquet.parts").exists()


def test_a_conversation_with_calls_is_rendered_as_the_chat_endpoint_renders_it(llm, tmp_path):
    """SmolLM2's template renders no tool calls: an earlier call reaches it as the text
    the model writes (Hermes tags), here as in ``LLM.chat`` and the chat endpoint."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = tmp_path / "out.parquet"
    _run(llm, _write_jsonl(tmp_path / "in.jsonl", [{"id": "c", "messages": history}]), out)
    (row,) = _read(out)
    chat = llm.chat(history, SamplingParams(temperature=0.0, max_tokens=1))[0]
    text = llm.get_tokenizer().decode(chat.prompt_token_ids, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call>' in text
    assert row["error"] is None and row["prompt_tokens"] == len(chat.prompt_token_ids)


def test_parquet_input_with_bad_rows_records_errors_and_goes_on(llm, oracle, tmp_path):
    rows = [
        {"id": "a", "prompt": PROMPTS[0], "messages": None, "temperature": None},
        {"id": "empty", "prompt": "", "messages": None, "temperature": None},
        {"id": "hot", "prompt": "x", "messages": None, "temperature": -1.0},
        {"id": "long", "prompt": "hello " * 400, "messages": None, "temperature": None},
        {"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "y"}],
         "temperature": None},
        {"id": "neither", "prompt": None, "messages": None, "temperature": None},
        {"id": "nocontent", "prompt": None, "messages": [{"role": "user", "content": None}],
         "temperature": None},
        {"id": "a", "prompt": PROMPTS[1], "messages": None, "temperature": None},
        {"id": "b", "prompt": PROMPTS[3], "messages": None, "temperature": 0.0},
    ]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "out.parquet"
    summary = _run(llm, src, out)
    got = {r["id"]: r for r in _read(out)}
    assert sorted(got) == ["a", "b", "both", "empty", "hot", "long", "neither", "nocontent"]
    assert got["a"]["text"] == oracle[PROMPTS[0]] and got["b"]["text"] == oracle[PROMPTS[3]]
    errors = {k: r["error"] for k, r in got.items() if r["error"] is not None}
    assert "prompt is empty" in errors["empty"]
    assert "temperature: got -1.0" in errors["hot"]
    assert "max_model_len is 256" in errors["long"]
    assert "this row has both" in errors["both"] and "this row has neither" in errors["neither"]
    assert errors["nocontent"].startswith("messages.0: role 'user' needs content")
    assert all(got[k]["text"] is None and got[k]["completion_tokens"] is None for k in errors)
    assert (summary.new, summary.errors, summary.duplicates) == (8, 6, 1)


def test_malformed_jsonl_lines_are_row_errors(llm, oracle, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(f'{{"prompt": "{PROMPTS[0]}"}}\n\n{{"prompt": \n[1, 2]\n'
                   f'{{"prompt": "{PROMPTS[1]}", "id": 7, "seed": "x"}}\n{{"prompt": 5}}\n')
    out = tmp_path / "out.parquet"
    _run(llm, src, out)
    got = _read(out)
    assert [r["id"] for r in got] == ["0", "1", "2", "7", "4"]
    assert got[0]["text"] == oracle[PROMPTS[0]]
    assert "line 3 is not valid JSON" in got[1]["error"]
    assert "line 4 is a JSON list; expected an object" in got[2]["error"]
    assert "seed: got 'x'" in got[3]["error"]
    assert "prompt: got 5; expected text" in got[4]["error"]


@pytest.mark.parametrize("args, message", [
    (["--input", "in.csv"], "unknown format '.csv'"),
    (["--input", "missing.jsonl"], "'missing.jsonl' does not exist"),
    (["--output", "out.csv"], "expected a path ending in .parquet"),
    (["--window", "0"], "--window 0"),
    (["--temperature", "-1"], "temperature: got -1.0"),
])
def test_bad_options_fail_before_a_cluster_starts(tmp_path, monkeypatch, capsys, args,
                                                   message):
    from cluster.cli import main

    monkeypatch.chdir(tmp_path)
    _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    (tmp_path / "in.csv").write_text("prompt\nhi\n")
    defaults = {"--input": "in.jsonl", "--output": "out.parquet"}
    given = dict(zip(args[::2], args[1::2]))
    argv = [x for k, v in {**defaults, **given}.items() for x in (k, v)]
    assert main(["batch", *argv]) == 2
    assert message in capsys.readouterr().err


def test_resume_after_an_interruption_writes_each_row_once(llm, oracle, tmp_path,
                                                           monkeypatch):
    rows = [{"prompt": PROMPTS[i % len(PROMPTS)], "id": f"r{i}"} for i in range(12)]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.parts"
    step = llm.engine.step
    seen: list[int] = []

    def interrupted_step():
        outputs = step()
        seen.extend(1 for o in outputs if o.finished)
        if len(seen) >= 5:
            raise KeyboardInterrupt
        return outputs

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        _run(llm, src, out, window=2, flush_rows=2)
    monkeypatch.undo()
    assert not out.exists()   # only flushed parts; the output appears whole or not at all
    flushed = pq.read_table(sorted(parts.glob("*.parquet"))).column("id").to_pylist()
    assert 0 < len(flushed) == len(set(flushed)) < 12
    assert not llm.engine.has_unfinished()   # the interrupted requests were aborted
    first_part = sorted(parts.glob("*.parquet"))[0].read_bytes()

    summary = _run(llm, src, out, window=4)
    assert (summary.skipped, summary.new) == (len(flushed), 12 - len(flushed))
    got = _read(out)
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    assert [r["text"] for r in got] == [oracle[r["prompt"]] for r in rows]

    # A run killed between the final rename and removing the parts left a part whose
    # rows are already in the output: the next run skips everything and merges once.
    parts.mkdir()
    (parts / "part-000000.parquet").write_bytes(first_part)
    summary = _run(llm, src, out)
    assert (summary.skipped, summary.new, summary.rows) == (12, 0, 12)
    assert _read(out) == got


def test_a_foreign_output_file_is_refused(llm, tmp_path):
    out = tmp_path / "out.parquet"
    pq.write_table(pa.table({"x": [1]}), out)
    src = _write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ValueError, match="exists but is not a batch result"):
        _run(llm, src, out)


def test_batch_config_names_the_scheduler_after_the_output(tmp_path):
    config = batch_config(config_from_dict({}), tmp_path / "a.parquet")
    assert [p.role for p in config.cluster.pools] == ["prefill", "decode"]
    assert config.cluster.name.startswith("batch-")
    assert config.cluster.name != batch_config(config_from_dict({}),
                                               tmp_path / "b.parquet").cluster.name
    named = config_from_dict({"cluster": {"name": "mine"}})
    assert batch_config(named, tmp_path / "a.parquet").cluster.name == "mine"


# ---- ray start --head + ray job submit ---------------------------------------------------
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


def test_structured_outputs_column_constrains_each_row(llm, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    rows = [{"id": "choice", "prompt": "Is water wet?", "structured_outputs":
             {"choice": ["yes", "no"]}},
            {"id": "regex", "prompt": "Year:", "structured_outputs": {"regex": "19[0-9]{2}"}},
            {"id": "json", "prompt": "JSON:", "max_tokens": 24,
             "structured_outputs": json.dumps({"json": schema})},
            {"id": "bad", "prompt": "x", "structured_outputs": {"regex": "a(b"}}]
    out = tmp_path / "out.parquet"
    _run(llm, _write_jsonl(tmp_path / "in.jsonl", rows), out)
    got = {r["id"]: r for r in _read(out)}
    assert got["choice"]["text"] in ("yes", "no")
    assert re.fullmatch("19[0-9]{2}", got["regex"]["text"])
    assert json.loads(got["json"]["text"]) in ({"ok": True}, {"ok": False})
    assert "structured_outputs.regex" in got["bad"]["error"]
