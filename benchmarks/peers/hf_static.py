"""Peer: HF transformers ``model.generate`` on static, left-padded batches.

The baseline a user gets without a serving engine: requests are grouped in arrival
order into batches of ``concurrency``, and each batch runs until its longest request is
done, so shorter requests in it pad both the prompt and the output. Only each request's
own ``max_tokens`` count as output tokens (the useful ones), which charges that padding
to the peer's throughput.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from benchmarks.peers.common import NUM_THREADS, PeerResult, default_hf_dir, peak_rss_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAME = "hf_static"
BATCH_SIZE_CANDIDATES = (8, 16, 32, 64)
# best_batch_size measures prefill on prompts cut to this length, and this many decode steps.
_SAMPLE_PROMPT_TOKENS = 64
_SAMPLE_DECODE_STEPS = 8


def available() -> tuple[bool, str]:
    """Needs only transformers (a test dependency of the project, not a runtime one)."""
    if importlib.util.find_spec("transformers") is None:
        return False, "transformers is not installed (pip install transformers)"
    return True, ""


@dataclass
class _StepClock:
    """A logits processor that only records when each forward pass finished."""

    stamps: list[float] = field(default_factory=list)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


@dataclass
class StaticBatcher:
    """A loaded model and the padding it needs, reused across batches and timing probes."""

    model: PreTrainedModel
    pad_token_id: int

    @classmethod
    def load(cls) -> StaticBatcher:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(NUM_THREADS)
        model = AutoModelForCausalLM.from_pretrained(default_hf_dir(), dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
        pad = model.generation_config.pad_token_id
        if pad is None:  # SmolLM2 has none: pad with EOS, masked out by attention_mask anyway
            eos = model.generation_config.eos_token_id
            pad = eos[0] if isinstance(eos, list) else eos
        return cls(model, int(pad))

    def generate_batch(self, prompts: list[list[int]], new_tokens: int,
                       clock: _StepClock | None = None) -> torch.Tensor:
        """Exactly ``new_tokens`` greedy token ids for every prompt, from one padded batch.

        Returns the generated ids only, shape ``(len(prompts), new_tokens)``.
        """
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens,  # EOS masked until then
                pad_token_id=self.pad_token_id, logits_processor=[clock] if clock else None)
        return out[:, width:]

    def run(self, prompts: list[list[int]], max_tokens: list[int], batch_size: int) -> int:
        """The whole workload in arrival-order batches; returns the useful output tokens."""
        useful = 0
        for start in range(0, len(prompts), batch_size):
            batch_limits = max_tokens[start:start + batch_size]
            got = self.generate_batch(prompts[start:start + batch_size],
                                      max(batch_limits)).shape[1]
            useful += sum(min(limit, got) for limit in batch_limits)
        return useful

    def best_batch_size(self, prompts: list[list[int]], max_tokens: list[int],
                        candidates: tuple[int, ...] = BATCH_SIZE_CANDIDATES) -> int:
        """The candidate with the least predicted time for this workload.

        Running the workload once per candidate would cost more than the benchmark, so
        each candidate is timed on one small batch (its first requests, prompts cut to
        ``_SAMPLE_PROMPT_TOKENS``): prefill seconds per padded prompt token and seconds
        per decode step. The prediction then sums, over the workload's real arrival-order
        batches, padded prompt tokens times the first plus the batch's longest output
        times the second, so the padding each batch size causes is priced in.
        """
        sizes = sorted({min(c, len(prompts)) for c in candidates})
        best, best_time = sizes[0], float("inf")
        for size in sizes:
            sample = [p[-_SAMPLE_PROMPT_TOKENS:] for p in prompts[:size]]
            clock = _StepClock()
            start = time.perf_counter()
            self.generate_batch(sample, 1 + _SAMPLE_DECODE_STEPS, clock)
            prefill_per_token = (clock.stamps[0] - start) / (size * max(map(len, sample)))
            per_step = (clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1)
            predicted = 0.0
            for first in range(0, len(prompts), size):
                batch = prompts[first:first + size]
                predicted += prefill_per_token * len(batch) * max(map(len, batch))
                predicted += per_step * (max(max_tokens[first:first + size]) - 1)
            if predicted < best_time:
                best, best_time = size, predicted
        return best


def best_batch_size(prompts: list[list[int]], max_tokens: list[int],
                    candidates: tuple[int, ...] = BATCH_SIZE_CANDIDATES) -> int:
    """``StaticBatcher.best_batch_size`` with a model loaded for the purpose."""
    return StaticBatcher.load().best_batch_size(prompts, max_tokens, candidates)


def run(prompts: list[list[int]], max_tokens: list[int], concurrency: int | None) -> PeerResult:
    """Run the workload with batch size ``concurrency`` (None: ``best_batch_size``'s pick)."""
    batcher = StaticBatcher.load()
    batcher.generate_batch([prompts[0][:8]], 2)  # warmup: first-call allocations, kernels
    batch_size = concurrency or batcher.best_batch_size(prompts, max_tokens)
    start = time.perf_counter()
    useful = batcher.run(prompts, max_tokens, batch_size)
    elapsed = time.perf_counter() - start
    chosen = "given" if concurrency else "picked by best_batch_size, outside the timing"
    return PeerResult(
        name=NAME, num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
        output_tokens=useful, elapsed_s=elapsed, peak_rss_bytes=peak_rss_bytes(),
        notes=f"batch size {batch_size} ({chosen}), arrival-order static batches, left padding; "
              f"each batch generates its longest request's length, output_tokens counts only "
              f"each request's own max_tokens")
