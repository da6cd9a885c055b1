"""``python -m cluster bench batch-files``: a file of OpenAI batch requests against the same
prompts as rows, on one cluster.

The batch job takes two inputs: rows of prompts (run by the engine's step loop) and OpenAI
Batch API requests (each body through the HTTP endpoints' path, ``OpenAIServing``, on the
cluster client's streams). This runs Workload A's prompts (decoded to text; each
request's output length fixed, EOS ignored) through both, interleaved (rows, requests,
rows, ...) on the one cluster ``batch`` starts, prefix caching off so every run does the
same work. Reports each run's output tokens/s, the requests/rows ratio of the medians,
and whether the two gave every prompt the same greedy text.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from benchmarks.workloads import QUICK, WORKLOAD_A, generate
from cluster.batch import BatchOptions, batch_config, run_batch
from cluster.config import load_config, served_model_name, with_overrides
from cluster.llm import LLM

VOCAB = 49152  # the default model's


def _inputs(folder: Path, prompts: list[str], max_tokens: list[int],
            model: str) -> tuple[Path, Path]:
    rows = folder / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "prompt": p, "max_tokens": m,
                                        "ignore_eos": True}) + "\n"
                            for i, (p, m) in enumerate(zip(prompts, max_tokens))))
    requests = folder / "requests.jsonl"
    requests.write_text("".join(json.dumps({
        "custom_id": str(i), "method": "POST", "url": "/v1/completions",
        "body": {"model": model, "prompt": p, "max_tokens": m, "ignore_eos": True,
                 "temperature": 0}}) + "\n" for i, (p, m) in enumerate(zip(prompts, max_tokens))))
    return rows, requests


def _texts(out: Path) -> dict[str, str]:
    if out.suffix == ".parquet":
        return {r["id"]: r["text"] for r in pq.read_table(out).to_pylist()}
    return {a["custom_id"]: a["response"]["body"]["choices"][0]["text"]
            for a in map(json.loads, out.read_text().splitlines())}


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m cluster bench batch-files") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=128, help="requests (default: 128)")
    p.add_argument("--rounds", type=int, default=2, help="rows+requests pairs (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--quick", action="store_true", help="smoke-test sizes")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    work = generate(QUICK["A"] if args.quick else WORKLOAD_A, args.num_requests, args.seed,
                    VOCAB)
    folder = Path(tempfile.mkdtemp(prefix="bench-batch-files-"))
    config = with_overrides(load_config(None), {("cache", "enable_prefix_caching"): False})
    llm = LLM(config=batch_config(config, folder / "bench"))
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.decode(ids) for ids in work.prompts]
        inputs = dict(zip(("rows", "requests"),
                          _inputs(folder, prompts, work.max_tokens,
                                  served_model_name(llm.config))))
        runs: dict[str, list[float]] = {"rows": [], "requests": []}
        texts: dict[str, dict[str, str]] = {}
        for r in range(args.rounds):
            for label, src in inputs.items():
                out = folder / f"{label}-{r}{'.parquet' if label == 'rows' else '.jsonl'}"
                s = run_batch(llm, BatchOptions(src, out, {"temperature": 0.0}, window=256,
                                                progress=False))
                runs[label].append(s.completion_tokens / s.seconds)
                texts[label] = _texts(out)
                print(f"round {r + 1} {label}: {s.new} rows, {s.errors} errors, "
                      f"{s.completion_tokens} tokens in {s.seconds:.1f} s, "
                      f"{runs[label][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        llm.shutdown()
    rows, requests = statistics.median(runs["rows"]), statistics.median(runs["requests"])
    same = texts["rows"] == texts["requests"]
    print(f"Workload A, {args.num_requests} requests, {args.rounds} rounds: rows {rows:.1f} "
          f"tok/s, OpenAI batch requests {requests:.1f} tok/s (medians); requests/rows "
          f"{requests / rows:.3f}; the same greedy text for every prompt: {same}")
    if args.out:
        report: dict[str, Any] = {"runs": runs, "ratio": requests / rows, "same_text": same,
                                  "num_requests": args.num_requests}
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
