"""The batching policy against a synthetic worker.

The synthetic worker speaks the real protocol (msgpack plans in, outputs out), keeps
per-sequence state like the model runner, and checks every plan against it. Its
"model" picks each next token as a fixed function of the whole context, so any
scheduling mistake that loses or reorders context changes the text, and a run under
memory pressure must produce exactly the text of a run without it.
"""

from __future__ import annotations

import random

import pytest

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.batch_scheduler import BatchScheduler
from scheduler.config import SchedulerConfig
from scheduler.protocol import (
    SamplingParams,
    SequenceOutput,
    StepOutput,
    StepPlan,
    decode,
    encode,
)

BS = 16
EOS = 2


def next_token(context: list[int], sample_index: int) -> int:
    return (sum(context) * 31 + len(context) * 7 + sample_index * 13) % 97 + 3


class SyntheticWorker:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.seqs: dict[str, dict] = {}
        self.max_step_tokens = 0

    def execute(self, plan: StepPlan) -> StepOutput:
        plan = decode(StepPlan, encode(plan))
        for f in plan.forks:
            parent = self.seqs[f.parent_id]
            assert f.block_ids[:-1] == parent["blocks"][:len(f.block_ids) - 1] or f.copy_dst < 0
            self.seqs[f.seq_id] = dict(tokens=parent["tokens"][:-1] + [f.first_token],
                                       prompt=parent["prompt"], done=parent["done"],
                                       blocks=list(f.block_ids), index=f.sample_index,
                                       n=parent["n"])
        for sid in plan.finished:
            self.seqs.pop(sid)
        run = []
        for s in plan.new:
            assert s.seq_id not in self.seqs, "new sequence already held"
            self.seqs[s.seq_id] = dict(tokens=list(s.token_ids), prompt=s.num_prompt_tokens,
                                       done=s.num_computed_tokens, blocks=list(s.block_ids),
                                       index=s.sample_index, n=s.sampling.n)
            run.append((s.seq_id, s.num_scheduled_tokens))
        for c in plan.continued:
            self.seqs[c.seq_id]["blocks"] += c.new_block_ids
            run.append((c.seq_id, c.num_scheduled_tokens))
        self.max_step_tokens = max(self.max_step_tokens, sum(n for _, n in run))
        outputs = []
        for sid, n in run:
            st = self.seqs[sid]
            assert 1 <= n <= len(st["tokens"]) - st["done"]
            st["done"] += n
            assert len(st["blocks"]) * BS >= st["done"], "too few blocks for the KV"
            assert st["blocks"] == self.kv.block_ids(sid), "worker and scheduler tables differ"
            if st["done"] == len(st["tokens"]):
                fan = st["n"] if len(st["tokens"]) == st["prompt"] else 1
                toks = [next_token(st["tokens"], st["index"] + k) for k in range(fan)]
                st["tokens"].append(toks[0])
                outputs.append(SequenceOutput(sid, toks))
        return decode(StepOutput, encode(StepOutput(plan.step_id, outputs)))


def make(num_blocks: int, **cfg) -> tuple[BatchScheduler, SyntheticWorker]:
    kv = KVCacheManager(num_blocks, BS, enable_caching=cfg.pop("caching", True))
    sched = BatchScheduler(SchedulerConfig(**cfg), kv, max_model_len=4096, eos_token_ids=[EOS])
    return sched, SyntheticWorker(kv)


def run_all(sched: BatchScheduler, worker: SyntheticWorker, max_steps: int = 5000,
            on_plan=None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        if on_plan:
            on_plan(plan)
        for u in sched.update(worker.execute(plan)):
            out.setdefault(u.seq_id, []).extend(u.new_token_ids)
    assert not sched.has_unfinished(), "requests left unfinished"
    return out


def workload(seed: int, count: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 100) for _ in range(rng.randrange(1, 120))], rng.randrange(1, 40))
            for _ in range(count)]


def submit(sched: BatchScheduler, reqs, **params) -> None:
    for i, (prompt, max_tokens) in enumerate(reqs):
        sched.add(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                 **params))


