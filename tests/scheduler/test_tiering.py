"""Long-context modes and the host tier, scheduler side (``TierPlanner`` inside
``BatchScheduler``), with no model.

A mirror worker builds its view of every sequence only from the plans (tables from
``new`` / ``continued`` / ``forks``, tiers from ``TierChange``), in the model runner's
order, and samples one fixed token for each sequence whose known tokens are all
computed. Unit tests check where modes switch and which blocks move to the host tier;
a hypothesis state machine checks the two tiers' bookkeeping after every step of random
workloads (adds across the three modes, steps, aborts, finishing by ``max_tokens``,
preemption under a small device pool and host tier, prefix caching on and off).
The last two tests pin down two edge cases: a prompt that ends with a one-token chunk
and forks, and a request longer than the host tier can hold.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvcache.kv_cache_manager import KVCacheManager
from kvcache.long_context import KVMode, LongContextConfig
from scheduler.batch_scheduler import BatchScheduler
from scheduler.config import SchedulerConfig
from scheduler.protocol import (
    SamplingParams,
    SequenceOutput,
    StepOutput,
    StepPlan,
    TierChange,
    decode,
    encode,
)
from scheduler.sequence import SeqStatus, Sequence
from scheduler.tiering import TierPlanner

BS = 16
EOS = 2
TOKEN = 7  # every sampled token (not EOS; requests also ignore EOS)
DENSE_B, OFFLOAD_B = 256, 384
NUM_BLOCKS, HOST_BLOCKS = 80, 40


def long_config() -> LongContextConfig:
    return LongContextConfig(enabled=True, initial_tokens=32, local_tokens=64,
                             retrieval_block_size=32, dense_boundary=DENSE_B,
                             offload_boundary=OFFLOAD_B, top_k_percent=0.25)


CFG = long_config()
PER_BLOCK = CFG.retrieval_block_size // BS


def make(num_blocks: int = NUM_BLOCKS, host_blocks: int = HOST_BLOCKS, caching: bool = False,
         **sched_cfg) -> BatchScheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    tiers = TierPlanner(long_config(), kv, host_blocks)
    sched_cfg.setdefault("max_num_batched_tokens", 2048)
    # As the engine does: max_model_len capped by what the device pool holds.
    return BatchScheduler(SchedulerConfig(**sched_cfg), kv, num_blocks * BS, [EOS], tiers)


def prompt(length: int, family: int = 0) -> list[int]:
    """Prompts of one family share every prefix (prefix-cache hits)."""
    return [(family * 7919 + i * 31) % 89 + 3 for i in range(length)]


def sampling(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)


# ---- the mirror worker ------------------------------------------------------------
class MirrorTier:
    def __init__(self, mode: int) -> None:
        self.mode = mode
        self.host_first = 0
        self.host_ids: list[int] = []
        self.recall_ids: list[int] = []


class MirrorWorker:
    """The worker's state, from plans only; checks each tier change as it applies it."""

    def __init__(self) -> None:
        self.seqs: dict[str, dict] = {}
        self.tiers: dict[str, MirrorTier] = {}
        # Per sequence since its last (re)admission: the device ids that moved to the host
        # tier, by table index, and every change with the context length of its step.
        self.moved: dict[str, dict[int, int]] = {}
        self.log: list[tuple[int, str, int, TierChange]] = []

    def execute(self, plan: StepPlan, sched: BatchScheduler) -> StepOutput:
        plan = decode(StepPlan, encode(plan))
        for f in plan.forks:
            parent = self.seqs[f.parent_id]
            self.seqs[f.seq_id] = dict(tokens=parent["tokens"][:-1] + [f.first_token],
                                       prompt=parent["prompt"], done=parent["done"],
                                       blocks=list(f.block_ids), n=parent["n"])
            self.moved[f.seq_id] = {}
        for sid in plan.finished:
            self.seqs.pop(sid)
            self.tiers.pop(sid, None)
        run = []
        for s in plan.new:
            assert s.seq_id not in self.seqs, "new sequence already held"
            self.seqs[s.seq_id] = dict(tokens=list(s.token_ids), prompt=s.num_prompt_tokens,
                                       done=s.num_computed_tokens, blocks=list(s.block_ids),
                                       n=s.sampling.n)
            self.moved[s.seq_id] = {}
            run.append((s.seq_id, s.num_scheduled_tokens))
        sched_ctx = {sid: sched.seqs[sid].num_computed_tokens for sid in self.seqs
                     if sid in sched.seqs}
        for c in plan.tiers:
            self._apply_tier(c)
            self.log.append((plan.step_id, c.seq_id, sched_ctx[c.seq_id], c))
        for c in plan.continued:
            self.seqs[c.seq_id]["blocks"] += c.new_block_ids
            run.append((c.seq_id, c.num_scheduled_tokens))
        outputs = []
        for sid, n in run:
            st_ = self.seqs[sid]
            assert 1 <= n <= len(st_["tokens"]) - st_["done"]
            st_["done"] += n
            assert len(st_["blocks"]) * BS >= st_["done"], "too few blocks for the KV"
            if st_["done"] == len(st_["tokens"]):
                fan = st_["n"] if len(st_["tokens"]) == st_["prompt"] else 1
                toks = [TOKEN + k for k in range(fan)]
                st_["tokens"].append(toks[0])
                outputs.append(SequenceOutput(sid, toks))
        return decode(StepOutput, encode(StepOutput(plan.step_id, outputs)))

    def _apply_tier(self, c: TierChange) -> None:
        assert c.seq_id in self.seqs, "tier change for a sequence the worker does not hold"
        t = self.tiers.get(c.seq_id)
        if t is None:
            t = self.tiers[c.seq_id] = MirrorTier(c.mode)
        assert c.mode >= t.mode, "a sequence's mode went back"
        t.mode = c.mode
        assert len(c.offload_block_ids) == len(c.host_block_ids)
        if c.host_block_ids:
            assert c.mode == KVMode.OFFLOAD
            if not t.host_ids:
                t.host_first = c.first_offloaded
            assert c.first_offloaded == t.host_first + len(t.host_ids), \
                "offloaded blocks are not contiguous with the ones already on the host"
            table = self.seqs[c.seq_id]["blocks"]
            first, n = c.first_offloaded, len(c.host_block_ids)
            assert table[first:first + n] == c.offload_block_ids, \
                "offload_block_ids are not the table's blocks from first_offloaded on"
            assert min(c.offload_block_ids) >= 0
            for i, b in enumerate(c.offload_block_ids):
                assert first + i not in self.moved[c.seq_id], "a block offloaded twice"
                self.moved[c.seq_id][first + i] = b
            table[first:first + n] = [-1] * n
            t.host_ids.extend(c.host_block_ids)
        t.recall_ids.extend(c.recall_block_ids)


