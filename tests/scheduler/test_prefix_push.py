"""Prefix pushes: a prompt prefilled in several chunks sends its finished blocks to the
decode worker while it prefills, so its handoff moves only the last chunk's blocks.

The same in-process workers and handles as ``test_global_scheduler``; chunks of 32
tokens (2 blocks of 16) make a 100-token prompt a four-step prefill: 6 full blocks
finish before the step that samples the first token, and the 7th holds its last 4
tokens. Each prefill step takes 200 ms longer, as a real chunk takes longer than moving
its blocks, so that every push lands before the next step ends.
"""

from __future__ import annotations

import asyncio

import torch

from kvcache.kv_transfer import KVTransferError
from scheduler.config import SchedulerConfig
from scheduler.stats import CellStats
from tests.scheduler.test_global_scheduler import _prompt, _scheduler, _serve

CHUNKED = SchedulerConfig(max_num_batched_tokens=32)
PROMPTS = {"long": _prompt(3, 100), "short": _prompt(4, 20)}


async def _run(path: str, roles: list[str], corrupt_first: bool = False,
               prompts: dict[str, list[int]] = PROMPTS, late_third_push: str = "",
               **kw) -> tuple[dict[str, list[int]], CellStats, int]:
    """The requests' tokens, the cell's stats and the KV bytes of one pool block.
    ``late_third_push``: the third import into the last worker (the third push) lands
    after the first token's step, ``"lands"`` whole or ``"fails"`` (refused)."""
    gs, handles = _scheduler(path, roles, batch=CHUNKED, **kw)
    if late_third_push:
        imports, calls = handles[-1].import_kv, []

        async def late_import(*args):
            calls.append(args)
            if len(calls) == 3:
                await asyncio.sleep(1.5)
                if late_third_push == "fails":
                    raise KVTransferError("refused in the test")
            return await imports(*args)

        handles[-1].import_kv = late_import
    step = handles[0].step

    async def slow_step(plan: bytes) -> bytes:
        out = await step(plan)
        await asyncio.sleep(0.2)
        return out

    handles[0].step = slow_step
    sender, receiver = handles[0].worker, handles[-1].worker
    if corrupt_first:   # a byte flipped in the first push's first block while it moves
        export, import_ = sender.export_kv, receiver.import_kv
        flipped: list[int] = []

        def flip(block: int) -> None:
            sender.runner.kv_caches[0][0, block].view(torch.uint8).view(-1)[3] ^= 1

        def export_then_corrupt(block_ids, *args):
            out = export(block_ids, *args)
            if not flipped:
                flipped.append(block_ids[0])
                flip(block_ids[0])
            return out

        def import_then_restore(*args):
            try:
                return import_(*args)
            finally:
                if len(flipped) == 1:
                    flip(flipped.pop())
                    flipped.append(-1)

        sender.export_kv, receiver.import_kv = export_then_corrupt, import_then_restore
    out, stats = await _serve(gs, prompts)
    return out, stats, sender.runner.kv_shape.bytes_per_block


def test_a_chunked_prompt_pushes_its_finished_blocks_and_hands_off_the_rest(tiny_factory):
    path = tiny_factory("llama").path

    async def main() -> None:
        alone, _, _ = await _run(path, ["mixed"])
        out, stats, block_bytes = await _run(path, ["prefill", "decode"])
        assert out == alone
        sent, received = stats.workers[0].kv_sent, stats.workers[1].kv_received
        # Pushes after steps 1-3 send 2 blocks each; the handoffs take the 7th and the
        # short prompt's 2 blocks (one prefill step, no push).
        assert (sent.pushes, sent.pushed_bytes) == (3, 6 * block_bytes)
        assert (received.pushes, received.pushed_bytes) == (3, 6 * block_bytes)
        assert (sent.count, sent.bytes) == (2, 3 * block_bytes)
        assert sent.failures == sent.push_failures == 0
        # The handoff finds the pushed blocks in the prefix cache, but they travelled:
        # no hit, as without pushes (both prompts' 120 tokens asked for).
        decode = stats.workers[1]
        assert (decode.prefix_queried_tokens, decode.prefix_hit_tokens) == (120, 0)
        assert all(w.num_used_blocks == 0 for w in stats.workers)

        off, off_stats, _ = await _run(path, ["prefill", "decode"], prefix_push=False)
        assert off == alone
        sent = off_stats.workers[0].kv_sent
        assert sent.pushes == 0 and (sent.count, sent.bytes) == (2, 9 * block_bytes)
        decode = off_stats.workers[1]
        assert (decode.prefix_queried_tokens, decode.prefix_hit_tokens) == (120, 0)

    asyncio.run(main())


