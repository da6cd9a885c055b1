"""Where work goes: a prompt to the worker that prefills it, a prefilled (or migrating)
sequence to the decode worker that continues it. Only serving workers take work."""

from __future__ import annotations

from kvcache.block_hash import extend_block_hashes
from scheduler.cell_worker import CellWorker, num_decoding, queued_prefill_tokens
from scheduler.config import CellConfig
from scheduler.protocol import Role

_LONG_FIRST = (Role.PREFILL, Role.MIXED, Role.DECODE)
_SHORT_FIRST = (Role.DECODE, Role.MIXED, Role.PREFILL)


def place_prompt(workers: list[CellWorker], token_ids: list[int],
                 config: CellConfig) -> CellWorker | None:
    """Where a prompt (new, or recomputed) is prefilled: by role, then prefix hit, then load.

    Long prompts prefer prefill workers, short ones decode workers (conditional
    disaggregation); a missing role falls back to mixed workers, then the other role.
    While every prefill worker has ``max_prefill_queue_tokens`` or more prompt tokens
    waiting, a long prompt goes to the serving worker where it costs least, in token
    times: the prefill work queued there plus its own new tokens, which also stall
    every sequence the worker decodes (a prefill worker decodes none). A burst of
    prompts is then prefilled on idle decode workers too instead of queueing behind one
    prefill worker, while a decode worker busy with many sequences, or a long prompt,
    still goes to the prefill workers.
    """
    serving = [w for w in workers if w.serving]
    order = _LONG_FIRST if len(token_ids) >= config.prefill_threshold else _SHORT_FIRST
    by_role = ([w for w in serving if w.role is role] for role in order)
    candidates = next((found for found in by_role if found), [])
    if not candidates:
        return None
    bs = config.block_size
    hashes = extend_block_hashes([], token_ids, bs)
    limit = config.max_prefill_queue_tokens
    if (candidates[0].role is Role.PREFILL and limit is not None
            and min(queued_prefill_tokens(w) for w in candidates) >= limit):
        def cost(w: CellWorker) -> int:
            new = len(token_ids) - len(w.kv.pool.lookup(hashes)) * bs
            return queued_prefill_tokens(w) + new * (1 + num_decoding(w))

        return min(serving, key=lambda w: (cost(w), w.role is not Role.PREFILL,
                                           -w.kv.pool.num_free_blocks))
    return min(candidates, key=lambda w: (-len(w.kv.pool.lookup(hashes)),
                                          len(w.batch.seqs), -w.kv.pool.num_free_blocks))


def decode_target(workers: list[CellWorker], src: CellWorker) -> CellWorker | None:
    """The serving decode (or mixed) worker other than ``src`` with the most free blocks."""
    targets = [w for w in workers if w.serving and w is not src
               and w.role in (Role.DECODE, Role.MIXED)]
    return max(targets, key=lambda w: w.kv.pool.num_free_blocks, default=None)
