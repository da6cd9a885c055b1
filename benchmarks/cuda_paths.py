"""The CUDA paths on a GPU: decode throughput with and without CUDA graphs against HF
transformers, and the device KV transport's worker-side cost against a device copy.

Decode: a checkpoint of the default model's shape (SmolLM2-135M: 30 layers, 576 wide,
9 query and 3 KV heads) with random bf16 weights, since the GPU machine has no network
and the embedded GGUF file is larger than what travels to it; speed does not depend on
the values. Each of B prompts of 128 random tokens generates 128 greedy tokens; output
tokens per second over the whole ``generate`` call (its one prefill step included), for
our engine with graphs and with ``enforce_eager`` and for HF ``generate``, same inputs.

Handoff: the default model's KV blocks at fp16 and fp32, scattered over two pools on the
GPU: export (gather into rows, a checksum per row, the Arrow description) and import
(description and checksum checks, scatter), against ``copy_`` of the same bytes between
two contiguous device buffers. On one GPU no bytes cross between devices: this is the
cost a Ray Direct Transport adds around its own transfer.

    python -m cluster bench cuda [--parts decode handoff] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from benchmarks.default_shape import BLOCK_SIZE, SMOLLM2_135M, kv_shape
from kvcache.device_transport import export_device, import_device
from kvcache.kv_tensors import allocate_kv_cache
from kvcache.kv_transfer import KVLayoutMeta
from kvcache.pool_rows import gather_rows, scatter_rows

CUDA = torch.device("cuda")
PROMPT_TOKENS = OUTPUT_TOKENS = 128


def gpu_seconds(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def median_of(fn: Callable[[], object], repeats: int) -> float:
    fn()
    return statistics.median(gpu_seconds(fn) for _ in range(repeats))


# ---- decode ------------------------------------------------------------------------------
def random_checkpoint(directory: str) -> str:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMOLLM2_135M)).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def engine_tok_s(path: str, eager: bool, prompts: dict[int, torch.Tensor],
                 max_model_len: int) -> dict[int, float]:
    """Output tokens/s of our engine for each batch size, with graphs or eager steps."""
    from cluster import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm = LLM(path, device="cuda", dtype="bfloat16", max_model_len=max_model_len,
              kv_cache_bytes=4 << 30, enforce_eager=eager)
    out = {}
    for b, batch in prompts.items():
        inputs = [{"prompt_token_ids": p} for p in batch.tolist()]
        out[b] = b * OUTPUT_TOKENS / median_of(lambda: llm.generate(inputs, params), 2)  # noqa: B023
    return out


def hf_tok_s(path: str, prompts: dict[int, torch.Tensor]) -> dict[int, float]:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(CUDA).eval()
    out = {}
    for b, batch in prompts.items():
        ids = batch.to(CUDA)

        def generate() -> None:
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,  # noqa: B023
                            max_new_tokens=OUTPUT_TOKENS, min_new_tokens=OUTPUT_TOKENS)

        out[b] = b * OUTPUT_TOKENS / median_of(generate, 2)
    return out


def decode_rows(batches: list[int], max_model_len: int) -> list[dict]:
    path = random_checkpoint(tempfile.mkdtemp(prefix="smollm2-shape-"))
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(3, SMOLLM2_135M["vocab_size"], (b, PROMPT_TOKENS), generator=g)
               for b in batches}
    graphs = engine_tok_s(path, False, prompts, max_model_len)
    torch.cuda.empty_cache()
    eager = engine_tok_s(path, True, prompts, max_model_len)
    torch.cuda.empty_cache()
    hf = hf_tok_s(path, prompts)
    return [{"batch": b, "graphs_tok_s": graphs[b], "eager_tok_s": eager[b], "hf_tok_s": hf[b],
             "graphs_over_eager": graphs[b] / eager[b], "graphs_over_hf": graphs[b] / hf[b]}
            for b in batches]


# ---- handoff -----------------------------------------------------------------------------
def handoff_rows(dtype: torch.dtype, token_counts: list[int], repeats: int) -> list[dict]:
    shape = kv_shape(dtype)
    meta = KVLayoutMeta.from_shape(shape, "smollm2-135m-bench")
    pool_blocks = max(token_counts) // BLOCK_SIZE + 64
    src, dst = (allocate_kv_cache(shape, pool_blocks, CUDA) for _ in range(2))
    for kv in src:
        kv.normal_()
    g = torch.Generator().manual_seed(0)
    rows = []
    for tokens in token_counts:
        src_ids, dst_ids = (torch.randperm(pool_blocks, generator=g)[:tokens // BLOCK_SIZE]
                            .tolist() for _ in range(2))
        row = handoff_row(src, dst, meta, src_ids, dst_ids, repeats)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, **row})
    return rows


def handoff_row(src: list[torch.Tensor], dst: list[torch.Tensor], meta: KVLayoutMeta,
                src_ids: list[int], dst_ids: list[int], repeats: int) -> dict:
    n = len(src_ids)
    hashes, counts = [None] * n, [BLOCK_SIZE] * n
    described = export_device(src, src_ids, hashes, counts, meta)
    nbytes = described[1].numel() * described[1].element_size()
    a, b = (torch.empty(nbytes, dtype=torch.uint8, device=CUDA) for _ in range(2))
    plain = torch.empty_like(described[1])
    device_src_ids, dst_array = torch.tensor(src_ids, device=CUDA), torch.tensor(dst_ids).numpy()
    copy_s = median_of(lambda: b.copy_(a), repeats)
    export_s = median_of(lambda: export_device(src, src_ids, hashes, counts, meta), repeats)
    import_s = median_of(lambda: import_device(*described, dst, dst_ids, meta), repeats)
    gather_scatter_s = median_of(lambda: (gather_rows(src, device_src_ids, plain),
                                          scatter_rows(plain, dst, dst_array)), repeats)
    assert all(torch.equal(d[:, dst_ids], s[:, src_ids]) for d, s in zip(dst, src))
    transport_s = export_s + import_s
    return {"MB": nbytes / 1e6, "copy_GBps": nbytes / copy_s / 1e9,
            "export_ms": export_s * 1e3, "import_ms": import_s * 1e3,
            "transport_GBps": nbytes / transport_s / 1e9,
            "transport_frac_copy": copy_s / transport_s,
            "gather_scatter_frac_copy": copy_s / gather_scatter_s}


# ---- report ------------------------------------------------------------------------------
def table(rows: list[dict], columns: list[str]) -> str:
    def cell(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=("decode", "handoff"),
                    default=["decode", "handoff"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192, 32768, 65536])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="our engine's context limit: graphs' block tables are this wide")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    out: dict[str, list[dict]] = {}
    if "handoff" in args.parts:
        out["handoff"] = [r for dtype in (torch.float16, torch.float32)
                          for r in handoff_rows(dtype, args.tokens, args.repeats)]
        print(table(out["handoff"], list(out["handoff"][0])), flush=True)
    if "decode" in args.parts:
        out["decode"] = decode_rows(args.batches, args.max_model_len)
        print(table(out["decode"], list(out["decode"][0])), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
