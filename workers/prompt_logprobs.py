"""Logprobs of a prompt's own tokens (vLLM's ``prompt_logprobs``; ``echo`` with
``logprobs`` over HTTP): the hidden state at position ``p`` scores prompt token
``p + 1``, so each prefill chunk scores the prompt tokens that follow its positions.

Only the rows of sequences that ask for them reach the LM head, in slices, so a long
prompt never holds a [prompt, vocab] logits matrix at once. Values are the raw
model's log-softmax, as the sampled tokens' logprobs are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from scheduler.protocol import TokenLogprobs

# Hidden rows sent through the LM head at once: bounds the logits held to
# _SLICE_ROWS x vocab floats.
_SLICE_ROWS = 256


@dataclass
class PromptSpan:
    """The prompt tokens one sequence's chunk scores: positions ``start`` on, predicted
    by the flat hidden rows ``first_row`` on, ``k`` alternatives each."""

    seq_id: str
    start: int
    first_row: int
    targets: list[int]
    k: int


def prompt_span(seq_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                num_computed: int, num_tokens: int, first_row: int, k: int | None
                ) -> PromptSpan | None:
    """What a chunk running positions ``num_computed`` .. ``+ num_tokens`` scores of its
    prompt (None when it asks for no prompt logprobs or scores nothing)."""
    if k is None:
        return None
    end = min(num_computed + num_tokens, num_prompt_tokens - 1)   # last position scoring
    if end <= num_computed:
        return None
    return PromptSpan(seq_id, num_computed + 1, first_row,
                      list(token_ids[num_computed + 1:end + 1]), k)


def score_prompt(hidden: torch.Tensor, spans: list[PromptSpan], vocab_size: int,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]
                 ) -> dict[str, list[TokenLogprobs]]:
    """Each span's token logprobs and top-``k`` alternatives, in prompt order."""
    out: dict[str, list[TokenLogprobs]] = {}
    for span in spans:
        entries: list[TokenLogprobs] = []
        for lo in range(0, len(span.targets), _SLICE_ROWS):
            targets = span.targets[lo:lo + _SLICE_ROWS]
            rows = hidden[span.first_row + lo:span.first_row + lo + len(targets)]
            logprobs = compute_logits(rows)[:, :vocab_size].float().log_softmax(dim=-1)
            index = torch.as_tensor(targets, device=logprobs.device).unsqueeze(1)
            chosen = logprobs.gather(1, index).squeeze(1).tolist()
            if span.k:
                values, ids = logprobs.topk(min(span.k, vocab_size), dim=-1)
                tops, top_ids = values.tolist(), ids.tolist()
            else:
                tops, top_ids = [[] for _ in targets], [[] for _ in targets]
            entries += [TokenLogprobs(c, i, v) for c, i, v in zip(chosen, top_ids, tops)]
        out[span.seq_id] = entries
    return out
