"""Turn one step's logits into next tokens, one row per sampling sequence.

The work is vectorized over the batch, and each feature costs only where it is used:
penalties touch only the (row, token) pairs that occurred, top-k/top-p rank only the rows
that use them, random draws are made only for non-greedy rows and log-softmax only for
rows asking for logprobs, so an all-greedy batch is about one argmax.

Sampling is the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per vocab
entry picks token ``i`` with probability ``probs[i]``. A row with a per-request seed
draws its ``q`` from a generator seeded by a hash of (seed, sample index, position)
alone, so its text does not depend on what else is in the batch, on preemption and
recompute, or on which worker (of the same device type) runs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from scheduler.protocol import SamplingParams, TokenLogprobs
from workers.structured_output import unpack_bitmask

_MASK64 = (1 << 64) - 1
# Below this, dividing by the temperature overflows fp32 and the draw is an argmax anyway.
_MIN_TEMPERATURE = 1e-5
# Extreme (valid) penalties or temperatures can overflow a logit to +inf, and softmax to NaN.
_FP32_MAX = torch.finfo(torch.float32).max
_FP32_TINY = torch.finfo(torch.float32).tiny
# top-p looks for its cutoff among this many best tokens first (a top-k is far cheaper than
# a full sort); only rows whose nucleus reaches deeper sort their whole row.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingRow:
    """One sequence sampling one token this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # repetition_penalty covers prompt + output
    output_token_ids: Sequence[int]  # presence/frequency penalties, min_tokens, seed position
    sample_index: int = 0  # which child of an n > 1 request: selects its own random stream
    grammar_mask: torch.Tensor | None = None  # structured output: int32 words, bit set: allowed


