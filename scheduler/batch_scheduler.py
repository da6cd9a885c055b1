"""Continuous batching for one worker's KV pool.

Each step spends a token budget: running sequences first (a decode costs one
token, an unfinished prompt continues in a chunk), then waiting sequences in queue
order, their cached prefix skipped and their prompt chunked to fit. When the pool
runs out, the worst running sequence (last admitted, or lowest priority) is
preempted: its blocks are freed and it is recomputed later from its prompt plus the
tokens it already produced. Nothing here touches a tensor: the plan names blocks
and token counts, the worker does the rest.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from kvcache.kv_cache_manager import KVCacheManager, PrefixHit
from scheduler.config import SchedulerConfig
from scheduler.protocol import (
    ContinuedSequence,
    ForkedSequence,
    NewSequence,
    SamplingParams,
    SequenceOutput,
    StepOutput,
    StepPlan,
    TierChange,
    TokenLogprobs,
)
from scheduler.sequence import (
    SeqStatus,
    Sequence,
    SeqUpdate,
    WaitingQueue,
    child_seq_id,
)
from scheduler.tiering import TierPlanner


class BatchScheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 eos_token_ids: Seq[int], tiers: TierPlanner | None = None) -> None:
        self.config = config
        self.kv = kv
        self.tiers = tiers  # long contexts: sparse modes and the host tier
        # A sequence stops where the host tier could no longer hold its middle blocks.
        self.max_model_len = min(max_model_len, tiers.longest_context) if tiers else max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = WaitingQueue(config.policy == "priority")
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}
        self.requests: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0
        # Tokens computed again after their sequence's preemption (prefix hits not).
        self.num_recomputed_tokens = 0
        self._arrivals = itertools.count()
        self._step = 0
        self._on_worker: set[str] = set()
        self._drops: list[str] = []
        self._forks: list[ForkedSequence] = []
        self._reset_worker = False

    # ---- requests ------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
            priority: int = 0, sample_index: int = 0, generated: Seq[int] = ()) -> None:
        """Queue a request: its ``sampling.n`` choices fork after its prompt, or, with
        n = 1, the single choice ``sample_index`` (a choice of a request whose choices
        run as requests of their own, as on the cluster). ``generated``: the tokens it
        already produced (a request resumed after its scheduler was lost): it goes on
        from them, recomputed with its prompt, as a preempted sequence does."""
        if sampling.n > 1 and sample_index:
            raise ValueError(f"sample_index: got {sample_index} for n={sampling.n}; a "
                             "request of several choices starts at choice 0")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.config.check_priority(priority)
        n = len(prompt_token_ids)
        if n == 0 or n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; it must have at least 1 and fewer than "
                             f"max_model_len={self.max_model_len}")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt has {n} tokens, more than max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens}; enable chunked prefill")
        if generated and sampling.n > 1:
            raise ValueError(f"generated: got {len(generated)} tokens for n={sampling.n}; "
                             "resume each choice on its own, with n=1")
        seq = Sequence(child_seq_id(request_id, 0), request_id,
                       [*prompt_token_ids, *generated], n, sampling, next(self._arrivals),
                       priority, sample_index)
        self.seqs[seq.seq_id] = seq
        self.requests[request_id] = [seq]
        self.waiting.push(seq)

    def abort(self, request_id: str) -> list[SeqUpdate]:
        """Finish every unfinished sequence of a request now and free its blocks."""
        return [self._finish(s, "abort") for s in self.requests.get(request_id, [])
                if not s.is_finished]

    def stop_sequence(self, seq_id: str) -> None:
        """Finish a sequence the output side stopped (a stop string matched)."""
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, "stop")

    def detach(self, seq_id: str) -> Sequence:
        """Take a running sequence out of this scheduler but keep its blocks allocated.

        Its KV is being handed to another pool; the caller frees the blocks
        (``kv.free``) once the receiver has it.
        """
        seq = self.seqs.pop(seq_id)
        self.running.remove(seq)
        self._drop_from_worker(seq)
        self.requests[seq.request_id].remove(seq)
        self._forget_if_done(seq.request_id)
        return seq

    def adopt(self, seq: Sequence, computed: bool) -> None:
        """Take over a sequence from another scheduler (a handoff or a lost worker).

        ``computed``: its first ``num_computed_tokens`` tokens of KV already sit in
        blocks this pool reserved for it (``kv.reserve``), so it runs at once;
        otherwise it is recomputed from its prompt plus the tokens it produced.
        """
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        seq.arrival = next(self._arrivals)
        self.seqs[seq.seq_id] = seq
        self.requests[seq.request_id] = [seq]
        if computed:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        else:
            seq.status = SeqStatus.WAITING
            seq.num_computed_tokens = 0
            self.waiting.push(seq)

    def reset_worker(self) -> None:
        """The worker may hold sequences of a scheduler that died: the next plan tells it
        to forget them (this pool's mirror starts empty, so their blocks are free)."""
        self._reset_worker = True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.seqs) - len(self.running)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Sequence, int, list[int]]] = {}
        preempted = False
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(self._stop(seq, seq.num_computed_tokens) - seq.num_computed_tokens,
                          budget)
            while True:
                added = self._grow(seq, num_new)
                if added is not None:
                    break
                victim = self._pick_victim()
                if victim.seq_id in scheduled:
                    budget += scheduled.pop(victim.seq_id)[1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if added is None:
                continue
            scheduled[seq.seq_id] = (seq, num_new, added)
            budget -= num_new
        if not preempted:
            budget = self._admit(budget, scheduled)
        return self._build_plan(scheduled.values())

    def _grow(self, seq: Sequence, num_new: int) -> list[int] | None:
        """Blocks for a running sequence's next ``num_new`` tokens, its tiers ready first;
        None (nothing allocated) when short."""
        if not self._tiers_ready(seq, seq.num_computed_tokens, num_new):
            return None
        return self.kv.allocate(seq.seq_id, seq.token_ids, num_new, seq.num_computed_tokens)

    def _tiers_ready(self, seq: Sequence, computed: int, num_new: int) -> bool:
        """Bring the sequence's tiers to its mode before a step that runs as a decode past
        its prompt: a decode, or a recompute's replay of one (not a prompt's one-token last
        chunk: an ``n > 1`` request forks after it, and children share the parent's device
        blocks). False when a tier lacks room (see ``TierPlanner.prepare``)."""
        if self.tiers is None or num_new != 1 or computed < seq.num_prompt_tokens:
            return True
        return self.tiers.prepare(seq.seq_id, computed + 1)

    def _stop(self, seq: Sequence, computed: int) -> int:
        """How far a step that starts at token ``computed`` may compute the sequence: all
        its tokens, except a long one being recomputed (``TierPlanner.prefill_stop``)."""
        if self.tiers is None or computed >= seq.num_tokens - 1:
            return seq.num_tokens
        return self.tiers.prefill_stop(computed, seq.num_tokens, seq.num_prompt_tokens)

    def _admit(self, budget: int, scheduled: dict[str, tuple[Sequence, int, list[int]]]) -> int:
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            if self.tiers is not None and not self.tiers.admits(seq.num_tokens):
                break
            hit = (PrefixHit([], 0) if seq.needs_prompt_logprobs
                   else self.kv.find_cached_prefix(seq.seq_id, seq.token_ids))
            if self.tiers is not None:
                n = self.tiers.replay_start(hit.num_tokens, seq.num_tokens,
                                            seq.num_prompt_tokens)
                hit = PrefixHit(hit.block_ids[:n // self.kv.block_size], n)
            num_new = self._stop(seq, hit.num_tokens) - hit.num_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            added = self.kv.allocate(seq.seq_id, seq.token_ids, num_new, hit.num_tokens, hit)
            if added is None:
                break
            # A recompute whose cached blocks reach past its first sparse step replays
            # from there at once.
            if not self._tiers_ready(seq, hit.num_tokens, num_new):
                self.tiers.release(seq.seq_id)
                self.kv.reset(seq.seq_id)
                break
            self.kv.stats.record(seq.num_tokens, hit.num_tokens)
            self.waiting.pop()
            seq.status = SeqStatus.RUNNING
            seq.num_computed_tokens = hit.num_tokens
            self.running.append(seq)
            scheduled[seq.seq_id] = (seq, num_new, added)
            budget -= num_new
        return budget

    def _build_plan(self, scheduled) -> StepPlan:
        plan = StepPlan(self._step, forks=self._forks, finished=self._drops,
                        reset=self._reset_worker)
        self._reset_worker = False
        if self.tiers is not None:
            plan.tiers = self.tiers.take_changes()
        self._step += 1
        self._forks, self._drops = [], []
        for seq, n, added in scheduled:
            if seq.seq_id in self._on_worker:
                plan.continued.append(ContinuedSequence(seq.seq_id, added, n))
            else:
                plan.new.append(NewSequence(
                    seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                    seq.num_computed_tokens, self._table_before(seq.seq_id, plan.tiers), n,
                    seq.sampling, seq.sample_index))
                self._on_worker.add(seq.seq_id)
            self.num_recomputed_tokens += max(
                0, min(seq.num_computed_tokens + n, seq.recompute_until) - seq.num_computed_tokens)
            seq.num_computed_tokens += n
        return plan

    def _table_before(self, seq_id: str, changes: list[TierChange]) -> list[int]:
        """The block table of a sequence new to the worker, as the worker must hold it
        before this plan's tier changes: the blocks a change moves to the host still
        listed (a recompute that replays from cached blocks offloads at its first step).
        The worker copies them out before the step, as for a sequence it holds."""
        table = list(self.kv.block_ids(seq_id))
        for c in changes:
            if c.seq_id == seq_id and c.offload_block_ids:
                at = c.first_offloaded + c.num_received
                table[at:at + len(c.offload_block_ids)] = c.offload_block_ids
        return table

    def update(self, output: StepOutput) -> list[SeqUpdate]:
        """Apply a worker's sampled tokens; returns per-sequence progress."""
        updates: list[SeqUpdate] = []
        for out in output.outputs:
            seq = self.seqs.get(out.seq_id)
            if seq is None:
                continue  # aborted while the step ran
            prompt_lps = self._new_prompt_logprobs(seq, out)
            if not out.token_ids:   # a partial prefill chunk's prompt logprobs
                if prompt_lps:
                    updates.append(SeqUpdate(seq.request_id, seq.seq_id, seq.sample_index,
                                             [], prompt_logprobs=prompt_lps))
                continue
            if len(out.token_ids) > 1:
                updates.extend(self._fork(seq, out))
            lps = out.logprobs[:1] if out.logprobs else None
            update = self._append(seq, out.token_ids[0], lps)
            update.prompt_logprobs = prompt_lps
            updates.append(update)
        return updates

    @staticmethod
    def _new_prompt_logprobs(seq: Sequence, out: SequenceOutput
                             ) -> list[TokenLogprobs] | None:
        """The prompt logprobs not reported yet (a recomputed prompt scores again what
        was already sent)."""
        if not out.prompt_logprobs:
            return None
        skip = max(0, seq.next_prompt_logprob - out.prompt_logprobs_start)
        new = out.prompt_logprobs[skip:]
        seq.next_prompt_logprob = max(seq.next_prompt_logprob,
                                      out.prompt_logprobs_start + len(out.prompt_logprobs))
        return new or None

    # ---- helpers -----------------------------------------------------------------------
    def _append(self, seq: Sequence, token: int, logprobs) -> SeqUpdate:
        seq.token_ids.append(token)
        reason, stop = self._stop_reason(seq, token)
        if reason is not None:
            seq.stop_reason = stop
            return self._finish(seq, reason, [token], logprobs)
        return SeqUpdate(seq.request_id, seq.seq_id, seq.sample_index, [token], logprobs)

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        sp = seq.sampling
        grown = seq.num_output_tokens
        if grown >= sp.min_tokens:
            if token in self.eos_token_ids and not sp.ignore_eos:
                return "stop", None
            if token in sp.stop_token_ids:
                return "stop", token
        if (sp.max_tokens is not None and grown >= sp.max_tokens) or \
                seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _fork(self, parent: Sequence, out: SequenceOutput) -> list[SeqUpdate]:
        """Split an n > 1 request after its prompt: one child per extra sampled token."""
        updates = []
        prompt = parent.token_ids[:parent.num_prompt_tokens]
        for k, token in enumerate(out.token_ids[1:], start=1):
            child = Sequence(child_seq_id(parent.request_id, k), parent.request_id,
                             list(prompt), parent.num_prompt_tokens, parent.sampling,
                             parent.arrival, parent.priority, sample_index=k)
            self.seqs[child.seq_id] = child
            self.requests[parent.request_id].append(child)
            lps = out.logprobs[k:k + 1] if out.logprobs else None
            update = self._append(child, token, lps)
            updates.append(update)
            if child.is_finished:
                continue
            copy = self.kv.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens)
            if copy is None:  # no block for the copy: recompute the child later
                self.waiting.push(child)
                continue
            child.status = SeqStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            self.running.append(child)
            self._on_worker.add(child.seq_id)
            self._forks.append(ForkedSequence(child.seq_id, parent.seq_id, k,
                                              list(self.kv.block_ids(child.seq_id)), token,
                                              copy[0], copy[1]))
        return updates

    def _pick_victim(self) -> Sequence:
        if self.config.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival))
        return self.running[-1]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.reset(seq.seq_id)
        self._drop_from_worker(seq)
        seq.status = SeqStatus.WAITING
        seq.recompute_until = max(seq.recompute_until, seq.num_computed_tokens)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq)

    def _finish(self, seq: Sequence, reason: str, tokens: list[int] | None = None,
                logprobs=None) -> SeqUpdate:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.seq_id)
        self._drop_from_worker(seq)
        del self.seqs[seq.seq_id]
        self._forget_if_done(seq.request_id)
        return SeqUpdate(seq.request_id, seq.seq_id, seq.sample_index, tokens or [], logprobs,
                         reason, seq.stop_reason)

    def _forget_if_done(self, request_id: str) -> None:
        """A request is this scheduler's until none of its sequences here is unfinished
        (the others finished, or left with a handoff)."""
        if all(s.is_finished for s in self.requests[request_id]):
            del self.requests[request_id]

    def _drop_from_worker(self, seq: Sequence) -> None:
        """The worker forgets the sequence; so do the tiers (the blocks go separately)."""
        if self.tiers is not None:
            self.tiers.release(seq.seq_id)
        if seq.seq_id in self._on_worker:
            self._on_worker.discard(seq.seq_id)
            self._drops.append(seq.seq_id)