def decode_like(sched: BatchScheduler, sid: str, n: int) -> bool:
    """Whether this scheduled sequence ran a decode: one token, its last, after its prompt.

    A prompt's last chunk of one token runs like a decode too, on the worker and (today)
    in ``_grow``; ``one_token_tail`` tells those apart."""
    seq = sched.seqs[sid]
    before = seq.num_computed_tokens - n
    return n == 1 and seq.num_prompt_tokens <= before == seq.num_tokens - 1


def one_token_tail(sched: BatchScheduler, sid: str, n: int) -> bool:
    seq = sched.seqs[sid]
    before = seq.num_computed_tokens - n
    return n == 1 and 0 < before == seq.num_tokens - 1 < seq.num_prompt_tokens


class Driver:
    """A scheduler, its mirror worker, and which running sequences decoded since their
    (re)admission (only those have had their tiers prepared), or ran a one-token last
    prompt chunk (which may or may not prepare them)."""

    def __init__(self, sched: BatchScheduler) -> None:
        self.sched = sched
        self.worker = MirrorWorker()
        self.decoded: set[str] = set()
        self.tail: set[str] = set()
        self.all_ids: set[str] = set()
        self.outputs: dict[str, list[int]] = {}

    def add(self, rid: str, tokens: list[int], params: SamplingParams) -> None:
        self.sched.add(rid, tokens, params)
        self.all_ids.add(rid)

    def step(self, on_plan=None) -> StepPlan:
        sched = self.sched
        plan = sched.schedule()
        assert not sched.tiers._pending, "tier changes left out of the plan"
        for s in plan.new:
            self.decoded.discard(s.seq_id)
            self.tail.discard(s.seq_id)
        for s in plan.continued:
            if decode_like(sched, s.seq_id, s.num_scheduled_tokens):
                self.decoded.add(s.seq_id)
            if one_token_tail(sched, s.seq_id, s.num_scheduled_tokens):
                self.tail.add(s.seq_id)
        for sid in plan.finished:
            self.decoded.discard(sid)
            self.tail.discard(sid)
        if on_plan:
            on_plan(plan)
        for u in sched.update(self.worker.execute(plan, sched)):
            self.all_ids.add(u.seq_id)
            self.outputs.setdefault(u.seq_id, []).extend(u.new_token_ids)
        return plan


