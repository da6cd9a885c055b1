"""The offline benchmark's workloads: random token ids and exact output lengths from a seed.

Prompts are token ids, not text, so every engine sees exactly the same input without a
tokenizer in the way, and each request generates exactly its ``max_tokens`` (EOS is
ignored), so every engine produces the same number of tokens.

    workload = generate(WORKLOAD_A, n=256, seed=0, vocab_size=49152)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.peers.common import Workload

# Ids from here up: clear of the special tokens at the start of the vocabulary.
FIRST_ID = 100


@dataclass(frozen=True)
class Shape:
    """Lengths drawn uniformly (inclusive bounds); ``shared_prefix`` tokens start every prompt."""

    prompt_len: tuple[int, int]  # of each request's own part, after the shared prefix
    output_len: tuple[int, int]
    shared_prefix: int = 0

    @property
    def max_model_len(self) -> int:
        """The longest request the shape allows: what a server must be configured for."""
        return self.shared_prefix + self.prompt_len[1] + self.output_len[1]


WORKLOAD_A = Shape(prompt_len=(32, 512), output_len=(16, 256))  # chat-like
WORKLOAD_B = Shape(prompt_len=(16, 64), output_len=(64, 64), shared_prefix=400)  # system prompt
SWEEP = Shape(prompt_len=(32, 128), output_len=(32, 64))  # throughput against concurrency
# --quick: the same structure at smoke-test sizes.
QUICK = {"A": Shape((16, 64), (4, 16)), "B": Shape((8, 16), (8, 8), shared_prefix=64),
         "sweep": Shape((16, 32), (4, 8))}


def generate(shape: Shape, n: int, seed: int, vocab_size: int) -> Workload:
    """``n`` requests of ``shape``; the same seed gives the same workload, and a smaller
    ``n`` gives a prefix of a larger one."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids from {FIRST_ID} up")
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(FIRST_ID, vocab_size) for _ in range(count)]

    prefix = ids(shape.shared_prefix)
    prompts, max_tokens = [], []
    for _ in range(n):
        prompts.append(prefix + ids(rng.randint(*shape.prompt_len)))
        max_tokens.append(rng.randint(*shape.output_len))
    return Workload(prompts, max_tokens)


def sweep_size(concurrency: int, minimum: int = 16) -> int:
    """Requests at one sweep point: enough to keep ``concurrency`` busy twice over."""
    return max(2 * concurrency, minimum)