def test_budget_and_max_seqs_hold_and_everything_finishes():
    sched, worker = make(2000, max_num_batched_tokens=64, max_num_seqs=5)
    reqs = workload(0, 40)
    submit(sched, reqs)
    seen_mixed = []

    def check(plan):
        assert plan.num_scheduled_tokens <= 64
        assert sched.num_running <= 5
        kinds = {s.num_scheduled_tokens == 1 for s in plan.continued} | \
                {s.num_scheduled_tokens > 1 for s in plan.new}
        seen_mixed.append(len(kinds) == 2)

    out = run_all(sched, worker, on_plan=check)
    assert {k: len(v) for k, v in out.items()} == {str(i): m for i, (_, m) in enumerate(reqs)}
    assert any(seen_mixed), "no step mixed decodes with a prefill chunk"
    assert sched.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_under_pressure_keeps_the_text(policy):
    reqs = workload(1, 30)
    roomy, w1 = make(4000, max_num_batched_tokens=256, policy=policy)
    submit(roomy, reqs)
    expected = run_all(roomy, w1)
    assert roomy.num_preemptions == 0

    tight, w2 = make(24, max_num_batched_tokens=256, policy=policy)
    submit(tight, reqs)
    got = run_all(tight, w2)
    assert tight.num_preemptions > 0
    assert got == expected
    assert tight.kv.pool.num_used_blocks == 0


