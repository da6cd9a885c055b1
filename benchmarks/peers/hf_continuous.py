"""Peer: HF transformers' own continuous batching (paged KV cache, chunked prefill).

The closest HF analogue of this engine's scheduler. It is driven through the manager
that ``model.generate_batch`` uses internally, because ``generate_batch`` takes a single
``max_new_tokens`` for all prompts while every request here has its own.
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from benchmarks.peers.common import NUM_THREADS, PeerResult, default_hf_dir, peak_rss_bytes
from kvcache.config import CacheConfig

if TYPE_CHECKING:
    from transformers.generation.continuous_batching import ContinuousBatchingManager

NAME = "hf_continuous"
# Plain SDPA over CB's packed batch with a 4D mask: what transformers accepts for continuous
# batching on CPU ("paged|eager" is the slower alternative, flash needs CUDA).
ATTN_IMPLEMENTATION = "sdpa"
PAGE_SIZE = 64
# Tokens per forward pass, prefill chunks included: the engine's max_num_batched_tokens.
MAX_BATCH_TOKENS = 2048
_RESULT_POLL_S = 1.0


def available() -> tuple[bool, str]:
    """Needs a transformers with continuous batching (``generate_batch``, 4.56 and later)."""
    if importlib.util.find_spec("transformers") is None:
        return False, "transformers is not installed (pip install transformers)"
    from transformers import GenerationMixin

    if not hasattr(GenerationMixin, "generate_batch"):
        return False, "this transformers has no continuous batching (generate_batch)"
    return True, ""


def _num_blocks(prompts: list[list[int]], max_tokens: list[int], slots: int,
                bytes_per_token: int) -> int:
    """KV blocks for the ``slots`` largest requests at once, so the cache never preempts,
    but no more than the engine's KV budget on a CPU (2 GiB) holds at the model's dtype.

    Left to itself the cache sizes to 60% of the machine's RAM, which would make the peak
    RSS comparison meaningless; and 256 of Workload A's requests at once would need 6.6
    GB, which its own memory check refuses.
    """
    blocks = sorted((math.ceil((len(p) + m) / PAGE_SIZE) for p, m in zip(prompts, max_tokens)),
                    reverse=True)
    budget = CacheConfig.DEFAULT_CPU_KV_BYTES // (PAGE_SIZE * bytes_per_token)
    return min(sum(blocks[:slots]) + 1, budget)


@dataclass
class Generation:
    """What one timed pass over a workload produced."""

    outputs: list[list[int]]  # each request's generated token ids, in input order
    elapsed_s: float
    max_requests_per_batch: int  # as HF resolved it when concurrency was None
    kv_slots: int  # requests the KV cache was sized to hold at once
    kv_blocks: int  # what it got: fewer when the 2 GiB budget binds


def generate(prompts: list[list[int]], max_tokens: list[int],
             concurrency: int | None) -> Generation:
    """Load the model, warm it up, then time the workload (at most ``concurrency`` requests
    per batch; None: HF's default)."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    torch.set_num_threads(NUM_THREADS)
    model = AutoModelForCausalLM.from_pretrained(default_hf_dir(), dtype=torch.float32,
                                                 attn_implementation=ATTN_IMPLEMENTATION).eval()
    slots = min(concurrency or len(prompts), len(prompts))
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    num_blocks = _num_blocks(prompts, max_tokens, slots, bytes_per_token)
    cb_config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE, num_blocks=num_blocks,
        max_batch_tokens=MAX_BATCH_TOKENS, max_requests_per_batch=concurrency,
        use_cuda_graph=False, use_async_batching=False)
    # eos_token_id=-1 disables EOS: every request runs to its own max_new_tokens.
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(max_tokens))
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                          max_generated_length=max(max_tokens), num_requests=len(prompts))
    with model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config,
            workload_hints=hints, block=True, timeout=30) as manager:
        _collect(manager, [manager.add_request(prompts[0][:8], "warmup", max_new_tokens=2,
                                               eos_token_id=-1)])
        start = time.perf_counter()
        ids = [manager.add_request(p, f"r{i}", max_new_tokens=m, eos_token_id=-1)
               for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        outputs = _collect(manager, ids)
        elapsed = time.perf_counter() - start
        batch_limit = manager.continuous_batching_config.max_requests_per_batch
    return Generation([outputs[i] for i in ids], elapsed, batch_limit, slots, num_blocks)


def run(prompts: list[list[int]], max_tokens: list[int], concurrency: int | None) -> PeerResult:
    """Run the workload with at most ``concurrency`` requests per batch (None: HF's default)."""
    gen = generate(prompts, max_tokens, concurrency)
    return PeerResult(
        name=NAME, num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(map(len, gen.outputs)), elapsed_s=gen.elapsed_s,
        peak_rss_bytes=peak_rss_bytes(),
        notes=f"transformers continuous batching, attn {ATTN_IMPLEMENTATION}, "
              f"max_requests_per_batch {gen.max_requests_per_batch}, max_batch_tokens "
              f"{MAX_BATCH_TOKENS}, KV cache of {gen.kv_blocks} {PAGE_SIZE}-token pages "
              f"(the {gen.kv_slots} largest requests at once, at most 2 GiB), EOS never stops "
              f"a request")


def _collect(manager: ContinuousBatchingManager,
             request_ids: list[str | None]) -> dict[str, list[int]]:
    """Wait until every request finished; its generated token ids by request id."""
    pending = set(request_ids)
    if None in pending:
        raise RuntimeError("the continuous batching manager refused a request")
    done: dict[str, list[int]] = {}
    while pending:
        result = manager.get_result(timeout=_RESULT_POLL_S)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"continuous batching stopped with {len(pending)} requests "
                                   f"unfinished")
            continue
        if result.request_id in pending and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            done[result.request_id] = result.generated_tokens
            pending.discard(result.request_id)
    return done
