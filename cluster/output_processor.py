"""Turns the scheduler's token updates into text: detokenization and stop strings.

Stop strings are a text-level condition, so they are checked here, after
incremental detokenization; a sequence that hits one is reported back so the engine
can stop it and free its blocks. For streaming, the last ``len(longest stop) - 1``
characters of an unfinished sequence are held back, so a stop string is never half
sent before it is recognised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.outputs import CompletionOutput, Logprob, RequestOutput
from scheduler.protocol import SamplingParams, TokenLogprobs
from scheduler.sequence import SeqUpdate
from workers.detokenizer import IncrementalDetokenizer
from workers.structured_output import grammar_for
from workers.tokenizer import Tokenizer


@dataclass
class _SeqText:
    out: CompletionOutput
    detok: IncrementalDetokenizer | None


@dataclass
class _RequestText:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    seqs: dict[int, _SeqText] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.out.finished for s in self.seqs.values())


def streamable_text(out: CompletionOutput, stop: Sequence[str]) -> str:
    """What of a sequence's text can be streamed: all of it once finished, else all but
    the last ``len(longest stop string) - 1`` characters, so that a stop string is
    never half sent before it is recognised."""
    if out.finished:
        return out.text
    hold = max((len(s) for s in stop), default=1) - 1
    return out.text[:max(0, len(out.text) - hold)]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestText] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, stream: bool = False) -> None:
        """Track a request; ``stream`` requests report every step, others only at the end."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none; "
                             "use stop_token_ids instead")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer, and this model has none")
            grammar_for(params.structured_outputs)   # refuse a bad grammar before any work
        self.requests[request_id] = _RequestText(
            request_id, prompt, prompt_token_ids, params, stream,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def process(self, updates: list[SeqUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Apply updates; returns the outputs of the requests that changed and the ids
        of sequences that hit a stop string (still running in the scheduler)."""
        changed: dict[str, _RequestText] = {}
        to_stop: list[str] = []
        for u in updates:
            req = self.requests.get(u.request_id)
            if req is None:
                continue
            if u.prompt_logprobs and req.prompt_logprobs is not None:
                for lp in u.prompt_logprobs:
                    token = req.prompt_token_ids[len(req.prompt_logprobs)]
                    req.prompt_logprobs.append(self._logprob_entry(token, lp))
            seq = req.seqs.get(u.sample_index)
            if seq is None:
                seq = req.seqs[u.sample_index] = self._new_seq(req, u.sample_index)
            if seq.out.finished:
                continue
            self._apply(req, seq, u)
            if seq.out.finished and u.finish_reason is None:
                to_stop.append(u.seq_id)
            changed[req.request_id] = req
        outputs = []
        for req in changed.values():
            if req.finished:
                outputs.append(self._snapshot(req))
                del self.requests[req.request_id]
            elif req.stream:
                outputs.append(self._snapshot(req))
        return outputs, to_stop

    def progress(self, request_id: str, sample_index: int) -> tuple[list[int], bool]:
        """The tokens one choice of a request has received, and whether any of the
        request's prompt logprobs have (what a resumed request goes on from)."""
        req = self.requests.get(request_id)
        if req is None:
            return [], False
        seq = req.seqs.get(sample_index)
        return (list(seq.out.token_ids) if seq is not None else [],
                bool(req.prompt_logprobs and len(req.prompt_logprobs) > 1))

    def _new_seq(self, req: _RequestText, index: int) -> _SeqText:
        detok = (IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                        req.params.skip_special_tokens)
                 if self.tokenizer is not None else None)
        logprobs = [] if req.params.logprobs is not None else None
        cum = 0.0 if logprobs is not None else None
        return _SeqText(CompletionOutput(index, logprobs=logprobs, cumulative_logprob=cum), detok)

    def _apply(self, req: _RequestText, seq: _SeqText, u: SeqUpdate) -> None:
        out = seq.out
        out.token_ids.extend(u.new_token_ids)
        if u.logprobs and out.logprobs is not None:
            for tok, lp in zip(u.new_token_ids, u.logprobs):
                out.logprobs.append(self._logprob_entry(tok, lp))
                out.cumulative_logprob += lp.token_logprob
        if seq.detok is not None:
            new_text = seq.detok.push(u.new_token_ids)
            if u.finish_reason is not None:
                new_text += seq.detok.flush()
            out.text += new_text
            if req.params.stop and self._check_stop(out, req.params, len(new_text)):
                return
        if u.finish_reason is not None:
            out.finish_reason = u.finish_reason
            out.stop_reason = u.stop_reason

    @staticmethod
    def _check_stop(out: CompletionOutput, params: SamplingParams, new_len: int) -> bool:
        text = out.text
        for stop in params.stop:
            start = max(0, len(text) - new_len - len(stop) + 1)
            idx = text.find(stop, start)
            if idx >= 0:
                out.text = text[:idx + len(stop)] if params.include_stop_str_in_output \
                    else text[:idx]
                out.finish_reason = "stop"
                out.stop_reason = stop
                return True
        return False

    def _logprob_entry(self, token: int, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry = {tid: Logprob(v, rank + 1, self._piece(tid))
                 for rank, (tid, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
        if token not in entry:
            entry = {token: Logprob(lp.token_logprob, None, self._piece(token)), **entry}
        return entry

    def _piece(self, token: int) -> str | None:
        return self.tokenizer.decode([token], skip_special_tokens=False) \
            if self.tokenizer is not None else None

    @staticmethod
    def _snapshot(req: _RequestText) -> RequestOutput:
        outs = [CompletionOutput(s.out.index, s.out.text, list(s.out.token_ids),
                                 s.out.cumulative_logprob,
                                 None if s.out.logprobs is None else list(s.out.logprobs),
                                 s.out.finish_reason, s.out.stop_reason)
                for _, s in sorted(req.seqs.items())]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                             req.finished,
                             None if req.prompt_logprobs is None else list(req.prompt_logprobs))
