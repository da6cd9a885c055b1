"""Settings of the continuous-batching policy."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.long_context import LongContextConfig

POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Per-step limits and queue policy.

    ``max_model_len`` None means the model's own context length (capped by what the
    KV pool can hold).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: got {v!r}; expected an integer >= 1")
        if self.max_model_len is not None and (
                not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len: got {self.max_model_len!r}; "
                             "expected an integer >= 2 or null for the model's own")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: got {self.policy!r}; allowed: {', '.join(POLICIES)}")

    def check_priority(self, priority: int) -> None:
        """A request's priority orders the waiting queue (lower first) and picks whom
        to preempt only under ``policy: priority``; under ``fcfs`` any priority but 0 is
        refused rather than ignored, as vLLM refuses it."""
        if priority and self.policy != "priority":
            raise ValueError(f"priority: got {priority}; this server schedules first come, "
                             "first served (scheduler.policy: fcfs); leave priority out, or "
                             "start it with scheduler.policy: priority "
                             "(--scheduling-policy priority)")


@dataclass
class CellConfig:
    """Everything the global scheduler of one cell needs besides its workers.

    ``prefill_threshold``: shorter prompts are prefilled on a decode worker.
    ``max_prefill_queue_tokens``: past this many prompt tokens waiting on every prefill
    worker, a prompt goes where it costs least (None: always to a prefill worker).
    ``max_waiting``: queued requests before submissions are refused as overloaded.
    ``transfer_timeout_s``: a slower KV handoff is abandoned and recomputed.
    ``prefix_push``: a prompt's finished chunks move to its decode worker while the rest
    prefills (``prefix_push``).
    ``client_lease_s``: a client that has not polled for this long is gone (its
    requests are aborted, see ``client_leases``).
    """

    batch: SchedulerConfig
    block_size: int
    max_model_len: int
    eos_token_ids: list[int]
    enable_prefix_caching: bool = True
    prefill_threshold: int = 0
    max_prefill_queue_tokens: int | None = None
    max_waiting: int = 1024
    transfer_timeout_s: float = 30.0
    long_context: LongContextConfig | None = None
    client_lease_s: float = 15.0
    prefix_push: bool = True
