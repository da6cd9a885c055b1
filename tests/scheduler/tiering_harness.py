"""The scheduler-side harness of the long-context tiering tests (``test_tiering.py``,
``test_tiering_machine.py``): a scheduler with a small device pool and host tier, and a
mirror worker that builds its view of every sequence only from the plans (tables from
``new`` / ``continued`` / ``forks``, tiers from ``TierChange``), in the model runner's
order, and samples one fixed token for each sequence whose known tokens are all
computed. ``check_invariants`` is what every test asserts after a step: the two tiers'
bookkeeping against the mirror's.
"""

from __future__ import annotations

from collections import Counter

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
from scheduler.sequence import SeqStatus
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
    """Whether this scheduled sequence ran a decode step: one token after its prompt, its
    last or, in a recompute, one it replays (``TierPlanner.prefill_stop``).

    A prompt's last chunk of one token runs like a decode too, on the worker and (today)
    in ``_grow``; ``one_token_tail`` tells those apart."""
    seq = sched.seqs[sid]
    before = seq.num_computed_tokens - n
    return n == 1 and before >= seq.num_prompt_tokens


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
        # In the worker's order: drops, then new sequences (a recompute is both).
        for sid in [*plan.finished, *(s.seq_id for s in plan.new)]:
            self.decoded.discard(sid)
            self.tail.discard(sid)
        for s in [*plan.new, *plan.continued]:
            if decode_like(sched, s.seq_id, s.num_scheduled_tokens):
                self.decoded.add(s.seq_id)   # new: a recompute replaying from cached blocks
            if one_token_tail(sched, s.seq_id, s.num_scheduled_tokens):
                self.tail.add(s.seq_id)
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
