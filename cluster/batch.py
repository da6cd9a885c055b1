"""``python -m cluster batch``: offline inference over a file of prompts or requests.

A file of prompts (JSONL or Parquet rows, results to Parquet) is this module's; a file
of OpenAI Batch API requests (JSONL, answers to JSONL) is ``openai_batch``'s. Either
way the job streams the input, keeps a bounded window of requests in the engine at
all times so the workers never run dry between chunks, and flushes finished rows to
part files every few rows or seconds (``batch_store``). A bad row (empty or too long
prompt, malformed messages, invalid sampling values) becomes a row with an ``error``
and no text; the job goes on. Rows whose id is already in the output are skipped, so
running the same command again after an interruption finishes the job without
repeating work, and greedy decoding (the default) gives the same text either way.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.batch_io import SAMPLING_COLUMNS, InputRow, count_rows, input_format, read_rows
from cluster.batch_store import BatchOutputLines, BatchSummary, OutputStore, ResultRow, ResultSink
from cluster.cli import interrupt
from cluster.cluster_client import ClusterClient
from cluster.config import (
    ClusterConfig,
    EngineConfig,
    load_config,
    served_model_name,
    with_default_pools,
)
from cluster.llm import LLM
from cluster.openai_batch import check_requests, run_requests
from cluster.openai_protocol import parse_messages
from cluster.openai_serving import OpenAIServing
from cluster.outputs import RequestOutput
from cluster.tool_calls import chat_prompt
from scheduler.protocol import SamplingParams, StructuredOutputsParams, shown

log = logging.getLogger(__name__)


@dataclass
class BatchOptions:
    input: Path
    output: Path
    sampling: dict[str, Any] = field(default_factory=dict)  # for rows that leave a field out
    window: int = 256          # requests in flight; enough to fill every worker's batch
    flush_rows: int = 256      # finished rows per part file ...
    flush_s: float = 10.0      # ... or fewer, once this many seconds have passed
    progress: bool = True

    @property
    def requests(self) -> bool:
        """Whether the job answers OpenAI Batch API requests (``openai_batch``: a .jsonl
        output) rather than rows of prompts (a .parquet output)."""
        return self.output.suffix.lower() == BatchOutputLines.suffix

    def check(self) -> int:
        """Refuse bad options (and a file of requests with a bad line) before a cluster
        is started for them; returns the number of input rows."""
        if self.window < 1 or self.flush_rows < 1 or self.flush_s <= 0:
            raise ValueError(f"--window {self.window}, --flush-rows {self.flush_rows}, "
                             f"--flush-seconds {self.flush_s}: each must be > 0")
        OutputStore(self.output)
        SamplingParams(**self.sampling)
        if self.requests:
            return check_requests(self.input)
        input_format(self.input)
        return count_rows(self.input)


def batch_config(config: EngineConfig, output: Path) -> EngineConfig:
    """The cluster a batch job runs: the config's pools or 1 prefill + 1 decode worker.
    Left at the default name, the scheduler is named after the output file: jobs on
    other outputs never collide, and a resumed job finds (and replaces) the scheduler
    a killed run of the same job left behind."""
    config = with_default_pools(config)
    if config.cluster.name != ClusterConfig.name:
        return config
    digest = hashlib.sha1(str(output.resolve()).encode()).hexdigest()[:12]
    return dataclasses.replace(
        config, cluster=dataclasses.replace(config.cluster, name=f"batch-{digest}"))


def run_batch(llm: LLM, opts: BatchOptions, total: int | None = None) -> BatchSummary:
    """Run every input row (or request) not yet in the output through ``llm``; merge
    the output. ``total``: what ``opts.check()`` returned, if the caller ran it (a file
    of requests is read whole to check it; once is enough)."""
    if total is None:
        total = opts.check()
    store = OutputStore(opts.output)
    done = store.done_ids()
    window = min(opts.window, llm.config.cluster.max_waiting)
    sink = ResultSink(store, total, opts.flush_rows, opts.flush_s, opts.progress)
    try:
        if opts.requests:
            asyncio.run(run_requests(_serving(llm), opts.input, done, sink, window))
        else:
            _run_rows(llm, opts, done, sink, window)
    finally:
        sink.close()
    return sink.finish()


def _serving(llm: LLM) -> OpenAIServing:
    """The HTTP endpoints' path on ``llm``'s cluster, for a file of requests."""
    engine = llm.engine
    if not isinstance(engine, ClusterClient):
        raise ValueError("a file of OpenAI batch requests runs on a cluster; give the LLM a "
                         "config with cluster.pools (the batch command does)")
    return OpenAIServing(engine, llm.config.serving, served_model_name(llm.config),
                         engine.sampling_defaults)


def _run_rows(llm: LLM, opts: BatchOptions, done: set[str], sink: ResultSink,
              window: int) -> None:
    """Run the rows of prompts, keeping ``window`` requests in the engine."""
    engine = llm.engine
    inflight: dict[str, InputRow] = {}
    taken: set[str] = set()
    rows = read_rows(opts.input)

    def finish(result: ResultRow) -> None:
        sink.add(result, result.error is not None, result.completion_tokens or 0)

    try:
        exhausted = False
        while not exhausted or inflight:
            while not exhausted and len(inflight) < window:
                row = next(rows, None)
                if row is None:
                    exhausted = True
                elif row.id in done:
                    sink.skip()
                elif row.id in taken:
                    log.warning("input row %d: id %r repeats an earlier row; skipped",
                                row.index, row.id)
                    sink.skip(duplicate=True)
                else:
                    taken.add(row.id)
                    request_id = f"batch-{row.index}"
                    error = _submit(llm, request_id, row, opts.sampling)
                    if error is None:
                        inflight[request_id] = row
                    else:
                        finish(ResultRow(row.id, row.index, None, None, None, None, error))
            for out in engine.step() if inflight else []:
                if out.finished:
                    finish(_result(inflight.pop(out.request_id), out))
            sink.tick()
    finally:
        for request_id in inflight:
            engine.abort_request(request_id)


def _submit(llm: LLM, request_id: str, row: InputRow, defaults: dict[str, Any]) -> str | None:
    """Add ``row`` to the engine; returns why it cannot run, if it cannot."""
    engine = llm.engine
    if row.error is not None:
        return row.error
    try:
        params = SamplingParams(**{**defaults, **{k: v for k, v in row.fields.items()
                                                  if k in SAMPLING_COLUMNS and v is not None}},
                                structured_outputs=_structured(row.fields))
        prompt, messages = row.fields.get("prompt"), row.fields.get("messages")
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'messages' (chat) per "
                             f"row; this row has {'both' if prompt is not None else 'neither'}")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt: got {shown(prompt)}; expected text")
        if messages is not None:
            prompt = _chat_text(llm, messages)
        text, token_ids = engine.tokenize_prompt(prompt, add_special_tokens=messages is None)
        engine.add_request(request_id, text, token_ids, params)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _structured(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    spec = fields.get("structured_outputs")
    if spec is None:
        return None
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs: not valid JSON ({e})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs: got {spec!r:.100}; expected an object such as "
                         '{"json": {...schema...}} or {"regex": "..."}')
    try:
        return StructuredOutputsParams(**spec)
    except TypeError:
        raise ValueError(f"structured_outputs: got fields {sorted(spec)}; allowed: json, "
                         "regex, choice, grammar, json_object") from None


def _chat_text(llm: LLM, messages: Any) -> str:
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it has no chat template; give "
                         "'prompt' instead of 'messages'")
    return chat_prompt(tokenizer, parse_messages(messages), None, llm.tool_call_parser)


def _result(row: InputRow, out: RequestOutput) -> ResultRow:
    completion = out.outputs[0]
    return ResultRow(row.id, row.index, completion.text, completion.finish_reason,
                     len(out.prompt_token_ids), len(completion.token_ids), None)


# ---- the command -----------------------------------------------------------------------
def options_from_args(args: argparse.Namespace) -> BatchOptions:
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
                "stop": args.stop or []}
    return BatchOptions(Path(args.input), Path(args.output), sampling, args.window,
                        args.flush_rows, args.flush_seconds, not args.no_progress)


def main(args: argparse.Namespace) -> int:
    """``python -m cluster batch``: 0 when every row is in the output (some perhaps with
    an error), 130 when interrupted (run the same command again to resume)."""
    opts = options_from_args(args)
    total = opts.check()
    llm = None
    previous = signal.getsignal(signal.SIGTERM)
    try:
        llm = LLM(args.model, config=batch_config(load_config(args.config), opts.output))
        # `ray job stop` sends SIGTERM. Set after ray.init, whose own handler would
        # otherwise replace this one and kill the driver before it stops its actors.
        signal.signal(signal.SIGTERM, interrupt)
        summary = run_batch(llm, opts, total)
    except KeyboardInterrupt:
        print(f"batch: interrupted; finished rows are kept in {opts.output}.parts/, run the "
              "same command again to resume", file=sys.stderr)
        return 130
    finally:
        if llm is not None:
            llm.shutdown()
        signal.signal(signal.SIGTERM, previous)
    print(summary.line(opts.output), file=sys.stderr)
    return 0
