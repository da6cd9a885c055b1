"""``python -m cluster bench quantization-quality``: int8 linear layers and int8 KV
against HF transformers' fp32 forward on real English text.

Teacher forcing: the text goes through the engine's model in prefill chunks (every
chunk after the first reads its context back from the paged KV pool, so an int8 KV is
really in the path), and each position's logits are compared with HF's over the same
text: top-1 agreement (our argmax equals HF's) and the perplexity of the text's own
next tokens, ours against HF's. ``--decode`` runs every position after the first as a
decode step instead (one token a forward, the decode kernel reading the pool): slower,
and the figure for what decode attention does to the text.

Per-token int8 activations (w8a8) and int8 KV round at run time, and a rounding that
flips early changes every later layer's input: a relative change of 1e-6 in the input
(what another CPU's kernels make) moves their figures by up to a point over 1024 tokens
(benchmarks/RESULTS.md). ``--draws N`` also runs N - 1 draws with that much noise on our
model's embeddings (HF's untouched) and reports the spread, so that two methods are
compared by more than one draw each.

The ``w8a8 GPTQ`` configurations run the default model as ``python -m cluster quantize``
writes it (SmoothQuant + GPTQ, into a temporary directory; about a minute each), the
others with down_proj weight-only (``--weight-only 're:.*down_proj'``) or kept fp
(``--ignore 're:.*down_proj'``).

    python -m cluster bench quantization-quality [--tokens N] [--draws N] [--decode]
                                                 [--configs LABEL ...] [--text FILE|TOPIC]
                                                 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.long_context_recall import read_text
from cluster import LLM
from workers.ops.base import AttentionMetadata, PrefillSegment

# label -> LLM keywords (fp32 compute on the CPU; the KV pool sized for the text)
CONFIGS: dict[str, dict[str, str]] = {
    "fp32": {},
    "w8a16": {"quantization": "w8a16"},
    "w8a8": {"quantization": "w8a8"},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "w8a8 + int8 KV": {"quantization": "w8a8", "kv_cache_dtype": "int8"},
    "w8a8 GPTQ": {},
    "w8a8 GPTQ down_proj fp": {},
    "w8a8 GPTQ down_proj w8a16": {},
}
# label -> (modules ``quantize`` leaves fp, modules it makes weight-only), for the
# configurations that load its checkpoint
QUANTIZED_CHECKPOINTS: dict[str, tuple[list[str], list[str]]] = {
    "w8a8 GPTQ": ([], []), "w8a8 GPTQ down_proj fp": (["re:.*down_proj"], []),
    "w8a8 GPTQ down_proj w8a16": ([], ["re:.*down_proj"])}
CHUNK = 128
NOISE = 1e-6   # relative noise on the embeddings in draws after the first


@dataclass
class Quality:
    label: str
    draw: int               # 0: as loaded; later draws: embeddings with relative noise
    tokens: int
    agreement: float        # fraction of positions whose argmax equals HF's
    perplexity: float
    hf_perplexity: float

    @property
    def perplexity_increase(self) -> float:
        return self.perplexity / self.hf_perplexity - 1


def text_ids(llm: LLM, num_tokens: int, text: str | None = None) -> list[int]:
    """The first ``num_tokens + 1`` tokens of ``text``: a file, or a topic of Python's
    language reference (default: ``compound``)."""
    topics = pydoc_data.topics.topics
    body = topics[text] if text in topics else read_text(text)[0]
    ids = llm.get_tokenizer().encode(body, add_special_tokens=False)
    if len(ids) < num_tokens + 1:
        raise ValueError(f"tokens: got {num_tokens}; the text has only {len(ids) - 1}")
    return ids[:num_tokens + 1]


@torch.inference_mode()
def forced_logits(llm: LLM, ids: list[int], chunk: int = CHUNK,
                  decode: bool = False) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] of one sequence run through the engine's model and its
    block pool (blocks 0, 1, ... of a fresh engine): in prefill chunks, or with ``decode``
    a first token's prefill and then one decode step per token."""
    runner = llm.engine.runner
    bs = runner.block_size
    blocks = torch.arange(math.ceil(len(ids) / bs))
    if len(blocks) > runner.num_blocks:
        raise ValueError(f"text of {len(ids)} tokens needs {len(blocks)} KV blocks; the pool "
                         f"has {runner.num_blocks}: raise kv_cache_bytes")
    no_decode = torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    out = []
    start = 0
    while start < len(ids):
        end = min(len(ids), start + (1 if decode else chunk))
        positions = torch.arange(start, end)
        if decode and start:
            meta = AttentionMetadata(positions.clone(), 1, blocks[:start // bs + 1][None],
                                     torch.tensor([end]), [], bs)
        else:
            meta = AttentionMetadata(positions.clone(), 0, *no_decode,
                                     [PrefillSegment(0, end - start, end, blocks)], bs)
        hidden = runner.model.forward(torch.tensor(ids[start:end]), positions,
                                      runner.kv_caches, meta)
        out.append(runner.model.compute_logits(hidden))
        start = end
    return torch.cat(out)


def hf_logits(model_path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    p = Path(model_path)
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """Of the text's own next tokens under ``logits`` (row i predicts ids[i + 1]), summed
    in float64: a float32 mean rounds at ~6e-8, coarser than the change the draws' noise
    makes in a continuous model, and would hide it."""
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]))
    return math.exp(nll.item())


