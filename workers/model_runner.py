"""Executes step plans: the worker's half of continuous batching.

The runner keeps each sequence it holds (tokens, block table, sampling settings)
between steps, so a plan carries only what changed. One step: apply forks and
drops, add new sequences, lay the scheduled tokens out as one flat batch (decodes
first), run the model once, and sample the sequences whose known tokens are now
all computed. It makes no scheduling decision: it runs what the plan says.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from llguidance import LLMatcher

from kvcache.block_checksum import BlockChecksums
from kvcache.config import CacheConfig
from kvcache.kv_layout import LAYOUT_ND
from kvcache.kv_quant import row_width
from kvcache.kv_tensors import KVShape, allocate_kv_cache, slot_mapping
from kvcache.long_context import LongContextConfig
from kvcache.shm_segment import SharedSegment
from kvcache.shm_transport import pool_checksums
from scheduler.protocol import (
    ForkedSequence,
    NewSequence,
    SamplingParams,
    SequenceOutput,
    StepOutput,
    StepPlan,
    TierChange,
    WorkerStats,
)
from workers.decode_graphs import CUDA_GRAPH_SIZES, Capture, DecodeGraphs, cuda_capture
from workers.device import DEFAULT_BLOCK_SIZE
from workers.loading import Checkpoint
from workers.models.decoder import DecoderLM
from workers.models.smoothquant import smooth_for_w8a8
from workers.ops import get_ops
from workers.ops.base import AttentionMetadata, PrefillSegment
from workers.prompt_logprobs import prompt_span, score_prompt
from workers.sampler import Sampler, SamplingRow
from workers.sparse_attention import LongContextAttention
from workers.sparse_step import SeqTierState
from workers.structured_output import StructuredOutputs


@dataclass
class SeqState:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    sampling: SamplingParams
    sample_index: int = 0
    tier: SeqTierState | None = None  # long sequences: mode, host blocks, recall cache
    matcher: LLMatcher | None = None  # structured output: the grammar's state after the output


@dataclass
class _Scheduled:
    seq_id: str
    state: SeqState
    num_tokens: int


class PlanError(ValueError):
    """A plan that contradicts the worker's state (unknown sequence, bad counts)."""


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, cache: CacheConfig, device: torch.device,
                 max_model_len: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                 num_blocks: int | None = None, ops: str = "auto",
                 long_context: LongContextConfig | None = None,
                 shared_pool: bool = False,
                 decode_graph_sizes: Sequence[int] | None = None,
                 graph_capture: Capture | None = None,
                 quantization: str = "none") -> None:
        """``shared_pool``: a host pool lives in a segment peers on this node can map;
        ``decode_graph_sizes``: batch sizes whose decode-only steps replay a captured
        graph (None: ``CUDA_GRAPH_SIZES`` on CUDA, none elsewhere); ``graph_capture``
        records one (None: ``cuda_capture``); ``quantization``: the linear layers'
        (``w8a8``, ``w8a16`` or ``none``; ``w8a8`` of fp weights applies SmoothQuant
        first, calibrated on a fixed text with the checkpoint's tokenizer)."""
        cfg = checkpoint.config
        self.config = cfg
        self.device = device
        self.block_size = cache.block_size or DEFAULT_BLOCK_SIZE[device.type]
        self.ops = get_ops(device, ops)
        if self.ops.kv_layout != LAYOUT_ND and long_context is not None and long_context.enabled:
            raise ValueError(f"long_context: the {self.ops.kv_layout.upper()} KV layout of this "
                             "device has no sparse attention; disable long_context")
        weights = checkpoint.weights
        if quantization == "w8a8":
            weights = smooth_for_w8a8(cfg, weights, checkpoint.tokenizer, device)
        self.model = DecoderLM(cfg, weights, self.ops, max_model_len, device, dtype,
                               quantization, checkpoint.int8_schemes)
        kv_dtype = dtype if cache.kv_dtype == "auto" else getattr(torch, cache.kv_dtype)
        if kv_dtype == torch.int8 and not self.ops.int8_kv:
            raise ValueError(f"cache.kv_dtype: got 'int8'; the {self.ops.name} ops have no int8 "
                             "KV: use auto, float32, float16 or bfloat16 on this device")
        self.kv_shape = KVShape(cfg.num_layers, self.block_size, cfg.num_kv_heads,
                                row_width(cfg.head_dim, kv_dtype), kv_dtype, self.ops.kv_layout)
        if num_blocks is None:
            num_blocks = self.kv_shape.num_blocks_for(_kv_budget(cache, device))
        self.num_blocks = num_blocks
        if decode_graph_sizes is None:
            decode_graph_sizes = CUDA_GRAPH_SIZES if device.type == "cuda" else ()
        # Only a host pool in the plain ND layout can live in a segment peers map.
        self.kv_segment = (SharedSegment(num_blocks * self.kv_shape.bytes_per_block)
                           if shared_pool and device.type == "cpu"
                           and self.kv_shape.layout == LAYOUT_ND else None)
        # A pool peers copy from keeps each block's checksum, taken as the block is written
        # (every write below tells it), so a handoff sends them without hashing its blocks.
        self.kv_checksums: BlockChecksums | None = None
        if self.kv_segment is not None:
            # Block-major: peers copy whole blocks out of it (kv_tensors).
            self.kv_caches = allocate_kv_cache(self.kv_shape, num_blocks, device,
                                               self.kv_segment.buffer, block_major=True)
            self.kv_checksums = pool_checksums(self.kv_caches)
        else:
            # Graphs' padding rows write into one extra block, never given to the scheduler.
            self.kv_caches = self.ops.allocate_kv(
                self.kv_shape, num_blocks + (1 if decode_graph_sizes else 0), device)
        self.long_context = (
            LongContextAttention(long_context, self.kv_shape, num_blocks, device,
                                 self.ops.block_selector(long_context.summary),
                                 self.ops.copy_kv_blocks, shared_host=self.kv_segment is not None)
            if long_context is not None and long_context.enabled else None)
        # The host tier of a shared pool is shared too, and keeps its blocks' checksums
        # the same way: an offload copies a pool block's (the bytes are the same).
        host = self.long_context.host if self.long_context is not None else None
        self.host_checksums = (pool_checksums(list(host.kv.unbind(0)))
                               if host is not None and host.segment is not None else None)
        self.sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids, seed=seed)
        self.tokenizer = checkpoint.tokenizer
        self._structured: StructuredOutputs | None = None  # built at the first constrained request
        self.graphs = None
        if decode_graph_sizes and self.long_context is None:
            self.graphs = DecodeGraphs(
                lambda ids, pos, meta: self.model.forward(ids, pos, self.kv_caches, meta),
                decode_graph_sizes, num_blocks, self.block_size,
                -(-max_model_len // self.block_size), device, graph_capture or cuda_capture())
        self.seqs: dict[str, SeqState] = {}

    # ---- plan application --------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        start = time.perf_counter()
        if plan.reset:   # a restarted scheduler's first plan: its blocks are free again
            self.seqs.clear()
        self._apply_forks(plan.forks)
        for seq_id in plan.finished:
            self.seqs.pop(seq_id, None)
        scheduled = [self._add(s) for s in plan.new]
        self._apply_tiers(plan.tiers)
        for c in plan.continued:
            state = self.seqs.get(c.seq_id)
            if state is None:
                raise PlanError(f"plan continues sequence {c.seq_id!r} the worker does not hold")
            state.block_ids.extend(c.new_block_ids)
            scheduled.append(_Scheduled(c.seq_id, state, c.num_scheduled_tokens))
        timing = _Timing()
        outputs = self._run(scheduled, timing) if scheduled else []
        stats = WorkerStats(num_blocks=self.num_blocks, step_time_s=time.perf_counter() - start,
                            num_tokens=sum(s.num_tokens for s in scheduled),
                            num_seqs=len(self.seqs), prepare_s=timing.prepare_s,
                            forward_s=timing.forward_s, sample_s=timing.sample_s)
        if self.long_context is not None:
            stats.tier = dataclasses.replace(self.long_context.stats)
        return StepOutput(plan.step_id, outputs, stats)

    def _add(self, s: NewSequence) -> _Scheduled:
        state = SeqState(list(s.token_ids), s.num_prompt_tokens, s.num_computed_tokens,
                         list(s.block_ids), s.sampling, s.sample_index)
        state.matcher = self._matcher(state)
        self.seqs[s.seq_id] = state
        return _Scheduled(s.seq_id, state, s.num_scheduled_tokens)

    def _apply_tiers(self, changes: list[TierChange]) -> None:
        for c in changes:
            state = self.seqs.get(c.seq_id)
            if state is None:
                raise PlanError(f"tier change for sequence {c.seq_id!r} the worker does not "
                                "hold")
            state.tier = self._long_context().apply(state.tier, c, self.kv_caches,
                                                    state.block_ids, state.num_prompt_tokens)
            if self.kv_checksums is not None:   # each step recalls host slices into them
                self.kv_checksums.written(c.recall_block_ids)
            if self.host_checksums is not None and c.offload_block_ids:
                self.host_checksums.copied(c.offload_block_ids,
                                           c.host_block_ids[c.num_received:], self.kv_checksums)

    def _long_context(self) -> LongContextAttention:
        if self.long_context is None:
            raise PlanError("plan names a sparse or offloaded sequence, but this worker runs "
                            "with long_context disabled")
        return self.long_context

    def _apply_forks(self, forks: list[ForkedSequence]) -> None:
        copies = [(f.copy_src, f.copy_dst) for f in forks if f.copy_src >= 0]
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            for kv in self.kv_caches:
                kv[:, dst] = kv[:, src]
            if self.kv_checksums is not None:
                self.kv_checksums.copied(src.tolist(), dst.tolist())
        for f in forks:
            parent = self.seqs.get(f.parent_id)
            if parent is None:
                raise PlanError(f"fork of {f.seq_id!r} names unknown parent {f.parent_id!r}")
            child = SeqState(
                parent.token_ids[:-1] + [f.first_token], parent.num_prompt_tokens,
                parent.num_computed_tokens, list(f.block_ids), parent.sampling, f.sample_index)
            child.matcher = self._matcher(child)
            self.seqs[f.seq_id] = child

    def _matcher(self, state: SeqState) -> LLMatcher | None:
        """A constrained sequence's grammar state, having consumed its output so far."""
        spec = state.sampling.structured_outputs
        if spec is None:
            return None
        if self._structured is None:
            if self.tokenizer is None:
                raise PlanError("structured output needs a tokenizer, and this checkpoint "
                                "has none")
            self._structured = StructuredOutputs(self.tokenizer, self.config.vocab_size,
                                                 self.sampler.eos_token_ids)
        return self._structured.matcher(spec, state.token_ids[state.num_prompt_tokens:])

    # ---- one forward pass ----------------------------------------------------------
    def _run(self, scheduled: list[_Scheduled], timing: _Timing) -> list[SequenceOutput]:
        for s in scheduled:
            end = s.state.num_computed_tokens + s.num_tokens
            if s.num_tokens < 1 or end > len(s.state.token_ids):
                raise PlanError(f"sequence {s.seq_id!r}: cannot run {s.num_tokens} tokens from "
                                f"{s.state.num_computed_tokens} of {len(s.state.token_ids)}")
        # Decodes first: the attention op runs them as one batched call.
        t0 = time.perf_counter()
        scheduled.sort(key=lambda s: not _is_decode(s))
        inputs = self._prepare(scheduled)
        t1 = time.perf_counter()
        timing.prepare_s = t1 - t0
        # Which sequences sample this step is known now: their grammar masks are computed
        # on the helper thread while the model runs.
        done = [i for i, s in enumerate(scheduled)
                if s.state.num_computed_tokens + s.num_tokens == len(s.state.token_ids)]
        constrained = [i for i in done if scheduled[i].state.matcher is not None]
        masks = (self._structured.masks_async([scheduled[i].state.matcher for i in constrained])
                 if constrained else None)
        sparse = None
        if self.long_context is not None:
            nd = inputs.meta.num_decode_tokens
            sparse = self.long_context.step(
                [(s.state.block_ids, s.state.num_computed_tokens,
                  s.state.num_computed_tokens + s.num_tokens) for s in scheduled],
                [(s.state.tier, s.state.num_computed_tokens + 1) for s in scheduled[:nd]],
                inputs.meta)
        meta = inputs.meta
        if (self.graphs is not None and meta.num_decode_tokens == len(scheduled)
                and self.graphs.fits(len(scheduled), meta.decode_block_tables.shape[1])):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, meta)
        else:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches,
                                        meta, sparse)
        if self.kv_checksums is not None:
            self.kv_checksums.written_slots(meta.slot_mapping.numpy(), self.block_size)
        spans = [span for i, s in enumerate(scheduled) if (span := prompt_span(
            s.seq_id, s.state.token_ids, s.state.num_prompt_tokens,
            s.state.num_computed_tokens, s.num_tokens,
            int(inputs.last_index[i]) - s.num_tokens + 1, s.state.sampling.prompt_logprobs))]
        prompt_lps = (score_prompt(hidden, spans, self.sampler.vocab_size,
                                   self.model.compute_logits) if spans else {})
        starts = {span.seq_id: span.start for span in spans}
        for s in scheduled:
            s.state.num_computed_tokens += s.num_tokens
        # A partial prefill chunk reports only the prompt logprobs it scored.
        outputs = [SequenceOutput(s.seq_id, [], None, prompt_lps[s.seq_id], starts[s.seq_id])
                   for i, s in enumerate(scheduled) if s.seq_id in prompt_lps and i not in done]
        if not done:
            timing.forward_s = time.perf_counter() - t1
            return outputs
        logits = self.model.compute_logits(
            hidden[torch.as_tensor(inputs.last_index[done], device=self.device)])
        t2 = time.perf_counter()
        timing.forward_s = t2 - t1
        # A request with n > 1 whose prompt just completed samples n tokens from one row.
        fanout = [st.sampling.n if len(st.token_ids) == st.num_prompt_tokens else 1
                  for st in (scheduled[i].state for i in done)]
        mask_of = dict(zip(constrained, masks.result())) if masks is not None else {}
        rows = [SamplingRow(st.sampling, st.token_ids[:st.num_prompt_tokens],
                            st.token_ids[st.num_prompt_tokens:], st.sample_index + k,
                            mask_of.get(i))
                for i, f in zip(done, fanout) for st in [scheduled[i].state] for k in range(f)]
        if len(rows) != len(done):
            logits = logits.repeat_interleave(torch.as_tensor(fanout), dim=0)
        result = self.sampler(logits, rows)
        pos = 0
        for i, f in zip(done, fanout):
            s = scheduled[i]
            toks, lps = result.token_ids[pos:pos + f], result.logprobs[pos:pos + f]
            pos += f
            s.state.token_ids.append(toks[0])
            if s.state.matcher is not None:
                StructuredOutputs.advance(s.state.matcher, toks[0])
            outputs.append(SequenceOutput(s.seq_id, toks, None if lps[0] is None else lps,
                                          prompt_lps.get(s.seq_id), starts.get(s.seq_id, 0)))
        timing.sample_s = time.perf_counter() - t2
        return outputs

    def _prepare(self, scheduled: list[_Scheduled]) -> _StepInputs:
        bs, dev = self.block_size, self.device
        counts = np.array([s.num_tokens for s in scheduled], dtype=np.int64)
        starts = np.array([s.state.num_computed_tokens for s in scheduled], dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(counts)))
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, counts)])
        tokens = np.concatenate([np.asarray(s.state.token_ids[a:a + n], dtype=np.int64)
                                 for s, a, n in zip(scheduled, starts, counts)])
        tables = [np.asarray(s.state.block_ids, dtype=np.int64) for s in scheduled]
        slots = np.concatenate([slot_mapping(t, positions[offsets[i]:offsets[i + 1]], bs)
                                for i, t in enumerate(tables)])
        nd = sum(1 for s in scheduled if _is_decode(s))
        seq_lens = starts + counts
        width = int(-(-seq_lens[:nd].max() // bs)) if nd else 1
        decode_tables = np.zeros((nd, width), dtype=np.int64)
        for i in range(nd):
            nb = -(-int(seq_lens[i]) // bs)
            decode_tables[i, :nb] = np.maximum(tables[i][:nb], 0)  # -1: in the host tier
        prefills = [PrefillSegment(int(offsets[i]), int(counts[i]), int(seq_lens[i]),
                                   torch.as_tensor(tables[i], device=dev))
                    for i in range(nd, len(scheduled))]
        meta = AttentionMetadata(
            slot_mapping=torch.as_tensor(slots, device=dev),
            num_decode_tokens=nd,
            decode_block_tables=torch.as_tensor(decode_tables, device=dev),
            decode_seq_lens=torch.as_tensor(seq_lens[:nd], device=dev),
            prefills=prefills, block_size=bs)
        return _StepInputs(torch.as_tensor(tokens, device=dev),
                           torch.as_tensor(positions, device=dev), meta, offsets[1:] - 1)


def _is_decode(s: _Scheduled) -> bool:
    return s.num_tokens == 1 and s.state.num_computed_tokens > 0


@dataclass
class _Timing:
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


@dataclass
class _StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    last_index: np.ndarray  # flat index of each scheduled sequence's last token


def _kv_budget(cache: CacheConfig, device: torch.device) -> int:
    if cache.kv_cache_bytes is not None:
        return cache.kv_cache_bytes
    if device.type == "cpu":
        return CacheConfig.DEFAULT_CPU_KV_BYTES
    free, _ = torch.cuda.mem_get_info(device) if device.type == "cuda" else \
        torch.npu.mem_get_info(device)  # type: ignore[attr-defined]
    return int(free * cache.memory_fraction)
