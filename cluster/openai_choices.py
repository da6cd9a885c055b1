"""A request's choices: one scheduler request per prompt and sample, run side by side.

An OpenAI request asks for ``n`` choices of each of its prompts (or ``best_of`` samples
to keep the best ``n`` of). Each runs as a stream of its own on the cell, so they are
placed, handed off and resumed apart: choice k of a prompt is its sample index k under
the request's seed, as everywhere else. This module builds them from a parsed request
(checking the limits that involve the model), opens and closes their streams
together, interleaves their outputs, and ranks ``best_of`` samples; how each is shown
is ``openai_responses``'.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cluster.client_errors import client_error
from cluster.cluster_client import ClusterClient, RequestStream
from cluster.openai_protocol import APIError, CompletionRequest, Usage
from cluster.outputs import CompletionOutput, Logprob
from scheduler.protocol import SamplingParams, StructuredOutputsParams

MAX_CHOICES = 128


@dataclass
class Choice:
    """One choice of a request: one scheduler request and what has been sent of it."""

    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    sample_index: int = 0   # which of its prompt's choices
    stream: RequestStream | None = None
    out: CompletionOutput = field(default_factory=lambda: CompletionOutput(0))
    sent_text: int = 0
    sent_tokens: int = 0
    sent_reasoning: int = 0   # with a reasoning parser: what of each part has been sent
    sent_content: int = 0
    hide_logprobs: bool = False   # asked for only to rank best_of samples
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # its prompt's
    calls_sent: bool = False   # with tool calls expected: their deltas went out

    @property
    def logprobs(self) -> bool:
        """Whether the answer shows this choice's logprobs."""
        return self.params.logprobs is not None and not self.hide_logprobs


def usage(choices: list[Choice]) -> Usage:
    """The request's token counts: each prompt once, every choice's output."""
    prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in choices}
    return Usage(sum(prompts.values()), sum(len(c.out.token_ids) for c in choices))


def best_of(req: Any) -> int:
    """Samples to draw per prompt: ``best_of`` (completions only; at least ``n``, not
    streamed, as OpenAI has it), else ``n``."""
    asked = req.best_of if isinstance(req, CompletionRequest) else None
    if asked is None:
        return req.n
    if asked < req.n:
        raise APIError(400, f"best_of: got {asked}, fewer than n={req.n}; best_of must be "
                       ">= n", param="best_of")
    if req.stream and asked > req.n:
        raise APIError(400, "best_of: cannot be streamed (the best samples are known only "
                       "at the end); set stream to false or best_of to n", param="best_of")
    return asked


def best(choices: list[Choice], n: int) -> list[Choice]:
    """The ``n`` samples of each prompt with the highest cumulative logprob (best_of),
    in that order, renumbered."""
    by_prompt: dict[int, list[Choice]] = {}
    for c in choices:
        by_prompt.setdefault(id(c.prompt_ids), []).append(c)
    ranked = [c for group in by_prompt.values()
              for c in sorted(group, key=lambda c: -(c.out.cumulative_logprob or 0.0))[:n]]
    for i, c in enumerate(ranked):
        c.index = c.out.index = i
    return ranked


def make_choices(req: Any, prompts: list[tuple[str | None, list[int]]],
                 max_tokens: int | None, logprobs: int | None,
                 structured: StructuredOutputsParams | None, client: ClusterClient,
                 sampling_defaults: dict[str, float | int]) -> list[Choice]:
    """One choice per prompt and sample, each with its own parameters: ``n`` samples a
    prompt, or ``best_of`` to keep the best ``n`` of (ranked by their logprobs, which
    are then asked for and shown only if the request wanted them)."""
    if not 1 <= req.n <= MAX_CHOICES or len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"n: got {req.n} for {len(prompts)} prompt(s); at most "
                       f"{MAX_CHOICES} choices per request", param="n")
    samples = best_of(req)
    if len(prompts) * samples > MAX_CHOICES:
        raise APIError(400, f"best_of: got {samples} for {len(prompts)} prompt(s); at "
                       f"most {MAX_CHOICES} samples per request", param="best_of")
    hide = samples > req.n and logprobs is None
    if hide:
        logprobs = 0
    if req.stream and req.wanted_prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs (or echo with logprobs): not supported with "
                       "stream; set stream to false", param="prompt_logprobs")
    bad = [t for t in req.sampling_params(None, None, None).logit_bias
           if t >= client.vocab_size]
    if bad:
        raise APIError(400, f"logit_bias: got the token id {bad[0]}; this model's ids "
                       f"lie in [0, {client.vocab_size})", param="logit_bias")
    limit = client.max_model_len
    choices = []
    for text, ids in prompts:
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError(400, f"this model's context length is {limit} tokens; the "
                           f"prompt has {len(ids)} and max_tokens asks for {max_tokens} "
                           f"more; lower max_tokens to at most {limit - len(ids)}",
                           param="max_tokens", code="context_length_exceeded")
        budget = max_tokens if max_tokens is not None else limit - len(ids)
        params = req.sampling_params(budget, logprobs, req.seed, sampling_defaults,
                                     structured)
        for i in range(samples):
            if i:   # a prompt's logprobs are computed once, by its first sample
                params = dataclasses.replace(params, prompt_logprobs=None)
            choices.append(Choice(len(choices), text, ids, params, i, hide_logprobs=hide))
    return choices


async def open_all(client: ClusterClient, request_id: str, choices: list[Choice],
                   priority: int = 0) -> None:
    """Open every choice's stream, or none: a refusal closes those already open. A
    cancellation (the client went away) stays one, not a failure of the server."""
    try:
        for c in choices:
            c.stream = await client.open_stream(
                c.prompt_ids, c.params, c.prompt, f"{request_id}-{c.index}", priority,
                sample_index=c.sample_index)
    except BaseException as e:
        await close_all(choices)
        if not isinstance(e, Exception):
            raise
        raise client_error(e, request_id) from None


async def close_all(choices: list[Choice]) -> None:
    """Close every open stream (aborting the choices still running)."""
    for c in choices:
        if c.stream is not None:
            await c.stream.aclose()


async def progress(request_id: str, choices: list[Choice]) -> AsyncIterator[Choice]:
    """Each choice as its output grows (outputs of all choices interleaved); a
    failure is raised as the client sees it."""
    queue: asyncio.Queue = asyncio.Queue()

    async def follow(c: Choice) -> None:
        try:
            async for out in c.stream:
                await queue.put((c, out))
        except BaseException as e:
            await queue.put((c, e))
            raise
        finally:
            await queue.put((c, None))

    tasks = [asyncio.create_task(follow(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            c, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise client_error(item, request_id)
            c.out = item.outputs[0]
            c.out.index = c.index
            if item.prompt_logprobs is not None:
                for sibling in choices:
                    if sibling.prompt_ids is c.prompt_ids:
                        sibling.prompt_logprobs = item.prompt_logprobs
            yield c
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