def test_prefix_cache_hits_skip_computation():
    sched, worker = make(500, max_num_batched_tokens=512)
    shared = list(range(3, 3 + 5 * BS))
    sched.add("a", shared + [7], SamplingParams(max_tokens=2, ignore_eos=True))
    run_all(sched, worker)
    sched.add("b", shared + [9, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    plans = []
    run_all(sched, worker, on_plan=plans.append)
    first = plans[0].new[0]
    assert first.num_computed_tokens == 5 * BS
    assert first.num_scheduled_tokens == 2
    assert sched.kv.stats.hit_tokens == 5 * BS


def test_abort_frees_blocks_at_once():
    sched, worker = make(100, max_num_batched_tokens=512)
    sched.add("x", list(range(3, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
    sched.add("y", list(range(5, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    sched.update(worker.execute(sched.schedule()))
    used = sched.kv.pool.num_used_blocks
    updates = sched.abort("x")
    assert [u.finish_reason for u in updates] == ["abort"]
    assert sched.kv.pool.num_used_blocks == used - 4
    plan = sched.schedule()
    assert plan.finished == ["x"]
    sched.update(worker.execute(plan))
    run_all(sched, worker)
    assert sched.kv.pool.num_used_blocks == 0


def test_priority_admits_urgent_first_and_preempts_the_least_urgent():
    sched, worker = make(8, max_num_batched_tokens=1024, policy="priority")
    sched.add("low", list(range(3, 50)), SamplingParams(max_tokens=40, ignore_eos=True),
              priority=5)
    sched.update(worker.execute(sched.schedule()))
    sched.add("high", list(range(3, 70)), SamplingParams(max_tokens=40, ignore_eos=True),
              priority=0)
    preempted = []
    run_all(sched, worker, on_plan=lambda p: preempted.extend(p.finished))
    assert preempted[0] == "low"


def test_fcfs_refuses_a_priority_rather_than_ignoring_it():
    sched, _ = make(8)
    with pytest.raises(ValueError, match="priority: got 3; .*scheduler.policy: priority"):
        sched.add("p", [5, 6], SamplingParams(max_tokens=2), priority=3)
    assert "p" not in sched.requests
    sched.add("zero", [5, 6], SamplingParams(max_tokens=2), priority=0)
    by_priority, _ = make(8, policy="priority")
    by_priority.add("p", [5, 6], SamplingParams(max_tokens=2), priority=-3)


def test_stop_token_and_eos_finish_with_reason():
    sched, worker = make(100)
    prompt = [5, 6, 7]
    first = next_token(prompt, 0)
    sched.add("s", prompt, SamplingParams(max_tokens=10, stop_token_ids=[first]))
    (u,) = sched.update(worker.execute(sched.schedule()))
    assert (u.finish_reason, u.stop_reason) == ("stop", first)

    sched2, worker2 = make(100)
    sched2.eos_token_ids = frozenset([first])
    sched2.add("e", prompt, SamplingParams(max_tokens=10, min_tokens=0))
    (u,) = sched2.update(worker2.execute(sched2.schedule()))
    assert (u.finish_reason, u.stop_reason) == ("stop", None)


def test_n_children_share_prompt_blocks_and_diverge():
    sched, worker = make(200, max_num_batched_tokens=512)
    prompt = list(range(3, 3 + 2 * BS + 5))  # two full blocks and a partial one
    sched.add("r", prompt, SamplingParams(n=3, max_tokens=6, ignore_eos=True))
    first = {u.seq_id: u.new_token_ids for u in sched.update(worker.execute(sched.schedule()))}
    parent_blocks = sched.kv.block_ids("r")
    for k in (1, 2):
        child = sched.kv.block_ids(f"r#{k}")
        assert child[:2] == parent_blocks[:2]
        assert child[2] != parent_blocks[2]
    assert all(sched.kv.pool.ref_count(b) == 3 for b in parent_blocks[:2])
    out = run_all(sched, worker)
    texts = [first[s] + out[s] for s in ("r", "r#1", "r#2")]
    assert all(len(t) == 6 for t in texts)
    assert len({tuple(t) for t in texts}) == 3
    for k, t in enumerate(texts):  # each child continues from its own first token
        ctx = prompt + t[:1]
        assert t[0] == next_token(prompt, k)
        assert t[1] == next_token(ctx, k)
    assert sched.kv.pool.num_used_blocks == 0


def test_a_request_is_forgotten_once_its_last_unfinished_sequence_leaves():
    """A child handed off while its sibling has finished takes the request with it: the
    pool holds nothing of it after (the tiering state machine found it kept)."""
    sched, worker = make(200)
    sched.add("r", list(range(3, 40)), SamplingParams(n=2, max_tokens=8, ignore_eos=True))
    sched.update(worker.execute(sched.schedule()))   # the prompt, then the fork
    sched.stop_sequence("r")
    sched.detach("r#1")
    sched.kv.free("r#1")
    assert "r" not in sched.requests and not sched.has_unfinished()
    assert sched.abort("r") == [] and sched.kv.pool.num_used_blocks == 0


def test_prompt_length_and_duplicate_ids_are_rejected():
    sched, _ = make(10)
    with pytest.raises(ValueError, match="4096"):
        sched.add("long", [3] * 4096, SamplingParams())
    with pytest.raises(ValueError, match="at least 1"):
        sched.add("empty", [], SamplingParams())
    sched.add("a", [3], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        sched.add("a", [3], SamplingParams())


def test_detach_and_adopt_move_sequences_between_pools_without_changing_text():
    """Disaggregation in miniature: every sequence prefills on ``a``; after its first
    token it moves to ``b`` (blocks reserved there, freed on ``a`` after), or, every
    third one, is recomputed on ``b`` as after a lost worker."""
    reqs = workload(3, 20)
    ref_sched, ref_worker = make(400)
    submit(ref_sched, reqs)
    expected = run_all(ref_sched, ref_worker)

    a, wa = make(200)
    b, wb = make(400)
    submit(a, reqs)
    out: dict[str, list[int]] = {}
    moved = 0
    while a.has_unfinished() or b.has_unfinished():
        for sched, worker in ((a, wa), (b, wb)):
            for u in sched.update(worker.execute(sched.schedule())):
                out.setdefault(u.seq_id, []).extend(u.new_token_ids)
                if sched is a and u.finish_reason is None:
                    seq = a.seqs[u.seq_id]
                    n = seq.num_computed_tokens
                    reserved = b.kv.reserve(seq.seq_id, seq.token_ids, n)
                    assert reserved is not None
                    a.detach(seq.seq_id)
                    recompute = moved % 3 == 2
                    if recompute:
                        b.kv.free(seq.seq_id)
                    else:
                        b.kv.commit(seq.seq_id, seq.token_ids, n)
                    a.kv.free(seq.seq_id)
                    b.adopt(seq, computed=not recompute)
                    moved += 1
    assert out == expected
    assert moved > 0
    assert a.kv.pool.num_used_blocks == 0 and b.kv.pool.num_used_blocks == 0


def test_reserve_reuses_cached_leading_blocks_and_caches_only_on_commit():
    kv = KVCacheManager(16, BS)
    tokens = list(range(3, 3 + 50))          # 3 full blocks + 2 tokens
    cached, fresh = kv.reserve("x", tokens + [7], 50)
    assert (len(cached), len(fresh)) == (0, 4)
    probe = kv.find_cached_prefix("probe", tokens + [9])
    assert probe.num_tokens == 0             # not committed: nothing served from it
    kv.commit("x", tokens + [7], 50)
    kv.free("x")
    cached, fresh = kv.reserve("y", tokens[:40] + [1] * 20 + [7], 60)
    assert (len(cached), len(fresh)) == (2, 2)
    assert kv.stats.queried_tokens == 0   # the caller records the hit
    assert kv.reserve("z", list(range(400)), 399) is None   # 25 blocks > 16: no change
    assert kv.pool.num_used_blocks == 4
