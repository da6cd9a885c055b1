"""Long-context settings and the one rule that splits a sequence into attention regions.

A sequence shorter than ``dense_boundary`` is dense: every token attends to its whole
context. From ``dense_boundary`` on it is sparse: a decode step attends to the
*initial* tokens, the *local* window of the latest tokens, and the ``top_k`` middle
retrieval blocks whose summaries best match the query. From ``offload_boundary`` on
the middle blocks also leave the device pool for the host tier, and a step recalls the
selected ones. The scheduler (choosing modes, counting blocks) and the worker
(selecting, attending) both call ``LongContextConfig.layout``, so they agree on every
region boundary.
"""

from __future__ import annotations

import enum
import logging
import math
import os
from dataclasses import dataclass, fields

log = logging.getLogger(__name__)

SUMMARY_KINDS = ("mean", "minmax", "hybrid")

# The reference design's (vllm-ascend RetrievalKV) environment variables, by field.
ENV_VARS = {
    "initial_tokens": "VLLM_RETRIEVAL_INIT_TOKENS_NUM",
    "local_tokens": "VLLM_RETRIEVAL_LOCAL_TOKENS_NUM",
    "top_k_percent": "VLLM_RETRIEVAL_TOPK_PERCENT",
    "dense_boundary": "VLLM_RETRIEVAL_DENSE_BOUNDARY",
    "offload_boundary": "VLLM_RETRIEVAL_OFFLOAD_BOUNDARY",
}


class KVMode(enum.IntEnum):
    DENSE = 0    # whole context attended, all KV in the device pool
    SPARSE = 1   # initial + top-k middle + local attended, all KV in the device pool
    OFFLOAD = 2  # as SPARSE, with the middle blocks in the host tier


@dataclass(frozen=True)
class SparseLayout:
    """A sparse sequence's regions in tokens: ``[0, init_end)`` and ``[local_start,
    num_tokens)`` are always attended; the ``num_middle`` retrieval blocks between them
    are candidates, of which ``top_k`` are attended per step."""

    num_tokens: int
    init_end: int
    local_start: int
    retrieval_block_size: int
    top_k: int

    @property
    def num_middle(self) -> int:
        return (self.local_start - self.init_end) // self.retrieval_block_size

    @property
    def first_middle(self) -> int:
        """Index (in retrieval blocks) of the first middle block."""
        return self.init_end // self.retrieval_block_size

    @property
    def num_attended_tokens(self) -> int:
        return (self.init_end + self.top_k * self.retrieval_block_size
                + self.num_tokens - self.local_start)


