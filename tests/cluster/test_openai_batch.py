"""OpenAI Batch API files through ``python -m cluster batch`` (what ``vllm run-batch`` runs).

The file checks and the JSONL result store run without a cluster. The job itself runs
on a 1 prefill + 1 decode cluster of the default model; its oracle is the one-process
engine (``LLM.chat`` / ``LLM.generate``, greedy) on the same prompts, and the answers
must parse as the ``openai`` package's response types.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from cluster import LLM, SamplingParams, openai_batch
from cluster.batch import BatchOptions, run_batch
from cluster.batch_store import OutputStore
from cluster.config import config_from_dict, served_model_name

KV_BYTES = 64 << 20
MAX_TOKENS = 8
QUESTIONS = ["What is the capital of France?", "Name a planet.", "List three colors.",
             "Hi!", "What is 2 + 2?", "Say something kind."]
PROMPT = "The capital of France is"
MODEL = served_model_name(config_from_dict({}))


def _line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions",
          **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}


def _chat(question: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines))
    return path


def _answers(path: Path) -> dict[str, dict[str, Any]]:
    answers = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {a["custom_id"]: a for a in answers}
    assert len(by_id) == len(answers)   # each request answered once
    return by_id


# ---- the file, without a cluster ---------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    ("{not json", "line 2: not valid JSON"),
    ({"prompt": "hi"}, "line 2: expected a batch request"),
    (_line("x", {}, extra_field=1), "line 2: fields ['extra_field'] are not"),
    ({"custom_id": "x", "url": "/v1/responses", "body": {}},
     "line 2: fields ['method'] are missing"),
    (_line("", {}), "line 2: custom_id: got ''"),
    (_line(7, {}), "line 2: custom_id: got 7"),
    ({**_line("x", {}), "method": "GET"}, "line 2: method: got 'GET'; expected 'POST'"),
    (_line("x", {}, url="/v1/embeddings"), "line 2: url: got '/v1/embeddings'"),
    (_line("x", ["hi"]), "line 2: body: got a JSON list"),
    (_line("a", {}), "the custom_id 'a' appears twice"),
])
def test_a_file_that_is_not_requests_is_refused_whole_naming_the_line(tmp_path, bad,
                                                                      message):
    path = _write(tmp_path / "in.jsonl", [_line("a", {}), bad])
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("+", r"\+")):
        openai_batch.check_requests(path)


def test_a_good_file_counts_its_requests_and_blank_lines_are_skipped(tmp_path):
    path = _write(tmp_path / "in.jsonl", [_line("a", {}), "", _line("b", {}, "/v1/completions")])
    assert openai_batch.check_requests(path) == 2
    assert [(r.custom_id, r.url) for r in openai_batch.read_requests(path)] == \
        [("a", "/v1/chat/completions"), ("b", "/v1/completions")]


def test_bad_files_fail_the_command_before_a_cluster_starts(tmp_path, monkeypatch, capsys):
    from cluster.cli import main

    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "rows.jsonl", [{"prompt": "hi"}])
    assert main(["batch", "-i", "rows.jsonl", "-o", "out.jsonl"]) == 2
    assert "line 1: expected a batch request" in capsys.readouterr().err
    _write(tmp_path / "in.jsonl", [_line("a", {})])
    assert main(["batch", "--input-file", "in.parquet", "--output-file", "out.jsonl"]) == 2
    assert "the input is an existing .jsonl file" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_jsonl_store_merges_parts_once_per_custom_id_and_refuses_foreign_files(tmp_path):
    out = tmp_path / "out.jsonl"
    store = OutputStore(out)
    assert store.done_ids() == set()
    store.write_part([{"custom_id": "a", "n": 1}, {"custom_id": "b", "n": 2}])
    store.write_part([{"custom_id": "c", "n": 3}])
    assert not out.exists()
    # A new store (a resumed run) finds the flushed parts' ids.
    again = OutputStore(out)
    assert again.done_ids() == {"a", "b", "c"}
    again.write_part([{"custom_id": "b", "n": 99}, {"custom_id": "d", "n": 4}])
    assert again.merge() == 4
    assert [json.loads(x) for x in out.read_text().splitlines()] == \
        [{"custom_id": k, "n": n} for k, n in [("a", 1), ("b", 2), ("c", 3), ("d", 4)]]
    assert not (tmp_path / "out.jsonl.parts").exists()
    assert OutputStore(out).merge() == 4   # nothing new: the output stays
    (tmp_path / "other.jsonl").write_text('{"text": "mine"}\n')
    with pytest.raises(ValueError, match="line 1 is not an object with a custom_id"):
        OutputStore(tmp_path / "other.jsonl").done_ids()


# ---- the job on a cluster ----------------------------------------------------------------
@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    llm = LLM(kv_cache_bytes=KV_BYTES)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chats = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], greedy)
    texts: dict[str, Any] = {q: (o.outputs[0].text, len(o.prompt_token_ids))
                             for q, o in zip(QUESTIONS, chats)}
    (out,) = llm.generate([PROMPT], greedy)
    texts[PROMPT] = (out.outputs[0].text, len(out.prompt_token_ids))
    return texts


@pytest.fixture(scope="module")
def cluster_llm(ray_instance):
    config = config_from_dict({
        "cache": {"kv_cache_bytes": KV_BYTES},
        "cluster": {"name": "openai-batch", "pools": [
            {"role": "prefill", "resources": {"CPU": 0.5}},
            {"role": "decode", "resources": {"CPU": 0.5}}]}})
    llm = LLM(config=config)
    yield llm
    llm.shutdown()


def _run(llm: LLM, src: Path, out: Path, **kw: Any):
    return run_batch(llm, BatchOptions(src, out, progress=False, **kw))


@pytest.mark.slow
def test_each_request_is_answered_as_the_endpoint_answers_it(cluster_llm, oracle, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    lines = [
        _line("chat", _chat(QUESTIONS[0])),
        _line("cmpl", {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "n": 2, "logprobs": 1}, "/v1/completions"),
        _line("tool", _chat("What is the weather in Paris?", max_tokens=48, tools=[weather],
                            tool_choice={"type": "function",
                                         "function": {"name": "get_weather"}})),
        _line("resp", {"model": MODEL, "input": QUESTIONS[0], "max_output_tokens": MAX_TOKENS,
                       "temperature": 0}, "/v1/responses"),
        _line("hot", _chat("hi", temperature=-1)),
        _line("model", {**_chat("hi"), "model": "gpt-4o-mini"}),
        _line("stream", _chat("hi", stream=True)),
        _line("unknown", _chat("hi", frobnicate=1)),
    ]
    out = tmp_path / "out.jsonl"
    summary = _run(cluster_llm, _write(tmp_path / "in.jsonl", lines), out, window=4)
    got = _answers(out)
    assert (summary.rows, summary.new, summary.errors) == (8, 8, 4)
    assert all(a["id"].startswith("batch_req_") and a["error"] is None for a in got.values())

    chat = got["chat"]["response"]
    assert chat["status_code"] == 200 and chat["request_id"] == chat["body"]["id"]
    body = ChatCompletion.model_validate(chat["body"])
    text, prompt_tokens = oracle[QUESTIONS[0]]
    assert body.choices[0].message.content == text
    assert (body.usage.prompt_tokens, body.usage.completion_tokens) == \
        (prompt_tokens, MAX_TOKENS)

    cmpl = Completion.model_validate(got["cmpl"]["response"]["body"])
    assert [c.text for c in cmpl.choices] == [oracle[PROMPT][0]] * 2
    assert all(len(c.logprobs.tokens) == MAX_TOKENS for c in cmpl.choices)
    assert cmpl.usage.completion_tokens == 2 * MAX_TOKENS

    response = Response.model_validate(got["resp"]["response"]["body"])
    assert (response.output_text, response.usage.input_tokens) == oracle[QUESTIONS[0]]

    (call,) = ChatCompletion.model_validate(got["tool"]["response"]["body"]) \
        .choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)

    refusals = {k: (got[k]["response"]["status_code"],
                    got[k]["response"]["body"]["error"]["param"])
                for k in ("hot", "model", "stream", "unknown")}
    assert refusals == {"hot": (400, "temperature"), "model": (404, "model"),
                        "stream": (400, "stream"), "unknown": (400, "frobnicate")}
    assert summary.completion_tokens == body.usage.completion_tokens + \
        cmpl.usage.completion_tokens + response.usage.output_tokens + \
        ChatCompletion.model_validate(got["tool"]["response"]["body"]).usage.completion_tokens


@pytest.mark.slow
def test_an_interrupted_job_resumed_answers_each_request_once(cluster_llm, oracle, tmp_path,
                                                              monkeypatch):
    lines = [_line(f"q{i}", _chat(q)) for i, q in enumerate(QUESTIONS)]
    src = _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    answer, finished = openai_batch.answer, []

    async def interrupted(endpoint, req):
        got = await answer(endpoint, req)
        finished.append(req.custom_id)
        if len(finished) == 3:
            raise KeyboardInterrupt
        return got

    monkeypatch.setattr(openai_batch, "answer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(cluster_llm, src, out, window=2, flush_rows=1)
    monkeypatch.undo()
    assert not out.exists()   # only flushed parts; the output appears whole or not at all
    flushed = OutputStore(out).done_ids()
    assert 0 < len(flushed) < len(QUESTIONS)
    deadline = time.monotonic() + 60   # the requests in flight were aborted
    while cluster_llm.engine.stats().num_requests and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster_llm.engine.stats().num_requests == 0

    summary = _run(cluster_llm, src, out, window=3)
    assert (summary.skipped, summary.new, summary.rows) == \
        (len(flushed), len(QUESTIONS) - len(flushed), len(QUESTIONS))
    got = _answers(out)
    assert {k: a["response"]["body"]["choices"][0]["message"]["content"]
            for k, a in got.items()} == \
        {f"q{i}": oracle[q][0] for i, q in enumerate(QUESTIONS)}