@dataclass
class SamplerOutput:
    """One step's sampled tokens, in row order."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the row's params.logprobs is None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, sample_index: int, position: int) -> int:
    """The 63-bit generator seed for one draw of a seeded request; depends on nothing else."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (sample_index & _MASK64))
    return _splitmix64(h ^ (position & _MASK64)) >> 1


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _MIN_TEMPERATURE


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _exponential_(q: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill ``q`` with Exp(1) draws as ``-log(U)``, about 4x faster than ``exponential_`` on CPU.

    U is kept off 0 so q is finite: a row's only candidate must never score 0 and tie with
    the filtered-out tokens."""
    return q.uniform_(generator=generator).clamp_(min=_FP32_TINY).log_().neg_()


class Sampler:
    """Samples one token per row; keeps no state across steps but the engine generator."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.seed = seed
        self._engine_generators: dict[torch.device, torch.Generator] = {}
        self._request_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        logits = self._prepare(logits, rows)
        penalized = self._penalize(logits, rows)
        rand = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if not rand:
            tokens = penalized.argmax(dim=-1)
        else:
            sub, sub_rows = self._select(penalized, rows, rand)
            probs = self._distribution(sub, sub_rows)
            drawn = probs.div_(self._exponentials(probs, sub_rows)).argmax(dim=-1)
            if len(rand) == len(rows):
                tokens = drawn
            else:
                tokens = penalized.argmax(dim=-1)
                tokens.index_copy_(0, _index(rand, tokens.device), drawn)
        return SamplerOutput(tokens.tolist(), self._logprobs(logits, rows, tokens))

    def probabilities(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution each row samples from, [rows, vocab_size] (one-hot for greedy rows).

        ``__call__`` draws from exactly this; it is public so tests can compare it with an
        independent implementation.
        """
        logits = self._prepare(logits, rows)
        penalized = self._penalize(logits, rows)
        probs = torch.zeros_like(penalized)
        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        rand = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if greedy:
            g = _index(greedy, probs.device)
            probs[g, penalized[g].argmax(dim=-1)] = 1.0
        if rand:
            sub, sub_rows = self._select(penalized, rows, rand)
            probs[_index(rand, probs.device)] = self._distribution(sub, sub_rows)
        return probs

    def _prepare(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits: got shape {tuple(logits.shape)}; expected "
                             f"[{len(rows)}, >= {self.vocab_size}] (one row per SamplingRow)")
        return logits[:, :self.vocab_size].float()

    @staticmethod
    def _select(logits: torch.Tensor, rows: Sequence[SamplingRow],
                which: list[int]) -> tuple[torch.Tensor, list[SamplingRow]]:
        if len(which) == len(rows):
            return logits, list(rows)
        return logits[_index(which, logits.device)], [rows[i] for i in which]

    def _penalize(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Grammar masks, min_tokens bans and logit biases (vLLM's order), then repetition /
        presence / frequency penalties; copies if any (the raw logits stay for logprobs)."""
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if len(r.output_token_ids) < p.min_tokens:
                eos = [] if p.ignore_eos else self.eos_token_ids
                banned = {t for t in chain(p.stop_token_ids, eos) if t < self.vocab_size}
                ban_rows.extend([i] * len(banned))
                ban_ids.extend(banned)
        pen = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        masked = [i for i, r in enumerate(rows) if r.grammar_mask is not None]
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        if not ban_ids and not pen and not masked and not biased:
            return logits
        logits = logits.clone()
        if masked:
            words = torch.stack([rows[i].grammar_mask for i in masked])
            banned = unpack_bitmask(words, logits.shape[1]).logical_not_().to(logits.device)
            if len(masked) == len(rows):
                logits.masked_fill_(banned, -torch.inf)
            else:
                idx = _index(masked, logits.device)
                logits[idx] = logits[idx].masked_fill_(banned, -torch.inf)
        if ban_ids:
            logits[_index(ban_rows, logits.device), _index(ban_ids, logits.device)] = -torch.inf
        if biased:
            self._apply_bias(logits, [rows[i].params.logit_bias for i in biased], biased)
        if pen:
            self._apply_penalties(logits, rows, pen)
        return logits

    def _apply_bias(self, logits: torch.Tensor, biases: list[dict[int, float]],
                    which: list[int]) -> None:
        """In place: each row's bias added to its tokens (ids past the vocabulary ignored)."""
        r, t = self._pairs([b.keys() for b in biases], which, logits.device)
        values = [v for b in biases for tok, v in b.items() if 0 <= tok < self.vocab_size]
        logits[r, t] = (logits[r, t] + torch.tensor(values, device=logits.device)
                        ).clamp_(max=_FP32_MAX)

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                         which: list[int]) -> None:
        """In place, touching only the (row, token) pairs that occurred, never rows x vocab.

        A token repeated in a row gives duplicate pairs; plain writes of the same value are
        harmless there, and frequency's per-occurrence sum uses an accumulating write.
        """
        device = logits.device

        def per_row(name: str) -> torch.Tensor:
            values = [float(getattr(r.params, name)) for r in rows]
            return torch.tensor(values, dtype=torch.float32, device=device)

        rep = [i for i in which if rows[i].params.repetition_penalty != 1.0]
        if rep:
            r, t = self._pairs([chain(rows[i].prompt_token_ids, rows[i].output_token_ids)
                                for i in rep], rep, device)
            penalty = per_row("repetition_penalty").clamp_(min=_FP32_TINY)[r]  # 0 * -inf is NaN
            v = logits[r, t]
            logits[r, t] = torch.where(v > 0, v / penalty, v * penalty).clamp_(max=_FP32_MAX)
        used = [i for i in which if rows[i].params.presence_penalty
                or rows[i].params.frequency_penalty]
        if used:
            r, t = self._pairs([rows[i].output_token_ids for i in used], used, device)
            logits[r, t] = logits[r, t] - per_row("presence_penalty")[r]
            logits.index_put_((r, t), -per_row("frequency_penalty")[r], accumulate=True)

    def _pairs(self, id_lists: list[Iterable[int]], row_ids: list[int],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Flatten per-row token ids into (row, token) index tensors, dropping ids out of range."""
        flat: list[int] = []
        lengths: list[int] = []
        for ids in id_lists:
            before = len(flat)
            flat.extend(ids)
            lengths.append(len(flat) - before)
        tokens = torch.tensor(flat, dtype=torch.long)
        row = torch.repeat_interleave(torch.tensor(row_ids), torch.tensor(lengths))
        valid = (tokens >= 0) & (tokens < self.vocab_size)
        return row[valid].to(device), tokens[valid].to(device)

    def _distribution(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p (HF's order), softmax; for non-greedy rows."""
        device = logits.device
        temperature = [r.params.temperature for r in rows]
        if any(t != 1.0 for t in temperature):
            logits = (logits / _column(temperature, device)).clamp_(max=_FP32_MAX)
        which = [i for i, r in enumerate(rows)
                 if 0 < r.params.top_k < self.vocab_size or r.params.top_p < 1.0]
        if which:
            sub, sub_rows = self._select(logits, rows, which)
            cutoff = self._cutoffs(sub, sub_rows, _TOP_P_CANDIDATES)
            if len(which) < len(rows):
                full = torch.full((len(rows), 1), -torch.inf, device=device)
                cutoff = full.index_copy_(0, _index(which, device), cutoff)
            logits = logits.masked_fill(logits < cutoff, -torch.inf)
        probs = logits.softmax(dim=-1)
        min_p = [r.params.min_p for r in rows]
        if any(min_p):
            floor = _column(min_p, device) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def _cutoffs(self, logits: torch.Tensor, rows: list[SamplingRow],
                 candidates: int) -> torch.Tensor:
        """Each row's smallest kept logit, [rows, 1]: the k-th best, raised to where the
        top-p mass is reached. Never above the best logit, so a row always keeps a token.

        The top-p cutoff is sought among the best ``candidates`` tokens; rows whose
        nucleus reaches deeper are sought again over their whole (sorted) row.
        """
        vocab = logits.shape[1]
        device = logits.device
        top_k = [min(r.params.top_k, vocab) for r in rows]
        top_p = [r.params.top_p for r in rows]
        nucleus = any(p < 1.0 for p in top_p)
        width = min(vocab, max(top_k + [candidates if nucleus else 0]))
        ranked = logits.topk(width, dim=-1).values
        k = _index(top_k, device).unsqueeze(1)
        kth = torch.where(k > 0, ranked.gather(1, (k - 1).clamp_(min=0)), -torch.inf)
        if not nucleus:
            return kth
        ranked = ranked.masked_fill(ranked < kth, -torch.inf)
        # A top-k row's kept tokens all lie in ``ranked``; a row without top-k needs its full row.
        total = ranked.logsumexp(dim=-1, keepdim=True)
        if width < vocab and 0 in top_k:
            total = torch.where(k > 0, total, logits.logsumexp(dim=-1, keepdim=True))
        probs = (ranked - total).exp()
        mass = probs.cumsum(dim=-1)
        p = _column(top_p, device)
        kept = ((mass - probs) < p).sum(dim=-1, keepdim=True)
        kept.clamp_(min=1)  # a top_p that rounds to 0 in fp32 still keeps the best token
        in_nucleus = p < 1.0  # top_p == 1 rows keep exactly their top-k, whatever fp32 sums say
        cutoff = torch.where(in_nucleus, torch.maximum(kth, ranked.gather(1, kept - 1)), kth)
        if width < vocab:
            deeper = ((mass[:, -1:] < p) & in_nucleus).squeeze(1).nonzero().squeeze(1).tolist()
            if deeper:
                cutoff[_index(deeper, device)] = self._cutoffs(
                    logits[_index(deeper, device)], [rows[i] for i in deeper], vocab)
        return cutoff

    def _exponentials(self, like: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exp(1) noise per row: one batched draw for unseeded rows, a keyed stream per seeded."""
        device = like.device
        q = torch.empty_like(like)
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            gen = self._generator(self._engine_generators, device)
            if seeded:
                noise = torch.empty((len(unseeded), like.shape[1]), device=device)
                q[_index(unseeded, device)] = _exponential_(noise, gen)
            else:
                _exponential_(q, gen)
        if seeded:
            gen = self._generator(self._request_generators, device)
            for i in seeded:
                r = rows[i]
                gen.manual_seed(stream_seed(r.params.seed, r.sample_index,
                                            len(r.output_token_ids)))
                _exponential_(q[i], gen)
        return q

    def _generator(self, cache: dict[torch.device, torch.Generator],
                   device: torch.device) -> torch.Generator:
        if device not in cache:
            cache[device] = torch.Generator(device=device)
            cache[device].manual_seed(self.seed)
        return cache[device]

    def _logprobs(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                  tokens: torch.Tensor) -> list[TokenLogprobs | None]:
        """Raw-model logprobs (before penalties and temperature), as vLLM reports by default."""
        out: list[TokenLogprobs | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return out
        idx = _index(want, logits.device)
        logprobs = logits[idx].log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
        n = min(max(rows[i].params.logprobs for i in want), self.vocab_size)
        top_values: list[list[float]] = [[] for _ in want]
        top_ids: list[list[int]] = [[] for _ in want]
        if n:
            values, ids = logprobs.topk(n, dim=-1)
            top_values, top_ids = values.tolist(), ids.tolist()
        for j, i in enumerate(want):
            k = rows[i].params.logprobs
            out[i] = TokenLogprobs(chosen[j], top_ids[j][:k], top_values[j][:k])
        return out
