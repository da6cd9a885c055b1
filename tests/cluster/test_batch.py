"""The batch job: JSONL and Parquet in, Parquet out, per-row errors, resume.

The oracle is ``LLM.generate`` / ``LLM.chat`` on the same prompts (greedy): the batch
job must write exactly their text, each input row exactly once, however often it is
interrupted. The one-process engine on the default model carries these tests;
``test_batch_ray_job.py`` runs the command the way users do, as a ``ray job submit``
against a ``ray start --head`` node of its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster import LLM, SamplingParams
from cluster.batch import BatchOptions, batch_config, run_batch
from cluster.config import config_from_dict

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
