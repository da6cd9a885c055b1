"""The one-process engine: scheduler, model runner and output processor in a loop.

This is what ``LLM`` drives and what unit tests run; the Ray cluster wraps the same
pieces in actors. The scheduler and the runner talk only through msgpack-encoded
step plans and outputs, exactly as they do across processes, so the seam is
exercised on every step.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cluster.config import EngineConfig, sampling_defaults
from cluster.output_processor import OutputProcessor
from cluster.outputs import RequestOutput
from kvcache.kv_cache_manager import KVCacheManager
from scheduler.batch_scheduler import BatchScheduler
from scheduler.protocol import SamplingParams, StepOutput, StepPlan, decode, encode
from scheduler.tiering import TierPlanner
from workers.device import resolve_device
from workers.loading import Checkpoint, load_checkpoint
from workers.model_runner import ModelRunner
from workers.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def resolve_max_model_len(requested: int | None, model_max: int, pool_tokens: int,
                          host_tokens: int | None = None) -> int:
    """The context length to serve: the request, else the model's, within the pool (and,
    with long contexts, within what the host tier holds of a sequence)."""
    if host_tokens is not None:
        if requested is not None and requested > host_tokens:
            raise ValueError(f"max_model_len: got {requested}, but the host KV tier holds "
                             f"the middle of at most {host_tokens} tokens; raise "
                             "long_context.host_kv_bytes or lower max_model_len")
        model_max = min(model_max, host_tokens)
    if requested is not None:
        if requested > model_max:
            raise ValueError(f"max_model_len: got {requested}; the model supports at most "
                             f"{model_max} positions")
        if requested > pool_tokens:
            raise ValueError(f"max_model_len: got {requested}, but the KV pool holds only "
                             f"{pool_tokens} tokens; raise cache.kv_cache_bytes or lower it")
        return requested
    return min(model_max, pool_tokens)


def tokenize_prompt(tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                    prompt: str | Sequence[int],
                    add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
    """Validate a prompt (text or token ids) and return (text, token ids).

    Chat-templated text already holds its special tokens: pass
    ``add_special_tokens=False`` for it, as HF does."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty; give at least one character or token")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer; pass prompt_token_ids instead "
                             "of text")
        text, ids = prompt, tokenizer.encode(prompt, add_special_tokens)
    else:
        text, ids = None, _token_ids(prompt)
    if not ids:
        raise ValueError("prompt is empty; give at least one character or token")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens, but max_model_len is "
                         f"{max_model_len}; shorten the prompt to at most "
                         f"{max_model_len - 1} tokens")
    return text, ids


def _token_ids(prompt: Any) -> list[int]:
    """A prompt given as token ids, as ints: bytes, floats, booleans and digit strings
    are refused rather than read as ids."""
    if isinstance(prompt, (bytes, bytearray, dict)) or not isinstance(prompt, Iterable):
        raise ValueError(f"prompt: got {type(prompt).__name__}; expected text or a list of "
                         "token ids")
    ids = []
    for t in prompt:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token id {t!r} is not an integer; token ids are ints "
                             "in [0, vocab size)") from None
    return ids


@dataclass
class StepRecord:
    """Where one step's time went: the per-step split that benchmarks report."""

    num_seqs: int
    num_tokens: int
    num_sampled: int     # sequences that sampled a token (logit rows)
    schedule_s: float    # building the plan
    runner_s: float      # the worker's whole step
    prepare_s: float     # of which input layout
    forward_s: float     # of which the model
    sample_s: float      # of which sampling
    message_s: float     # msgpack encode/decode of plan and output
    update_s: float      # scheduler update and detokenization


class LocalEngine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        mc = config.model
        dtype = getattr(torch, mc.dtype)
        t0 = time.perf_counter()
        ckpt = checkpoint or load_checkpoint(mc.path, dtype=dtype, tokenizer=mc.tokenizer,
                                             chat_template=mc.chat_template)
        self.load_time_s = time.perf_counter() - t0
        self.model_config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        device = resolve_device(mc.device)
        model_max = ckpt.config.max_position_embeddings
        runner = ModelRunner(ckpt, config.cache, device,
                             max_model_len=config.scheduler.max_model_len or model_max,
                             dtype=dtype, seed=mc.seed, ops=mc.ops,
                             long_context=config.long_context, quantization=mc.quantization,
                             decode_graph_sizes=() if mc.enforce_eager else None)
        self.runner = runner
        kv = KVCacheManager(runner.num_blocks, runner.block_size,
                            config.cache.enable_prefix_caching)
        eos = set(ckpt.config.eos_token_ids)
        if ckpt.tokenizer is not None:
            eos |= set(ckpt.tokenizer.eos_token_ids)
        tiers = (TierPlanner(config.long_context, kv, runner.long_context.host.num_blocks)
                 if runner.long_context is not None else None)
        self.max_model_len = resolve_max_model_len(
            config.scheduler.max_model_len, model_max, runner.num_blocks * runner.block_size,
            tiers.longest_context if tiers else None)
        self.scheduler = BatchScheduler(config.scheduler, kv, self.max_model_len, sorted(eos),
                                        tiers)
        self.outputs = OutputProcessor(ckpt.tokenizer)
        self.sampling_defaults = sampling_defaults(config)
        self.step_records: list[StepRecord] | None = None  # a list records every step

    # ---- requests ------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | Sequence[int],
                        add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                               prompt, add_special_tokens)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0, stream: bool = False) -> None:
        self.outputs.add(request_id, prompt, prompt_token_ids, params, stream)
        try:
            self.scheduler.add(request_id, prompt_token_ids, params, priority)
        except ValueError:
            self.outputs.requests.pop(request_id, None)
            raise

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        outputs, _ = self.outputs.process(self.scheduler.abort(request_id))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        t1 = time.perf_counter()
        wire = self.runner.execute(decode(StepPlan, encode(plan)))
        output = decode(StepOutput, encode(wire))
        t2 = time.perf_counter()
        updates = self.scheduler.update(output)
        results, to_stop = self.outputs.process(updates)
        for seq_id in to_stop:
            self.scheduler.stop_sequence(seq_id)
        if self.step_records is not None:
            st = output.stats
            self.step_records.append(StepRecord(
                num_seqs=len(plan.new) + len(plan.continued), num_tokens=st.num_tokens,
                num_sampled=len(output.outputs), schedule_s=t1 - t0, runner_s=st.step_time_s,
                prepare_s=st.prepare_s, forward_s=st.forward_s, sample_s=st.sample_s,
                message_s=(t2 - t1) - st.step_time_s, update_s=time.perf_counter() - t2))
        return results
