"""Long-context modes and the host tier, scheduler side (``TierPlanner`` inside
``BatchScheduler``), with no model, through the mirror worker of ``tiering_harness``.

Unit tests check where modes switch and which blocks move to the host tier. The last
tests pin down edge cases: a prompt that ends with a one-token chunk and forks, a
request longer than the host tier can hold, and a handoff in offload mode. The random
workloads are in ``test_tiering_machine.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcache.long_context import KVMode
from scheduler.protocol import (
    TierChange,
)
from scheduler.sequence import Sequence
from tests.scheduler.tiering_harness import (
    BS,
    CFG,
    DENSE_B,
    HOST_BLOCKS,
    OFFLOAD_B,
    PER_BLOCK,
    TOKEN,
    Driver,
    check_invariants,
    decode_like,
    make,
    prompt,
    run,
    sampling,
)


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


@pytest.mark.parametrize("computed,tokens,prompt_len,stop", [
    (0, 300, 300, 300),     # a prompt: all of it
    (0, 250, 200, 250),     # a dense recompute: all of it
    (0, 455, 450, 450),     # sparse from the first decode: the prompt, then one a step
    (450, 455, 450, 451),
    (453, 455, 450, 454),
    (0, 300, 200, 255),     # it went sparse at 256 tokens: dense up to that step
    (100, 300, 200, 255),
    (255, 300, 200, 256),
    (0, 257, 256, 256),     # the prompt reached the boundary: its first decode was sparse
])
def test_a_recompute_prefills_up_to_its_first_sparse_step(computed, tokens, prompt_len, stop):
    assert make().tiers.prefill_stop(computed, tokens, prompt_len) == stop


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
    assert seq.num_tokens == 455         # the prompt and 5 tokens of output
    plan = d.step()                      # the drop and the recompute in one plan
    assert plan.finished == ["a"] and [s.seq_id for s in plan.new] == ["a"]
    assert not plan.tiers and -1 not in plan.new[0].block_ids
    assert plan.new[0].num_scheduled_tokens == 450   # dense up to the first sparse step
    check_invariants(d)
    plan = d.step()                      # the first decode step again, replayed
    (c,) = plan.tiers
    lay = CFG.layout(seq.num_computed_tokens)
    assert c.mode == KVMode.OFFLOAD and c.first_offloaded == lay.init_end // BS
    assert len(c.host_block_ids) == lay.local_start // BS - lay.init_end // BS
    assert len(c.recall_block_ids) == lay.top_k * PER_BLOCK
    check_invariants(d)
    for _ in range(4):                   # the other four replayed, the last one sampling
        assert [s.num_scheduled_tokens for s in plan.continued] == [1]
        assert len(d.outputs["a"]) == 5
        plan = d.step()
        check_invariants(d)
    assert len(d.outputs["a"]) == 6
    run(d)
    assert d.outputs["a"] == [TOKEN] * 100
    assert d.sched.num_recomputed_tokens == 454   # all it had computed: 450 + 4 replayed


def _every(every: int):
    """The harness's planner, selecting at every ``every``-th position."""
    tiers = make().tiers
    tiers.config = dataclasses.replace(tiers.config, reselect_every=every)
    return tiers


@pytest.mark.parametrize("every,cached,tokens,prompt_len,start", [
    (1, 480, 490, 450, 480),   # every step selects: all the cached blocks
    (3, 480, 490, 450, 480),   # the step at 480 selected (3 divides it)
    (32, 480, 490, 450, 480),
    (7, 480, 490, 450, 448),   # 480 and 464 reused; down to the first sparse step, 450
    (9, 480, 490, 464, 464),   # 480 reused; 464 is the first sparse step
    (7, 240, 250, 200, 240),   # dense: no selections
    (7, 448, 450, 450, 448),   # a prompt
])
def test_a_recompute_replays_from_a_step_that_selected(every, cached, tokens, prompt_len,
                                                       start):
    assert _every(every).replay_start(cached, tokens, prompt_len) == start


@pytest.mark.parametrize("every,tokens,prompt_len,movable", [
    (1, 452, 450, True),
    (3, 451, 450, True),    # its next step (450) is its first sparse one
    (3, 452, 450, False),   # 451 and 452 reuse 450's selection
    (3, 453, 450, False),
    (3, 454, 450, True),    # 453 selects
    (3, 200, 100, True),    # dense
])
def test_a_sequence_moves_only_before_a_step_that_selects(every, tokens, prompt_len,
                                                          movable):
    assert _every(every).may_move(tokens, prompt_len) is movable


def test_a_recompute_replays_from_its_cached_blocks():
    """With its blocks still in the prefix cache, a recompute takes them all, output
    included (sparse steps wrote them), and replays only the tokens after the last full
    block, the first of them in its admission step: that step's plan offloads the
    middle, and the new sequence's table still lists the blocks the worker copies out."""
    d = Driver(make(caching=True))
    d.add("a", prompt(450), sampling(100))
    for _ in range(40):
        d.step()
    seq = d.sched.seqs["a"]
    assert seq.num_tokens == 490
    d.sched._preempt(seq)
    plan = d.step()                      # checked by the mirror worker as it applies it
    (new,), (c,) = plan.new, plan.tiers
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (480, 1)   # 489 // 16 blocks
    lay = CFG.layout(481)
    assert c.mode == KVMode.OFFLOAD and c.first_offloaded == lay.init_end // BS
    assert new.block_ids[c.first_offloaded:lay.local_start // BS] == c.offload_block_ids
    check_invariants(d)
    for _ in range(9):                   # 481..489 replayed, the last one sampling
        assert len(d.outputs["a"]) == 40
        plan = d.step()
        assert [s.num_scheduled_tokens for s in plan.continued] == [1]
        check_invariants(d)
    assert len(d.outputs["a"]) == 41
    run(d)
    assert d.outputs["a"] == [TOKEN] * 100
    assert d.sched.num_recomputed_tokens == 9     # 480..488; the cached 480 are hits


def test_a_recompute_that_backs_out_counts_its_prefix_hit_once(monkeypatch):
    """A recompute whose tiers lack room at admission gives its blocks back and waits;
    the hit-rate stats count its lookup at the admission that holds, not at each try."""
    d = Driver(make(caching=True))
    d.add("a", prompt(450), sampling(100))
    for _ in range(40):
        d.step()
    d.sched._preempt(d.sched.seqs["a"])
    before = d.sched.kv.stats.queried_tokens, d.sched.kv.stats.hit_tokens
    prepare, refusals = d.sched.tiers.prepare, []

    def refuse_twice(seq_id, num_tokens):
        if len(refusals) < 2:
            refusals.append(seq_id)
            return False
        return prepare(seq_id, num_tokens)
    monkeypatch.setattr(d.sched.tiers, "prepare", refuse_twice)
    for _ in range(3):
        plan = d.step()
    assert refusals == ["a", "a"] and [s.seq_id for s in plan.new] == ["a"]
    check_invariants(d)
    stats = d.sched.kv.stats
    assert (stats.queried_tokens - before[0], stats.hit_tokens - before[1]) == (490, 480)
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