@dataclass
class LongContextConfig:
    """The ``long_context`` config section: sparse-retrieval attention and the host tier.

    ``initial_tokens`` and ``local_tokens`` stay in the device pool and are always
    attended (rounded out to whole retrieval blocks). ``top_k_percent`` of the middle
    blocks are recalled per step, or ``top_k_tokens`` worth of them when that is set.
    ``host_kv_bytes``: the host tier's budget per worker (None: 4 GiB).
    ``retrieval_block_size``: tokens per selectable block, a multiple of the pool's block
    size. ``reselect_every``: decode steps between re-selections (``selects_at``).
    ``summary``: how a block is summarised for scoring (``mean`` key, per-channel
    ``minmax`` bounds, or ``hybrid``, both; see kvcache/block_summary.py).
    """

    enabled: bool = False
    initial_tokens: int = 1024
    local_tokens: int = 7192
    top_k_percent: float = 0.2
    top_k_tokens: int | None = None
    dense_boundary: int = 32768
    offload_boundary: int = 65536
    host_kv_bytes: int | None = None
    retrieval_block_size: int = 128
    reselect_every: int = 1
    summary: str = "hybrid"

    DEFAULT_HOST_KV_BYTES = 4 << 30

    def __post_init__(self) -> None:
        for name in ("initial_tokens", "local_tokens", "dense_boundary", "offload_boundary",
                     "retrieval_block_size", "reselect_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if "tokens" in name
                                                                     else 1):
                raise ValueError(f"{name}: got {v!r}; expected an integer >= "
                                 f"{0 if 'tokens' in name else 1}")
        if not 0.0 < self.top_k_percent <= 1.0:
            raise ValueError(f"top_k_percent: got {self.top_k_percent}; allowed (0, 1]")
        if self.top_k_tokens is not None and self.top_k_tokens < 1:
            raise ValueError(f"top_k_tokens: got {self.top_k_tokens}; expected >= 1 or null "
                             "to use top_k_percent")
        if self.host_kv_bytes is not None and self.host_kv_bytes < 0:
            raise ValueError(f"host_kv_bytes: got {self.host_kv_bytes}; expected >= 0 bytes")
        if self.summary not in SUMMARY_KINDS:
            raise ValueError(f"summary: got {self.summary!r}; allowed: "
                             f"{', '.join(SUMMARY_KINDS)}")
        if self.offload_boundary < self.dense_boundary:
            raise ValueError(f"offload_boundary: got {self.offload_boundary}, below "
                             f"dense_boundary={self.dense_boundary}; it must be >= it")
        rb = self.retrieval_block_size
        least = _round_up(self.initial_tokens, rb) + self.local_tokens + rb
        if self.dense_boundary < least:
            raise ValueError(f"dense_boundary: got {self.dense_boundary}; a sparse sequence "
                             f"needs room for the initial and local tokens and one middle "
                             f"block: at least {least}")

    def check_block_size(self, block_size: int) -> None:
        if self.retrieval_block_size % block_size:
            raise ValueError(f"retrieval_block_size: got {self.retrieval_block_size}; it must "
                             f"be a multiple of the pool's block_size {block_size}")

    @property
    def host_budget(self) -> int:
        return self.DEFAULT_HOST_KV_BYTES if self.host_kv_bytes is None else self.host_kv_bytes

    def mode(self, num_tokens: int) -> KVMode:
        """The mode of a sequence whose KV holds ``num_tokens`` tokens."""
        if not self.enabled or num_tokens < self.dense_boundary:
            return KVMode.DENSE
        return KVMode.SPARSE if num_tokens < self.offload_boundary else KVMode.OFFLOAD

    def first_sparse_step(self, num_prompt_tokens: int) -> int:
        """The position of a sequence's first sparse decode step: its prompt's end, or
        where it crosses the dense boundary while decoding."""
        return max(num_prompt_tokens, self.dense_boundary - 1)

    def selects_at(self, position: int, num_prompt_tokens: int) -> bool:
        """Whether the sparse decode step at ``position`` scores the middle afresh rather
        than reusing its last selection: the first sparse step and every position that
        ``reselect_every`` divides (a step whose middle changed its size or k selects
        too). A rule of the position alone, so a sequence that moves to another worker,
        or is recomputed from cached blocks, starts there only at such a step
        (``TierPlanner.may_move``, ``TierPlanner.replay_start``) and selects exactly
        where it would have."""
        return (position % self.reselect_every == 0
                or position == self.first_sparse_step(num_prompt_tokens))

    def longest_context(self, host_blocks: int, block_size: int) -> int | None:
        """The longest context whose middle fits ``host_blocks`` host blocks of
        ``block_size`` tokens (None: no limit, long contexts being off)."""
        if not self.enabled:
            return None
        rb = self.retrieval_block_size
        middle = host_blocks * block_size // rb          # retrieval blocks the tier holds
        longest = self.local_tokens + (middle + _round_up(self.initial_tokens, rb) // rb
                                       + 1) * rb - 1
        if longest < self.offload_boundary:
            return self.offload_boundary - 1
        return longest

    def layout(self, num_tokens: int) -> SparseLayout:
        """The regions of a context of ``num_tokens`` tokens (meaningful when sparse)."""
        rb = self.retrieval_block_size
        init_end = min(_round_up(self.initial_tokens, rb), num_tokens // rb * rb)
        local_start = max(init_end, (num_tokens - self.local_tokens) // rb * rb)
        middle = (local_start - init_end) // rb
        if self.top_k_tokens is not None:
            k = self.top_k_tokens // rb
        else:
            k = math.ceil(self.top_k_percent * middle)
        return SparseLayout(num_tokens, init_end, local_start, rb, min(max(k, 1), middle))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def from_environment(section: dict | None) -> tuple[dict, dict[str, str]]:
    """The section's values completed from the reference design's environment variables.

    Returns (values, source of each value that is not a default). The config file wins
    over the environment.
    """
    values = dict(section or {})
    sources = {name: "config file" for name in values}
    types = {f.name: f.type for f in fields(LongContextConfig)}
    for name, var in ENV_VARS.items():
        raw = os.environ.get(var)
        if raw is None or name in values:
            continue
        try:
            values[name] = float(raw) if "float" in str(types[name]) else int(raw)
        except ValueError as e:
            raise ValueError(f"{var}: got {raw!r}; expected a number for "
                             f"long_context.{name}") from e
        sources[name] = f"environment ({var})"
    return values, sources


def log_sources(config: LongContextConfig, sources: dict[str, str]) -> None:
    """Say where each long-context value came from (the defaults included)."""
    if not config.enabled:
        return
    for f in fields(config):
        log.info("long_context.%s = %r (%s)", f.name, getattr(config, f.name),
                 sources.get(f.name, "default"))
