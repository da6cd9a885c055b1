"""A host pool's stored block checksums stay true through every path that writes a block:
steps (whole and chunked prefill, decodes), forks, tier recalls, imports, int8 KV; and
so do its host tier's, through offloads. Every block is sealed first, so a path that
wrote without telling the store would leave a stale checksum behind, and the check after
each step would see it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster import SamplingParams
from kvcache.block_checksum import block_checksums
from kvcache.kv_transfer import KVTransferError
from kvcache.kv_transport import HandoffPlan, Transport
from kvcache.shm_transport import _slab_bytes, pool_checksums
from scheduler.protocol import ForkedSequence, NewSequence, StepPlan
from tests.workers.test_sparse_attention import REGIONS, make_llm, prompts
from tests.workers.test_worker import GREEDY, PROMPT, _step, _worker

SHM = HandoffPlan(Transport.SHARED_MEMORY, 1)


def assert_stored_are_fresh(runner) -> None:
    stores = [(runner.kv_checksums, runner.kv_caches)]
    if runner.host_checksums is not None:
        stores.append((runner.host_checksums, list(runner.long_context.host.kv.unbind(0))))
    for sums, kv in stores:
        everything = np.arange(kv[0].shape[1])
        stored = everything[sums.has(everything)]
        want = block_checksums(_slab_bytes(kv), stored)
        bad = stored[sums.of(stored) != want]
        assert bad.size == 0, f"stale checksums of blocks {bad.tolist()}"


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_stored_checksums_match_the_blocks_after_every_step(tiny_long_factory, kv_dtype):
    """Chunked prefills, decodes, n = 2 forks (the partial block copied) and offload mode
    (middle blocks recalled into recall blocks in every decode step; offloaded blocks
    take their pool block's checksum into the host tier's store)."""
    llm = make_llm(tiny_long_factory("llama").path, {**REGIONS, "top_k_percent": 0.2},
                   chunk=96, kv_dtype=kv_dtype)
    engine, runner = llm.engine, llm.engine.runner
    runner.kv_checksums = pool_checksums(runner.kv_caches)
    runner.kv_checksums.seal(np.arange(runner.num_blocks))
    host = runner.long_context.host
    runner.host_checksums = pool_checksums(list(host.kv.unbind(0)))
    runner.host_checksums.seal(np.arange(host.num_blocks))
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", None, p, SamplingParams(
            temperature=0.8, seed=i, max_tokens=40, ignore_eos=True, n=2 if i == 3 else 1))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        assert_stored_are_fresh(runner)
        steps += 1
    stats = runner.long_context.stats
    assert steps > 40 and stats.recalled_blocks > 0 and stats.offloaded_blocks > 0
    # The steps sealed blocks they filled: most of the pool has a checksum again.
    assert runner.kv_checksums.has(np.arange(runner.num_blocks)).mean() > 0.5


def test_a_fork_copies_the_checksum_with_the_block(tiny_factory):
    """The parent's blocks 0 and 2 are copied into 5 and 6, both sealed before with other
    bytes: 5 gets block 0's checksum, 6 none (block 2 is partial)."""
    worker = _worker(tiny_factory("llama").path)
    sums = worker.runner.kv_checksums
    _step(worker, StepPlan(0, new=[NewSequence("s", PROMPT, 40, 0, [0, 1, 2], 40, GREEDY)]))
    sums.seal([5, 6])
    forks = [ForkedSequence("c", "s", 1, [0, 1, 5], 7, copy_src=0, copy_dst=5),
             ForkedSequence("d", "s", 2, [0, 1, 6], 7, copy_src=2, copy_dst=6)]
    _step(worker, StepPlan(1, forks=forks))
    assert sums.has([5, 6]).tolist() == [True, False]
    assert_stored_are_fresh(worker.runner)


def test_a_prefill_step_seals_its_full_blocks_so_export_hashes_only_the_partial_one(
        tiny_factory):
    worker = _worker(tiny_factory("llama").path, "prefill")
    sums = worker.runner.kv_checksums
    _step(worker, StepPlan(0, new=[NewSequence("s", PROMPT, 40, 0, [4, 1, 6], 40, GREEDY)]))
    assert sums.has([4, 1, 6]).tolist() == [True, True, False]   # 16 + 16 + 8 tokens
    assert_stored_are_fresh(worker.runner)
    _, batch = worker.export_kv([4, 1, 6], [None] * 3, [16, 16, 8], SHM)
    assert batch.column("checksum").to_pylist() == block_checksums(
        _slab_bytes(worker.runner.kv_caches), [4, 1, 6]).tolist()


@pytest.mark.parametrize("plan", [SHM, HandoffPlan(Transport.OBJECT_STORE, 1)],
                         ids=["shm", "object-store"])
def test_an_import_stores_verified_checksums_or_drops_them(tiny_factory, plan):
    """Shared memory: the receiver keeps the checksums it verified; object store: it has
    none for those blocks (sealed before), and hashes them if it ever exports them."""
    path = tiny_factory("llama").path
    sender, receiver = _worker(path, "prefill"), _worker(path, "decode")
    _step(sender, StepPlan(0, new=[NewSequence("s", PROMPT, 40, 0, [0, 1, 2], 40, GREEDY)]))
    receiver.runner.kv_checksums.seal([7, 3, 9])
    _, *batches = sender.export_kv([0, 1, 2], [None] * 3, [16, 16, 8], plan)
    receiver.import_kv(batches[0], [7, 3, 9])
    kept = plan.transport is Transport.SHARED_MEMORY
    assert receiver.runner.kv_checksums.has([7, 3, 9]).tolist() == [kept] * 3
    assert_stored_are_fresh(receiver.runner)
    _, back = receiver.export_kv([7, 3, 9], [None] * 3, [16, 16, 8], SHM)
    assert back.column("checksum").to_pylist() == batches[0].column("checksum").to_pylist() \
        if kept else block_checksums(_slab_bytes(sender.runner.kv_caches), [0, 1, 2]).tolist()


def test_a_block_changed_behind_the_stores_back_is_refused_not_trusted(tiny_factory):
    """A write that skipped the store (a missed path) leaves a stale checksum: the receiver
    refuses the handoff (the scheduler recomputes); once the write is known, export hashes
    the block again and the handoff goes through."""
    path = tiny_factory("llama").path
    sender, receiver = _worker(path, "prefill"), _worker(path, "decode")
    _step(sender, StepPlan(0, new=[NewSequence("s", PROMPT, 40, 0, [0, 1, 2], 40, GREEDY)]))
    sender.runner.kv_caches[1][0, 1].view(torch.uint8).view(-1)[5] ^= 0x01
    _, batch = sender.export_kv([0, 1, 2], [None] * 3, [16, 16, 8], SHM)
    with pytest.raises(KVTransferError, match=r"KV block 1 \(sender block 1\).*checksum"):
        receiver.import_kv(batch, [7, 3, 9])
    sender.runner.kv_checksums.written([1])
    _, batch = sender.export_kv([0, 1, 2], [None] * 3, [16, 16, 8], SHM)
    receiver.import_kv(batch, [7, 3, 9])
    for src, dst in zip(sender.runner.kv_caches, receiver.runner.kv_caches):
        assert torch.equal(src[:, [0, 1, 2]], dst[:, [7, 3, 9]])
