"""A sequence's lifecycle as the scheduler sees it.

A request with ``n > 1`` is several sequences sharing a request id: sample 0 runs the
prompt, and the others fork from it once the prompt is computed.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass

from scheduler.protocol import SamplingParams, TokenLogprobs


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival: int
    priority: int = 0
    sample_index: int = 0
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    recompute_until: int = 0       # tokens computed before its last preemption
    next_prompt_logprob: int = 1   # the prompt position whose logprob is reported next

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all reported: its prompt must be computed,
        not taken from the prefix cache."""
        return (self.sampling.prompt_logprobs is not None
                and self.next_prompt_logprob < self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass
class SeqUpdate:
    """What one step produced for one sequence, for the engine's output side."""

    request_id: str
    seq_id: str
    sample_index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None   # the next prompt positions'


def child_seq_id(request_id: str, sample_index: int) -> str:
    return request_id if sample_index == 0 else f"{request_id}#{sample_index}"


class WaitingQueue:
    """Sequences waiting for admission, best first.

    FCFS orders by arrival; ``priority`` by (priority, arrival), lower first, as in
    vLLM. A preempted sequence keeps its arrival, so it goes back ahead of newer
    ones. Removal is lazy: finished sequences are skipped when they surface.
    """

    def __init__(self, use_priority: bool) -> None:
        self._use_priority = use_priority
        self._heap: list[tuple[int, int, int, Sequence]] = []
        self._tie = itertools.count()

    def push(self, seq: Sequence) -> None:
        prio = seq.priority if self._use_priority else 0
        heapq.heappush(self._heap, (prio, seq.arrival, next(self._tie), seq))

    def peek(self) -> Sequence | None:
        while self._heap and self._heap[0][3].status is not SeqStatus.WAITING:
            heapq.heappop(self._heap)
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Sequence:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        return seq

    def __len__(self) -> int:
        return sum(1 for e in self._heap if e[3].status is SeqStatus.WAITING)
