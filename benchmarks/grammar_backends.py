"""``python -m cluster bench grammar-backends``: llguidance against xgrammar on the default
model's tokenizer, the comparison behind structured output's choice of library.

One JSON schema, one valid instance of it tokenized; each library, interleaved over
five rounds: the schema's compile time, then along the instance every token's mask
(filled into a bitmask, the instance's token checked allowed) and advance. Medians.
xgrammar is not a dependency (it pulls triton): install it beside the project to run
this, e.g. ``pip install --no-deps --target /tmp/xg xgrammar==0.2.8 apache-tvm-ffi`` and
``PYTHONPATH=/tmp/xg``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import llguidance
import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
INSTANCE = {"name": "Marie Curie", "age": 66,
            "tags": ["physics", "chemistry", "radioactivity", "nobel"] * 6,
            "address": {"city": "Paris", "zip": "75005"}}


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def main(argv: Sequence[str] | None = None,
         prog: str = "python -m cluster bench grammar-backends") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import transformers
    import xgrammar as xgr

    from workers.loading import cache_root, default_model_path
    from workers.loading.gguf_checkpoint import converted_dir

    directory = converted_dir(Path(default_model_path()), cache_root(),
                              require_tokenizer=True).directory
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    vocab = hf.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    eos = hf.backend_tokenizer.token_to_id("<|im_end|>")
    ids = hf.encode(json.dumps(INSTANCE), add_special_tokens=False)
    schema = json.dumps(SCHEMA)
    ll_tok = llguidance.LLTokenizer((directory / "tokenizer.json").read_text(), n_vocab=vocab,
                                    eos_token=eos)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab, stop_token_ids=[eos]), max_threads=1)

    def run_llguidance() -> tuple[float, float]:
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        t1 = time.perf_counter()
        bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
        for tok in ids:
            m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            assert _allowed(bitmask, tok) and m.consume_token(tok)
        return t1 - t0, time.perf_counter() - t1

    def run_xgrammar() -> tuple[float, float]:
        t0 = time.perf_counter()
        compiler.clear_cache()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(schema))
        t1 = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        for tok in ids:
            m.fill_next_token_bitmask(bitmask)
            assert _allowed(bitmask, tok) and m.accept_token(tok)
        return t1 - t0, time.perf_counter() - t1

    runs: dict[str, list[tuple[float, float]]] = {"llguidance": [], "xgrammar": []}
    libs: dict[str, Callable[[], tuple[float, float]]] = {
        "llguidance": run_llguidance, "xgrammar": run_xgrammar}
    for _ in range(args.rounds):
        for name, fn in libs.items():
            runs[name].append(fn())
    print(f"{len(ids)} tokens, vocabulary {vocab}, {args.rounds} rounds (medians)")
    for name, values in runs.items():
        compile_ms = statistics.median(v[0] for v in values) * 1e3
        per_token_us = statistics.median(v[1] for v in values) / len(ids) * 1e6
        print(f"{name}: compile {compile_ms:.2f} ms, mask + advance {per_token_us:.1f} us/token")
    return 0