# ---- the invariants ---------------------------------------------------------------
def check_invariants(d: Driver) -> None:
    sched, worker = d.sched, d.worker
    kv, tiers = sched.kv, sched.tiers
    pool, host = kv.pool, tiers.host
    running = {s.seq_id for s in sched.running}
    assert all(s.status is SeqStatus.RUNNING for s in sched.running)

    # Who holds anything: the planner only running sequences, the KV manager only live
    # ones; waiting (preempted) sequences hold no block of either tier.
    assert set(tiers._seqs) <= running, "a sequence that is not running holds tier state"
    assert set(kv._seqs) <= set(sched.seqs), "a finished sequence kept a block table"
    for sid, seq in sched.seqs.items():
        if seq.status is not SeqStatus.RUNNING:
            e = kv._seqs.get(sid)
            assert e is None or (not e.block_ids and not e.extra_ids), \
                f"waiting sequence {sid} holds device blocks"
    for sid in d.all_ids - set(sched.seqs):
        assert sid not in kv._seqs and sid not in tiers._seqs, f"finished {sid} holds blocks"

    # Host tier: used == held by the planner's sequences, each block by one sequence.
    held_host = Counter(h for t in tiers._seqs.values() for h in t.host_ids)
    assert all(c == 1 for c in held_host.values()), "a host block held twice"
    assert host.num_used_blocks == sum(held_host.values())
    assert all(host.ref_count(h) == 1 for h in held_host)
    assert set(host.free_block_ids()) == set(range(host.num_blocks)) - set(held_host)

    # Device pool: every ref count is the number of references in tables and recall
    # caches; the free list is exactly the unreferenced blocks.
    refs: Counter[int] = Counter()
    for e in kv._seqs.values():
        refs.update(b for b in e.block_ids if b >= 0)
        refs.update(e.extra_ids)
    assert all(b >= -1 for e in kv._seqs.values() for b in e.block_ids)
    for b in range(pool.num_blocks):
        assert pool.ref_count(b) == refs[b], f"block {b}: ref count vs references"
    assert set(pool.free_block_ids()) == {b for b in range(pool.num_blocks) if not refs[b]}
    assert pool.num_used_blocks == len(refs)
    for e in kv._seqs.values():
        assert all(refs[b] == 1 for b in e.extra_ids), "a recall block is shared"

    for sid in running:
        seq = sched.seqs[sid]
        table = kv.block_ids(sid)
        e = kv._seqs[sid]
        t = tiers._seqs.get(sid)
        ctx = seq.num_computed_tokens
        assert len(table) >= kv.num_blocks_needed(ctx)
        # Each block of the sequence is in exactly one tier.
        lo, hi = (t.host_first, t.host_first + len(t.host_ids)) if t and t.host_ids else (0, 0)
        assert hi <= kv.num_blocks_needed(ctx)
        for i, b in enumerate(table):
            assert (b == -1) == (lo <= i < hi), f"{sid} block {i}: device {b}, host [{lo},{hi})"
        # Its mode is the one its context calls for, once it has decoded.
        mode = t.mode if t else KVMode.DENSE
        if sid in d.decoded:
            assert mode == CFG.mode(ctx), f"{sid} at {ctx} tokens is in {mode!r}"
        elif sid in d.tail:
            assert t is None or mode == CFG.mode(ctx), f"{sid} at {ctx} tokens is in {mode!r}"
        else:
            assert t is None, f"{sid} has tier state before its first decode"
        if mode == KVMode.OFFLOAD:
            lay = CFG.layout(ctx)
            assert (lo, hi) == (lay.init_end // BS, lay.local_start // BS)
            assert t.num_recall == len(e.extra_ids) == lay.top_k * PER_BLOCK
        else:
            assert not e.extra_ids and (t is None or not t.host_ids)
        # The worker's view agrees with the scheduler's.
        w = worker.seqs.get(sid)
        if w is not None:
            assert w["blocks"] == table, f"{sid}: worker and scheduler tables differ"
            wt = worker.tiers.get(sid)
            if t is None:
                assert wt is None
            else:
                assert wt is not None and wt.mode == t.mode
                assert wt.host_ids == t.host_ids
                if t.host_ids:
                    assert wt.host_first == t.host_first
                assert wt.recall_ids == e.extra_ids
                assert sorted(worker.moved[sid]) == list(range(lo, hi))
    # The worker holds only running sequences and those whose drop is still to be sent.
    assert set(worker.seqs) <= running | set(sched._drops)


def run(d: Driver, max_steps: int = 3000, on_plan=None, check: bool = True) -> None:
    for _ in range(max_steps):
        if not d.sched.has_unfinished():
            return
        d.step(on_plan)
        if check:
            check_invariants(d)


# ---- unit tests ---------------------------------------------------------------------
@pytest.mark.parametrize("budget", [2048, 64])
@pytest.mark.parametrize("prompt_len,max_tokens", [
    (200, 200),   # dense, then sparse at 256, then offload at 384
    (255, 3),     # the first decode reaches 256
    (256, 3),     # starts at the boundary: sparse from its first decode (257)
    (300, 100),   # sparse from the first decode, offload at 384
    (383, 3),     # dense straight to offload at the first decode (384)
    (500, 5),     # offload from the first decode
])
def test_modes_switch_exactly_at_the_boundaries(prompt_len, max_tokens, budget):
    d = Driver(make(max_num_batched_tokens=budget))
    d.add("s", prompt(prompt_len), sampling(max_tokens))
    d.add("short", prompt(40, 1), sampling(max_tokens + 5))  # a dense neighbour
    decode_ctx: dict[int, int] = {}      # step id -> context of the decode of "s"
    prefill_steps: list[int] = []

    def on_plan(plan):
        for c in plan.continued:
            if c.seq_id == "s" and decode_like(d.sched, "s", c.num_scheduled_tokens):
                decode_ctx[plan.step_id] = d.sched.seqs["s"].num_computed_tokens
        if any(s.seq_id == "s" for s in plan.new) or any(
                c.seq_id == "s" and c.num_scheduled_tokens > 1 for c in plan.continued):
            prefill_steps.append(plan.step_id)

    modes_seen: dict[int, int] = {}

    def step_and_check():
        plan = d.step(on_plan)
        if plan.step_id in decode_ctx:
            t = d.worker.tiers.get("s")
            modes_seen[decode_ctx[plan.step_id]] = t.mode if t else KVMode.DENSE
        check_invariants(d)

    while d.sched.has_unfinished():
        step_and_check()

    ctxs = sorted(decode_ctx.values())
    assert ctxs == list(range(prompt_len + 1, prompt_len + max_tokens))
    for c, m in modes_seen.items():
        assert m == CFG.mode(c), f"context {c}: worker mode {m}"
    changes = [(step, ctx, c) for step, sid, ctx, c in d.worker.log if sid == "s"]
    assert all(step in decode_ctx for step, _, _ in changes), "tier change outside a decode"
    assert not any(step in prefill_steps for step, _, _ in changes)
    assert all(ctx == decode_ctx[step] for step, ctx, _ in changes)
    first_of = {}
    for _, ctx, c in changes:
        first_of.setdefault(c.mode, ctx)
    start = prompt_len + 1
    last = prompt_len + max_tokens - 1
    expect = {}
    if CFG.mode(start) == KVMode.SPARSE or (start < DENSE_B <= last):
        expect[KVMode.SPARSE] = max(DENSE_B, start)
    if last >= OFFLOAD_B:
        expect[KVMode.OFFLOAD] = max(OFFLOAD_B, start)
    assert first_of == expect
    # A change at a context whose mode did not change only grows the tiers.
    prev = KVMode.DENSE
    for _, _ctx, c in changes:
        if c.mode == prev:
            assert c.host_block_ids or c.recall_block_ids
        prev = c.mode
    assert "short" not in {sid for _, sid, _, _ in d.worker.log}
    assert d.sched.kv.pool.num_used_blocks == 0 and d.sched.tiers.host.num_used_blocks == 0


@pytest.mark.parametrize("caching", [False, True])
def test_offloaded_blocks_are_exactly_the_middle_ones_in_order(caching):
    d = Driver(make(caching=caching))
    d.add("s", prompt(300), sampling(400))
    before: list[int] = []
    original: dict[int, int] = {}   # table index -> device block it held before offload
    changes: list[TierChange] = []

    def on_plan(plan):
        for c in plan.tiers:
            if c.seq_id == "s":
                changes.append(c)
                first = c.first_offloaded
                assert c.offload_block_ids == before[first:first + len(c.offload_block_ids)]
                for i, b in enumerate(c.offload_block_ids):
                    assert first + i not in original
                    original[first + i] = b

    while d.sched.seqs["s"].num_computed_tokens < 600:
        before = list(d.sched.kv.block_ids("s"))
        d.step(on_plan)
        check_invariants(d)
        ctx = d.sched.seqs["s"].num_computed_tokens
        if CFG.mode(ctx) == KVMode.OFFLOAD:
            t = d.sched.tiers._seqs["s"]
            assert t.num_recall == CFG.layout(ctx).top_k * PER_BLOCK

    ctx = d.sched.seqs["s"].num_computed_tokens
    lay = CFG.layout(ctx)
    lo, hi = lay.init_end // BS, lay.local_start // BS
    assert (lo, hi) == (2, 32)
    table = d.sched.kv.block_ids("s")
    assert len(table) == -(-ctx // BS)
    assert [i for i, b in enumerate(table) if b == -1] == list(range(lo, hi))
    assert all(b >= 0 for i, b in enumerate(table) if not lo <= i < hi)
    # Each middle block listed once, in order, with the right first_offloaded.
    offloaded = [b for c in changes for b in c.offload_block_ids]
    assert offloaded == [original[i] for i in range(lo, hi)]
    assert sorted(original) == list(range(lo, hi))   # each table index once (a device
    # block freed by one offload may come back as a new local block and leave again)
    end = lo
    for c in changes:
        if c.host_block_ids:
            assert c.first_offloaded == end
            end += len(c.host_block_ids)
    assert end == hi
    host = [h for c in changes for h in c.host_block_ids]
    t = d.sched.tiers._seqs["s"]
    assert host == t.host_ids and len(set(host)) == hi - lo
    assert d.sched.tiers.host.num_used_blocks == hi - lo
    recall = [b for c in changes for b in c.recall_block_ids]
    assert recall == d.sched.kv._seqs["s"].extra_ids
    assert len(recall) == lay.top_k * PER_BLOCK == 8    # top_k grows 3 -> 4 at 512
    assert not set(recall) & {b for b in table if b >= 0}
    # The first offload step carries the whole middle so far; later ones one retrieval
    # block at a time as the local window moves on.
    first_off = next(c for c in changes if c.host_block_ids)
    assert first_off.first_offloaded == lo
    assert len(first_off.host_block_ids) == (CFG.layout(OFFLOAD_B).local_start // BS) - lo
    assert all(len(c.host_block_ids) in (0, PER_BLOCK) for c in changes[changes.index(
        first_off) + 1:])
    d.sched.abort("s")
    assert d.sched.kv.pool.num_used_blocks == 0 and d.sched.tiers.host.num_used_blocks == 0
    assert not d.sched.tiers._seqs


def test_preempted_sequence_frees_both_tiers_and_offloads_anew_after_recompute():
    d = Driver(make())
    d.add("a", prompt(450), sampling(100))
    for _ in range(5):
        d.step()
    seq = d.sched.seqs["a"]
    assert d.sched.tiers._seqs["a"].mode == KVMode.OFFLOAD
    assert d.sched.tiers.host.num_used_blocks > 0
    d.sched._preempt(seq)
    check_invariants(d)
    assert d.sched.kv.pool.num_used_blocks == 0 and d.sched.tiers.host.num_used_blocks == 0
    assert "a" not in d.sched.tiers._seqs and d.sched.kv.block_ids("a") == []
    plan = d.step()                      # the drop and the recompute in one plan
    assert plan.finished == ["a"] and [s.seq_id for s in plan.new] == ["a"]
    assert not plan.tiers and -1 not in plan.new[0].block_ids
    check_invariants(d)
    plan = d.step()                      # first decode after the recompute
    (c,) = plan.tiers
    lay = CFG.layout(seq.num_computed_tokens)
    assert c.mode == KVMode.OFFLOAD and c.first_offloaded == lay.init_end // BS
    assert len(c.host_block_ids) == lay.local_start // BS - lay.init_end // BS
    assert len(c.recall_block_ids) == lay.top_k * PER_BLOCK
    check_invariants(d)
    run(d)
    assert d.outputs["a"] == [TOKEN] * 100


def test_admission_waits_for_host_room():
    d = Driver(make(host_blocks=30))
    d.add("a", prompt(500), sampling(20))     # 24..26 host blocks while it runs
    d.step()
    d.step()                                  # "a" is offloaded
    d.add("b", prompt(500, 1), sampling(20))  # needs 24 more: waits for "a"
    seen_together = []
    run(d, on_plan=lambda p: seen_together.append(
        {"a", "b"} <= {s.seq_id for s in d.sched.running}))
    assert not any(seen_together)
    assert d.outputs == {"a": [TOKEN] * 20, "b": [TOKEN] * 20}
    assert d.sched.num_preemptions == 0


def test_host_shortage_preempts_and_every_request_still_finishes():
    d = Driver(make(host_blocks=40, max_num_batched_tokens=512))
    # Each fits alone (at most 40 host blocks at 767 tokens), not all three together.
    for i, (p, m) in enumerate([(400, 300), (390, 300), (450, 250)]):
        d.add(str(i), prompt(p, i), sampling(m))
    run(d)
    assert d.sched.num_preemptions > 0
    assert {k: len(v) for k, v in d.outputs.items()} == {"0": 300, "1": 300, "2": 250}


# ---- the state machine ------------------------------------------------------------
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
        self.d.sched.add(rid, prompt(n, family),
                         sampling(max_tokens, 2 if two and n < OFFLOAD_B else 1), priority)
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


# ---- edge cases ---------------------------------------------------------------------
def test_fork_after_a_one_token_last_chunk_gets_whole_device_blocks():
    """An ``n > 1`` prompt at or above ``offload_boundary`` whose last prefill chunk is one
    token: that chunk is not a decode for the tiers (the children fork right after it
    and share the parent's device blocks), so nothing is offloaded before the fork, and
    each child then offloads on its own first decode."""
    d = Driver(make(max_num_batched_tokens=OFFLOAD_B + 15))
    d.add("r", prompt(OFFLOAD_B + 16), sampling(3, n=2))
    d.step()                                  # prefill chunk of 399 tokens
    d.step()                                  # last chunk: 1 token, then the fork
    check_invariants(d)
    child = d.sched.kv.block_ids("r#1")
    t = d.sched.tiers._seqs.get("r#1")
    assert -1 not in child or (t is not None and t.host_ids), \
        "the child's table points at host blocks it does not hold"


@pytest.mark.parametrize("prompt_len,max_tokens", [
    (900, 4),     # its prompt alone needs 50 host blocks of 40
    (300, 600),   # grows past what the host tier holds (768 tokens)
])
def test_request_longer_than_the_host_tier_holds_never_stalls_others(prompt_len, max_tokens):
    """The scheduler's max_model_len is capped where a sequence's middle would outgrow the
    whole host tier: a longer prompt is refused at once, a growing sequence ends with
    ``length`` there, and requests queued behind either still run."""
    d = Driver(make(host_blocks=HOST_BLOCKS))
    # 40 host blocks of 16 tokens hold 20 middle blocks of 32: with 32 initial and 64
    # local tokens, contexts up to 64 + (20 + 1 + 1) * 32 - 1 = 767 tokens fit.
    assert d.sched.max_model_len == 767
    if prompt_len >= d.sched.max_model_len:
        with pytest.raises(ValueError, match="max_model_len"):
            d.add("long", prompt(prompt_len), sampling(max_tokens))
    else:
        d.add("long", prompt(prompt_len), sampling(max_tokens))
    d.add("later", prompt(50, 1), sampling(5))
    run(d, max_steps=2000, check=False)
    assert d.outputs.get("later") == [TOKEN] * 5, "a request behind it never ran"
    if prompt_len < 767:
        assert len(d.outputs["long"]) == 767 - prompt_len   # ended by length at the cap
    assert not d.sched.has_unfinished(), \
        f"stalled: {[(s.seq_id, s.num_tokens, s.status.value) for s in d.sched.seqs.values()]}"


def test_a_handoff_in_offload_mode_receives_its_middle_in_the_host_tier():
    """A sequence handed over to decode at 421 tokens gets no device blocks for its middle
    (table indices 2..21: 32 initial tokens, the local window from 352): they are -1,
    their KV goes to 20 host blocks, and the first decode step tells the worker so
    (``num_received``) with nothing to copy, and adds the recall blocks."""
    sched = make()
    kv, tiers = sched.kv, sched.tiers
    tokens = prompt(420) + [TOKEN]
    middle = tiers.middle_to_receive(421)
    assert middle == (2, 22)
    cached, fresh = kv.reserve("r", tokens, 420, middle)
    host = tiers.receive("r", middle)
    table = kv.block_ids("r")
    assert cached == [] and len(fresh) == 27 - 20 and len(host) == 20
    assert table[2:22] == [-1] * 20 and -1 not in table[:2] + table[22:]
    assert tiers.host.num_used_blocks == 20
    seq = Sequence("r", "r", tokens, 420, sampling(4), 0)
    seq.num_computed_tokens = 420
    sched.adopt(seq, computed=True)
    plan = sched.schedule()
    (change,) = plan.tiers
    assert (change.mode, change.first_offloaded, change.num_received) == (KVMode.OFFLOAD, 2, 20)
    assert change.host_block_ids == host and change.offload_block_ids == []
    assert len(change.recall_block_ids) == CFG.layout(421).top_k * PER_BLOCK
    sched.abort("r")
    assert tiers.host.num_used_blocks == 0 and kv.pool.num_used_blocks == 0
