"""``python -m cluster`` (also the ``llm-cluster`` console script)."""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from collections.abc import Sequence

from cluster.config import ConfigError
from cluster.vllm_args import add_config_flags


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="YAML configuration (default: the embedded SmolLM2-135M-Instruct on CPU)")
    p.add_argument("--model", metavar="PATH",
                   help="HF checkpoint directory or .gguf file; overrides the config's model.path")
    p.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    """The sampling options every generating command takes (a request's, or a row's
    default)."""
    p.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")


def _cmd_generate(args: argparse.Namespace) -> int:
    from cluster.llm import LLM
    from scheduler.protocol import SamplingParams

    llm = LLM(args.model, config=args.config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    try:
        if args.raw:
            out = llm.generate(args.prompt, params)[0]
        else:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    finally:
        llm.shutdown()   # a cluster config's scheduler actor is detached
    print(out.outputs[0].text.strip())
    return 0


def interrupt(signum: int, _frame: object) -> None:
    """A SIGTERM handler: stop as on Ctrl-C, so the same cleanup runs."""
    raise KeyboardInterrupt(f"signal {signum}")


def curl_example(url: str, model_name: str) -> str:
    """The request ``serve`` prints for users to try first."""
    return (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"""-d '{{"model": "{model_name}", "max_tokens": 64, "messages": [{{"role": """
            f""""user", "content": "What is the capital of France?"}}]}}'""")


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import time

    import ray
    from ray import serve

    from cluster.config import (
        load_config,
        sampling_defaults,
        served_model_name,
        with_default_pools,
        with_overrides,
    )
    from cluster.serve_app import app_for
    from cluster.vllm_args import config_overrides

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"the model is given twice, as {args.model_tag!r} and --model "
                         f"{args.model!r}; give one")
    flags = config_overrides(args)
    model = args.model_tag or args.model
    if model is not None:
        flags[("model", "path")] = model
    config = with_default_pools(with_overrides(load_config(args.config), flags))
    sv = config.serving
    ray.init(address=config.cluster.address, include_dashboard=False, log_to_driver=True)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        serve.start(http_options={"host": sv.host, "port": sv.port})
        try:
            serve.run(app_for(config), name="llm", route_prefix="/")
        except RuntimeError as e:   # Serve names only the deployment; say why it failed
            raise ValueError(f"the server did not start: {_deploy_failure('llm') or e}") \
                from None
        url = f"http://{sv.host}:{sv.port}"
        name = served_model_name(config)
        defaults = ", ".join(f"{k}={v}" for k, v in sampling_defaults(config).items())
        print(f"Serving {name} at {url}/v1 (OpenAI API); Ctrl-C stops it.\n"
              f"Sampling defaults for requests that omit them: {defaults or 'none'}\n"
              f"  {curl_example(url, name)}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _deploy_failure(app: str) -> str | None:
    """The error that stopped an application's deployment: the last line of the first
    failed deployment's traceback, without the exception's class name."""
    from ray import serve
    from ray.serve.schema import DeploymentStatus

    status = serve.status().applications.get(app)
    for name, d in status.deployments.items() if status else ():
        lines = [ln for ln in d.message.splitlines() if ln.strip()]
        if d.status is DeploymentStatus.DEPLOY_FAILED and lines:
            error = re.sub(r"^[\w.]*(Error|Exception): ", "", lines[-1])
            return f"{name}: {error}"
    return None


def _cmd_batch(args: argparse.Namespace) -> int:
    from cluster.batch import main as batch_main

    return batch_main(args)


# `python -m cluster bench NAME` -> the benchmark's module in benchmarks/, and its help line
BENCHMARKS = {
    "offline": ("offline", "offline throughput against HF transformers and llama.cpp, the "
                "roofline, memory and a concurrency sweep (--help for its options)"),
    "http": ("http_load", "HTTP load: concurrent streaming clients against `transformers "
             "serve --continuous-batching` (--help for its options)"),
    "decode-step": ("decode_step", "one decode step's split (attention, other ops, linear "
                    "layers) with the CPU kernels against the torch reference ops"),
    "long-context": ("long_context", "sparse-retrieval attention against dense: attention "
                     "speed, a 64K decode step's time and device KV, capacity"),
    "long-context-recall": ("long_context_recall", "the attention mass sparse retrieval's "
                            "selected blocks capture on real text, against the oracle top-k"),
    "structured": ("structured_output", "structured output's cost: Workload A with a JSON "
                   "schema on every request against none, interleaved"),
    "grammar-backends": ("grammar_backends", "llguidance against xgrammar (installed beside "
                         "the project) on the default model's tokenizer: compile, mask cost"),
    "long-context-quality": ("long_context_quality", "end quality of sparse attention against "
                             "dense: passkey retrieval, teacher-forced next-token agreement"),
    "long-context-oracle": ("long_context_oracle", "teacher-forced agreement with the oracle's "
                            "block selection: the ceiling any summary can reach"),
    "quantization": ("quantization", "batch-1 decode with fp32, w8a16 and w8a8 linear "
                     "layers against HF and llama.cpp; KV capacity of int8 against fp16"),
    "quantization-quality": ("quantization_quality", "int8 linear layers and int8 KV against "
                             "HF fp32: teacher-forced top-1 agreement and perplexity"),
    "cuda": ("cuda_paths", "on a CUDA GPU: decode with and without CUDA graphs against HF "
             "generate; the device KV transport's cost against a device copy"),
    "batch-files": ("batch_files", "a file of OpenAI batch requests against the same prompts "
                    "as rows through `batch`: throughput of each, and equal text"),
    "chaos": ("chaos", "mixed requests whose clients leave at any point, then checks that "
              "the server kept constraints, freed both KV tiers and still answers the same"),
    "autoscale": ("autoscale", "a 1 -> 32 -> 1 streaming-client ramp on an autoscaled decode "
                  "pool against a static one sized for the peak; --migration: a drain's "
                  "KV migration against recompute"),
}


def _cmd_quantize(args: argparse.Namespace) -> int:
    from cluster.quantize import run

    report = run(args.model, args.output, args.ignore, args.tokenizer, args.weight_only)
    print(f"wrote {report.output}: {report.quantized} linear layers int8 (GPTQ over "
          f"{report.calibration_tokens} calibration tokens; {report.weight_only} of them "
          f"weight-only), {report.kept} kept fp, in "
          f"{report.seconds:.0f} s\nserve it with: python -m cluster serve {report.output}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # benchmarks/ lives in the repository, not in the installed package: import it only here.
    module = f"benchmarks.{BENCHMARKS[args.benchmark][0]}"
    try:
        bench = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", module):
            raise
        print(f"error: the benchmarks package is not importable; run `python -m cluster bench "
              f"{args.benchmark}` from the repository root", file=sys.stderr)
        return 2
    return bench.main(args.bench_args, prog=f"python -m cluster bench {args.benchmark}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cluster",
        description="A Ray-distributed LLM serving cluster with a paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt offline and print the text",
                         description="Run one prompt through the model in this process.")
    gen.add_argument("prompt", help="the user's message (chat-templated unless --raw)")
    _add_sampling(gen)
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as plain text, without the chat template")
    _add_common(gen)
    gen.set_defaults(func=_cmd_generate)
    srv = sub.add_parser(
        "serve", help="serve the OpenAI API over HTTP on a Ray cluster",
        description="Start (or join) Ray, launch the cell's workers and scheduler and an "
        "OpenAI-compatible router (/v1/models, /v1/completions, /v1/chat/completions, "
        "/tokenize, /detokenize, /version, /health, /metrics); runs until Ctrl-C or SIGTERM. "
        "With no config: the embedded model on 1 prefill + 1 decode worker of one CPU each.")
    srv.add_argument("model_tag", nargs="?", metavar="MODEL",
                     help="HF checkpoint directory, .gguf file, or an org/name model id "
                     "found in the local Hugging Face cache (as vLLM's `serve MODEL`)")
    add_config_flags(srv)
    _add_common(srv)
    srv.set_defaults(func=_cmd_serve)
    batch = sub.add_parser(
        "batch", help="run a file of prompts into a Parquet file of results, or a file of "
        "OpenAI Batch API requests into a JSONL file of answers",
        description="Offline inference over a file of prompts on a Ray cluster (1 prefill + 1 "
        "decode worker unless --config names pools; inside `ray job submit` it joins that "
        "cluster). Input columns: id (optional; default: the row number), prompt (text) or "
        "messages (chat: a list of {role, content}), and optional per-row sampling columns "
        "(max_tokens, min_tokens, temperature, top_p, top_k, min_p, seed, stop, "
        "repetition_penalty, presence_penalty, frequency_penalty, ignore_eos) that override "
        "the defaults below. Output columns: id, row, text, finish_reason, prompt_tokens, "
        "completion_tokens, error (null unless the row was refused). With a .jsonl output "
        "the input is an OpenAI Batch API file instead (what `vllm run-batch` reads): "
        "lines of {custom_id, method: POST, url: /v1/chat/completions, /v1/completions or "
        "/v1/responses, body}, each answered as the HTTP endpoint answers it, into lines of {id, "
        "custom_id, response: {status_code, request_id, body}, error}; the sampling "
        "options below do not apply (each body has its own). Rows whose id (custom_id) is "
        "already in the output are skipped: rerun the same command to resume.")
    batch.add_argument("--input", "--input-file", "-i", required=True, metavar="FILE",
                       help="prompts: .jsonl (one JSON object per line) or .parquet; or "
                       "OpenAI batch requests (.jsonl) for a .jsonl output")
    batch.add_argument("--output", "--output-file", "-o", required=True, metavar="FILE",
                       help="results .parquet, or answers .jsonl (OpenAI Batch API output); "
                       "finished rows are flushed to FILE.parts/ and merged into FILE at "
                       "the end")
    _add_sampling(batch)
    batch.add_argument("--top-k", type=int, default=0, help="top-k sampling; 0 is off (default)")
    batch.add_argument("--stop", action="append", metavar="TEXT",
                       help="a stop string (repeat for several)")
    batch.add_argument("--window", type=int, default=256,
                       help="requests kept in flight, so the workers stay busy (default: 256; "
                       "at most the config's cluster.max_waiting)")
    batch.add_argument("--flush-rows", type=int, default=256,
                       help="write finished rows to a part file every N rows (default: 256)")
    batch.add_argument("--flush-seconds", type=float, default=10.0,
                       help="... or at least this often while rows finish (default: 10)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_common(batch)
    batch.set_defaults(func=_cmd_batch)
    quant = sub.add_parser(
        "quantize", help="write a model as a W8A8 int8 checkpoint (SmoothQuant + GPTQ)",
        description="Quantize an fp checkpoint offline, as llm-compressor's W8A8 recipe does: "
        "SmoothQuant, then GPTQ over calibration text (Python's language reference), and "
        "write it as a compressed-tensors int8 checkpoint that this engine and vLLM load. "
        "About a minute for the default model on two cores.")
    quant.add_argument("--model", metavar="PATH",
                       help="fp HF checkpoint directory or .gguf file (default: the embedded "
                       "SmolLM2-135M-Instruct)")
    quant.add_argument("--output", required=True, metavar="DIR", help="a new directory")
    quant.add_argument("--ignore", action="append", metavar="MODULE",
                       help="a module to keep fp: its name or re:PATTERN, e.g. "
                       "'re:.*down_proj' (repeat for several; lm_head always is)")
    quant.add_argument("--weight-only", action="append", metavar="MODULE",
                       help="a module to quantize weight-only (int8 weights, activations "
                       "unrounded; served as w8a16): its name or re:PATTERN (repeat for "
                       "several)")
    quant.add_argument("--tokenizer", metavar="DIR",
                       help="an HF tokenizer directory, for a checkpoint without one")
    quant.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    quant.set_defaults(func=_cmd_quantize)
    bench = sub.add_parser("bench", help="run a benchmark (from the repository root)",
                           description="Benchmarks in benchmarks/; run from the repository root.")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, (_, help_text) in BENCHMARKS.items():
        bench_sub.add_parser(name, add_help=False, help=help_text).set_defaults(
            func=_cmd_bench, log_level="WARNING")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # `bench NAME` hands everything after it to the benchmark's own parser.
    args, rest = parser.parse_known_args(argv)
    if args.func is _cmd_bench:
        args.bench_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