def test_a_corrupted_push_is_refused_and_its_blocks_go_with_the_handoff(tiny_factory):
    """A byte flipped in the sender's pool between the first push's export and its
    import fails that push's checksum: nothing of it is committed on the decode side,
    the next push sends those blocks again, and the text is the clean run's."""
    path = tiny_factory("llama").path

    async def main() -> None:
        alone, _, _ = await _run(path, ["mixed"])
        out, stats, block_bytes = await _run(path, ["prefill", "decode"], corrupt_first=True)
        sent = stats.workers[0].kv_sent
        # Push 1 (blocks 0-1) refused; push 2 sends blocks 0-3, push 3 blocks 4-5.
        assert (sent.push_failures, sent.pushes, sent.pushed_bytes) == (1, 2, 6 * block_bytes)
        assert (sent.failures, sent.bytes, stats.num_recovered) == (0, 3 * block_bytes, 0)
        assert all(w.num_used_blocks == 0 for w in stats.workers)
        assert out == alone

    asyncio.run(main())


def test_the_handoff_goes_to_the_worker_holding_the_pushed_blocks(tiny_factory):
    """Two decode workers: the short prompt, handed off first, takes blocks on decode-1,
    so the long prompt's pushes go to decode-2 (more free blocks). By the long prompt's
    first token the short one is done and both have as many free blocks, which alone
    would pick decode-1; the handoff goes to decode-2, where its pushed blocks are."""
    path = tiny_factory("llama").path
    prompts = {"short": PROMPTS["short"], "long": PROMPTS["long"]}

    async def main() -> None:
        alone, _, _ = await _run(path, ["mixed"], prompts=prompts)
        out, stats, block_bytes = await _run(path, ["prefill", "decode", "decode"],
                                             prompts=prompts)
        assert out == alone
        d1, d2 = (w.kv_received for w in stats.workers[1:])
        # The long prompt's chunks: 12 tokens beside the short prompt, then 32, 32, 24;
        # pushes after steps 2 and 3 send blocks 0-3, its handoff blocks 4-6.
        assert (d1.count, d1.bytes, d1.pushes) == (1, 2 * block_bytes, 0)
        assert (d2.pushes, d2.pushed_bytes) == (2, 4 * block_bytes)
        assert (d2.count, d2.bytes) == (1, 3 * block_bytes)

    asyncio.run(main())


def test_a_push_still_moving_at_the_first_token_is_shared_not_sent_again(tiny_factory):
    """The third push lands 1.5 s late, after the step that samples the first token:
    the handoff shares the blocks it fills, waits for it and sends only the 7th block,
    as when every push landed in time. When that push fails instead, the handoff sends
    its two blocks itself, and nothing is recomputed."""
    path = tiny_factory("llama").path

    async def main() -> None:
        alone, _, _ = await _run(path, ["mixed"])
        out, stats, block_bytes = await _run(path, ["prefill", "decode"],
                                             late_third_push="lands")
        assert out == alone
        sent, decode = stats.workers[0].kv_sent, stats.workers[1]
        assert (sent.pushes, sent.pushed_bytes, sent.push_failures) == (3, 6 * block_bytes, 0)
        assert (sent.count, sent.bytes, sent.failures) == (2, 3 * block_bytes, 0)
        assert (decode.prefix_queried_tokens, decode.prefix_hit_tokens) == (120, 0)
        assert stats.num_recovered == 0
        assert all(w.num_used_blocks == 0 for w in stats.workers)

        out, stats, _ = await _run(path, ["prefill", "decode"], late_third_push="fails")
        assert out == alone
        sent = stats.workers[0].kv_sent
        assert (sent.pushes, sent.pushed_bytes, sent.push_failures) == (2, 4 * block_bytes, 1)
        assert (sent.count, sent.bytes, sent.failures) == (2, 5 * block_bytes, 0)
        assert stats.num_recovered == 0
        assert all(w.num_used_blocks == 0 for w in stats.workers)

    asyncio.run(main())