def measure(configs: dict[str, dict[str, str]], num_tokens: int,
            model_path: str | None = None, draws: int = 1,
            decode: bool = False, text: str | None = None) -> list[Quality]:
    """One ``Quality`` per configuration and draw, on ``text`` (see ``text_ids``)."""
    from workers.loading import default_model_path

    path = model_path or default_model_path()
    results: list[Quality] = []
    ids: list[int] = []
    reference = torch.empty(0)
    scratch = tempfile.TemporaryDirectory(prefix="quantized-")
    for label, kwargs in configs.items():
        llm = LLM(_model_for(label, path, scratch.name), device="cpu",
                  kv_cache_bytes=64 << 20, **kwargs)
        if not ids:
            ids = text_ids(llm, num_tokens, text)
            reference = hf_logits(path, ids)
        model = llm.engine.runner.model
        embed = model.embed
        for draw in range(draws):
            if draw:
                noise = torch.randn(embed.shape, generator=torch.Generator().manual_seed(draw))
                model.embed = embed * (1 + NOISE * noise).to(embed.dtype)
            ours = forced_logits(llm, ids, decode=decode)
            model.embed = embed
            agree = (ours.argmax(-1) == reference.argmax(-1)).double().mean().item()
            results.append(Quality(label, draw, len(ids), agree, perplexity(ours, ids),
                                   perplexity(reference, ids)))
    return results


def _model_for(label: str, path: str, scratch: str) -> str:
    """The model a configuration loads: ``path``, or for the ``quantize`` ones its
    checkpoint written under ``scratch``."""
    if label not in QUANTIZED_CHECKPOINTS:
        return path
    from cluster.quantize import run

    out = Path(scratch) / label.replace(" ", "_")
    ignore, weight_only = QUANTIZED_CHECKPOINTS[label]
    return str(run(path, str(out), ignore, weight_only=weight_only).output)


def table(results: Sequence[Quality]) -> str:
    """A row per configuration: its first draw, and the range over all its draws."""
    rows = ["| config | tokens | draws | top-1 agreement with HF fp32 | over the draws | "
            "perplexity | HF fp32 perplexity | increase | over the draws |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label in dict.fromkeys(r.label for r in results):
        mine = [r for r in results if r.label == label]
        first, agree = mine[0], [r.agreement for r in mine]
        increase = [r.perplexity_increase for r in mine]
        rows.append(f"| {label} | {first.tokens} | {len(mine)} | {first.agreement:.2%} | "
                    f"{min(agree):.2%}-{max(agree):.2%} | {first.perplexity:.3f} | "
                    f"{first.hf_perplexity:.3f} | {first.perplexity_increase:+.2%} | "
                    f"{min(increase):+.2%} to {max(increase):+.2%} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="text tokens (default: 2048)")
    p.add_argument("--draws", type=int, default=1,
                   help=f"runs per configuration, all but the first with {NOISE:g} relative "
                        "noise on the embeddings (default: 1)")
    p.add_argument("--decode", action="store_true",
                   help="every position after the first as a decode step (default: prefill "
                        f"chunks of {CHUNK})")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   metavar="LABEL", help=f"which of: {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--text", metavar="FILE|TOPIC",
                   help="a UTF-8 text file to score, or a topic of Python's language "
                   "reference (pydoc_data.topics; default: compound)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.draws < 1:
        p.error(f"--draws: got {args.draws}; expected at least 1")
    results = measure({label: CONFIGS[label] for label in args.configs}, args.tokens,
                      draws=args.draws, decode=args.decode, text=args.text)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) | {"perplexity_increase":
                                                            r.perplexity_increase}
                                               for r in results], indent=2))
    return 0
