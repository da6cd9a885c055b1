"""Sparse and offloaded sequences across a prefill/decode handoff on a real local Ray
instance: the 1P+1D cluster must give the one-process engine's greedy tokens.

The prefill worker prefills densely and hands the blocks over; the decode worker
recomputes the block summaries from the received keys, switches the sequence to its
mode, offloads the middle blocks to its host tier, and selects and recalls blocks
exactly as the one-process engine does. A drained decode worker sends an offloaded
sequence on with its middle read from its host tier.
"""

from __future__ import annotations

import pytest

from cluster import LLM
from cluster.cluster_engine import ClusterEngine
from cluster.config import config_from_dict
from tests.cluster.test_ray_cluster import GREEDY, _run, _wait_idle
from tests.workers.test_sparse_attention import REGIONS, prompts

pytestmark = pytest.mark.slow


def _config(path: str, offload_boundary: int, pools: list[dict] | None = None):
    data = {"model": {"path": path}, "cache": {"kv_cache_bytes": 4 << 20},
            "long_context": {**REGIONS, "top_k_percent": 0.2,
                             "offload_boundary": offload_boundary}}
    if pools:
        data["cluster"] = {"name": f"long-{offload_boundary}", "pools": pools,
                           "prefill_threshold": 16, "max_prefill_queue_tokens": None}
    return config_from_dict(data)


@pytest.mark.parametrize("offload_boundary", [2048, 384], ids=["sparse", "offload"])
def test_1p1d_matches_one_process(ray_instance, tiny_long_factory, offload_boundary):
    path = tiny_long_factory("llama").path
    llm = LLM(config=_config(path, offload_boundary))
    local = [o.outputs[0].token_ids for o in
             llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY)]
    engine = ClusterEngine(_config(path, offload_boundary, [
        {"role": "prefill", "resources": {"CPU": 0.5}},
        {"role": "decode", "resources": {"CPU": 0.5}}]))
    try:
        assert _run(engine, prompts()) == local
        decode = next(w for w in _wait_idle(engine).workers if w.role == "decode")
        assert decode.kv_received.count >= 3
        assert decode.tiers.host_used == 0   # every sequence finished: both tiers free
        tier = decode.tier_stats
        assert tier.selections > 0
        if offload_boundary == 384:
            # The 420-token prompt's middle went straight to the host tier: 421 tokens at
            # its first decode leave blocks 2..21 (32 initial tokens, local from 352).
            assert tier.received_blocks == 20 and tier.recalled_blocks > 0
    finally:
        engine.shutdown()


def test_a_drained_decode_worker_moves_its_offloaded_sequence(ray_instance,
                                                              tiny_long_factory):
    """1 prefill + 2 decode workers; once a decode worker holds a sequence in offload
    mode it is removed, and that sequence moves with its middle read from the worker's
    host tier (in a shared segment, as its pool is: one node). The texts stay the
    one-process engine's."""
    path = tiny_long_factory("llama").path
    llm = LLM(config=_config(path, 384))
    local = [o.outputs[0].token_ids for o in
             llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY)]
    engine = ClusterEngine(_config(path, 384, [
        {"role": "prefill", "resources": {"CPU": 0.5}},
        {"role": "decode", "count": 2, "resources": {"CPU": 0.5}}]))
    removed: list[str] = []

    def remove_one_with_an_offloaded_sequence(seen: int) -> None:
        if removed:
            return
        for w in engine.stats().workers:
            if w.role == "decode" and w.tiers is not None and w.tiers.offloaded_seqs:
                removed.append(w.worker_id)
                engine.pools.remove(w.worker_id)
                return

    try:
        assert _run(engine, prompts(), on_output=remove_one_with_an_offloaded_sequence) == local
        assert removed, "no decode worker held an offloaded sequence"
        engine.pools.wait_gone(removed[0], 60.0)
        stats = _wait_idle(engine)
        assert stats.num_migrated >= 1 and stats.num_recovered == 0
        (peer,) = [w for w in stats.workers if w.role == "decode"]
        assert peer.kv_received.failures == 0
        assert peer.kv_received.transports.get("shm", 0) >= 1
        assert "object_store" not in peer.kv_received.transports
        assert peer.tiers.host_used == 0
    finally:
        engine.shutdown()
