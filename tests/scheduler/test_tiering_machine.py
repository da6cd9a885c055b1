"""The two tiers' bookkeeping after every step of random workloads: a hypothesis state
machine over the scheduler of ``tiering_harness`` (adds across the three modes, steps,
aborts, handoffs away, finishing by ``max_tokens``, preemption under a small device pool
and host tier, prefix caching on and off).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.tiering import TierPlanner
from tests.scheduler.tiering_harness import (
    BS,
    HOST_BLOCKS,
    NUM_BLOCKS,
    OFFLOAD_B,
    Driver,
    check_invariants,
    long_config,
    make,
    prompt,
    sampling,
)


def _host_limit(host_blocks: int) -> int:
    """Longest context whose middle fits the whole host tier."""
    tp = TierPlanner(long_config(), KVCacheManager(1, BS), host_blocks)
    n = 1
    while tp.host_blocks_for(n + 1) <= host_blocks:
        n += 1
    return n


HOST_LIMIT = _host_limit(HOST_BLOCKS)   # 767 tokens; the pool holds 1280

PROMPT_CLASSES = [(1, 250), (200, OFFLOAD_B - 1), (OFFLOAD_B, HOST_LIMIT - 1)]


class TieringMachine(RuleBasedStateMachine):
    CACHING = False

    @initialize(budget=st.sampled_from([64, 256, 2048]), policy=st.sampled_from(["fcfs",
                                                                                 "priority"]))
    def setup(self, budget, policy):
        self.d = Driver(make(caching=self.CACHING, max_num_batched_tokens=budget,
                             max_num_seqs=8, policy=policy))
        self.next_id = 0

    @precondition(lambda self: hasattr(self, "d") and len(self.d.sched.seqs) < 10)
    @rule(cls=st.integers(0, len(PROMPT_CLASSES) - 1), frac=st.floats(0, 1),
          max_tokens=st.integers(1, 80), family=st.integers(0, 2), two=st.booleans(),
          priority=st.integers(0, 2))
    def add(self, cls, frac, max_tokens, family, two, priority):
        lo, hi = PROMPT_CLASSES[cls]
        n = lo + int(frac * (hi - lo))
        max_tokens = max(1, min(max_tokens, HOST_LIMIT - n))
        # n = 2 only below the offload boundary (test_fork_after_a_one_token_last_chunk).
        rid = f"r{self.next_id}"
        self.next_id += 1
        by_priority = self.d.sched.config.policy == "priority"   # fcfs refuses one
        self.d.sched.add(rid, prompt(n, family),
                         sampling(max_tokens, 2 if two and n < OFFLOAD_B else 1),
                         priority if by_priority else 0)
        self.d.all_ids.add(rid)

    @precondition(lambda self: hasattr(self, "d"))
    @rule(k=st.integers(1, 40))
    def step(self, k):
        for _ in range(k):
            if not self.d.sched.has_unfinished():
                break
            self.d.step()
            check_invariants(self.d)

    @precondition(lambda self: hasattr(self, "d") and self.d.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.d.sched.requests)))
        updates = self.d.sched.abort(rid)
        assert updates and all(u.finish_reason == "abort" for u in updates)

    @precondition(lambda self: hasattr(self, "d") and any(
        s.num_tokens - s.num_computed_tokens == 1 for s in self.d.sched.running))
    @rule(data=st.data())
    def hand_off(self, data):
        """A decoding sequence leaves as ``Handoff`` takes it: its host blocks are lent to
        the export (they are its table's -1 entries) and stay taken after it is
        detached, until the export is done; then both tiers free them."""
        sched = self.d.sched
        seq = data.draw(st.sampled_from(sorted(
            (s for s in sched.running if s.num_tokens - s.num_computed_tokens == 1),
            key=lambda s: s.seq_id)))
        lent = sched.tiers.lend_host_blocks(seq.seq_id)
        at, ids = (lent.first, lent.block_ids) if lent else (0, [])
        table = sched.kv.block_ids(seq.seq_id)
        assert [i for i, b in enumerate(table) if b == -1] == list(range(at, at + len(ids)))
        used = sched.tiers.host.num_used_blocks
        sched.detach(seq.seq_id)
        assert sched.tiers.host.num_used_blocks == used
        sched.kv.free(seq.seq_id)
        if lent is not None:
            sched.tiers.free_lent(lent)
        assert sched.tiers.host.num_used_blocks == used - len(ids)

    @invariant()
    def consistent(self):
        if hasattr(self, "d"):
            check_invariants(self.d)

    def teardown(self):
        if not hasattr(self, "d"):
            return
        sched = self.d.sched
        for rid in list(sched.requests):
            sched.abort(rid)
        check_invariants(self.d)
        assert not sched.has_unfinished()
        assert sched.kv.pool.num_free_blocks == NUM_BLOCKS
        assert sched.tiers.host.num_free_blocks == HOST_BLOCKS
        assert not sched.tiers._seqs and not sched.kv._seqs
        plan = self.d.step()             # the drops reach the worker
        assert not plan.tiers and not self.d.worker.seqs


class TieringMachineCaching(TieringMachine):
    CACHING = True


_SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None,
                     derandomize=True)
TestTieringMachine = TieringMachine.TestCase
TestTieringMachine.settings = _SETTINGS
TestTieringMachineCaching = TieringMachineCaching.TestCase
TestTieringMachineCaching.settings = _SETTINGS
