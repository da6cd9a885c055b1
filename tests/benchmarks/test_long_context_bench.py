"""The long-context benchmark's parts on small inputs: the figures it reports are the
ones it claims (bound, attended tokens, capacity), so a run's table can be trusted."""

from __future__ import annotations

from benchmarks.long_context import attention_speed, capacity
from kvcache.long_context import LongContextConfig

SMALL = LongContextConfig(enabled=True, initial_tokens=128, local_tokens=512,
                          retrieval_block_size=128, top_k_percent=0.25, dense_boundary=1024,
                          offload_boundary=1024)


def test_attention_speed_reports_the_bound_of_the_tokens_attended():
    r = attention_speed(4096, 2, SMALL, layers=2, repeats=1)
    # 4096 tokens: 128 initial, local from 3584 (512 tokens), 26 middle blocks of which
    # ceil(0.25 * 26) = 7 are attended: 128 + 7 * 128 + 512 = 1536 tokens.
    assert r["bound"] == 4096 / 1536
    assert r["dense_ms"] > 0 and r["sparse_ms"] > r["layout_ms"] > 0
    assert r["speedup"] == r["dense_ms"] / r["sparse_ms"]


def test_capacity_counts_sequences_decoding_at_once():
    dense = capacity(4096, 2, None, 8, max_tokens=512)
    tiered = capacity(4096, 2, SMALL, 8, max_tokens=512)
    assert dense == {"decoding": 2, "preemptions": 0}
    # Offloaded, a sequence keeps 128 initial tokens, a local window of 512 to 640 tokens
    # and at most 8 recalled blocks of 128 on the device: under 1800 of its up to 4608
    # tokens, so at least twice as many decode in the same pool.
    assert tiered["decoding"] >= 2 * dense["decoding"]
