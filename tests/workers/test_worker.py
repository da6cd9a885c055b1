"""The worker behind the Ray actor, in one process: steps over msgpack, and a KV handoff
between two workers that continues the sequence exactly where the sender would have."""

from __future__ import annotations

import pytest
import torch

from kvcache.config import CacheConfig
from kvcache.kv_transfer import KVTransferError
from kvcache.kv_transport import HandoffPlan, Transport
from scheduler.protocol import (
    ContinuedSequence,
    NewSequence,
    SamplingParams,
    StepOutput,
    StepPlan,
    decode,
    encode,
)
from workers.worker import Worker, WorkerSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = list(range(5, 45))   # 40 tokens: 2 full blocks and 8 tokens


def _worker(path: str, role: str = "mixed", kv_dtype: str = "auto") -> Worker:
    cache = CacheConfig(kv_cache_bytes=1 << 20, kv_dtype=kv_dtype)
    return Worker(WorkerSpec(path, None, "float32", "cpu", 0, "torch", cache, None, 1), role)


def _step(worker: Worker, plan: StepPlan) -> list[int]:
    out = decode(StepOutput, worker.step(encode(plan)))
    return [t for o in out.outputs for t in o.token_ids]


def assert_handoff_continues_bit_exact(prefill: Worker, decode: Worker) -> None:
    """Prefill PROMPT on ``prefill``, hand its three blocks to ``decode`` (other block
    ids), and check the blocks arrive bit-exact and the decode worker's next token is the
    prefill worker's own continuation."""
    first = _step(prefill, StepPlan(0, new=[NewSequence("s", PROMPT, 40, 0, [0, 1, 2], 40,
                                                         GREEDY)]))
    info, batch = prefill.export_kv([0, 1, 2], [None] * 3, [16, 16, 8])
    assert decode.import_kv(batch, [7, 3, 9]) == info.nbytes > 0
    for src, dst in zip(prefill.runner.kv_caches, decode.runner.kv_caches):
        assert torch.equal(src[:, [0, 1, 2]], dst[:, [7, 3, 9]])
    here = _step(prefill, StepPlan(1, continued=[ContinuedSequence("s", [], 1)]))
    there = _step(decode, StepPlan(0, new=[NewSequence("s", PROMPT + first, 40, 40,
                                                        [7, 3, 9], 1, GREEDY)]))
    assert here == there


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_handoff_between_workers_continues_bit_exact(tiny_factory, kv_dtype):
    """int8 blocks carry their scales inside them, so they arrive bit-exact too."""
    path = tiny_factory("llama").path
    assert_handoff_continues_bit_exact(_worker(path, "prefill", kv_dtype),
                                       _worker(path, "decode", kv_dtype))


@pytest.mark.parametrize("plan", [HandoffPlan(Transport.SHARED_MEMORY, 1),
                                  HandoffPlan(Transport.OBJECT_STORE, 1),
                                  HandoffPlan(Transport.OBJECT_STORE, 2)],
                         ids=["shm", "object-store", "object-store-in-2-parts"])
def test_every_transport_moves_the_blocks_bit_exact(tiny_factory, plan):
    path = tiny_factory("llama").path
    prefill, decode_w = _worker(path, "prefill"), _worker(path, "decode")
    _step(prefill, StepPlan(0, new=[NewSequence("s", PROMPT, 40, 0, [0, 1, 2], 40, GREEDY)]))
    info, *batches = prefill.export_kv([2, 0, 1], [None] * 3, [16, 16, 8], plan)
    assert info.transport is plan.transport and len(batches) == plan.parts
    assert decode_w.import_kv(batches[0], [7, 3, 9], 0, None, *batches[1:]) == info.nbytes
    for src, dst in zip(prefill.runner.kv_caches, decode_w.runner.kv_caches):
        assert torch.equal(src[:, [2, 0, 1]], dst[:, [7, 3, 9]])


@pytest.mark.parametrize("other", ["kv_dtype", "int8_kv", "model"])
def test_a_batch_for_another_pool_is_refused_untouched(tiny_factory, other):
    path = tiny_factory("llama").path
    sender = _worker(path)
    receiver = (_worker(path, kv_dtype="float16") if other == "kv_dtype"
                else _worker(path, kv_dtype="int8") if other == "int8_kv"
                else _worker(tiny_factory("qwen2").path))
    _step(sender, StepPlan(0, new=[NewSequence("s", PROMPT, 40, 0, [0, 1, 2], 40, GREEDY)]))
    _, batch = sender.export_kv([0, 1, 2], [None] * 3, [16, 16, 8])
    before = [kv.clone() for kv in receiver.runner.kv_caches]
    with pytest.raises(KVTransferError, match="fingerprint" if other == "model" else "dtype"):
        receiver.import_kv(batch, [0, 1, 2])
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.runner.kv_caches))


def test_unknown_role_is_refused(tiny_factory):
    with pytest.raises(ValueError, match="role: got 'verifier'; allowed: prefill, decode, mixed"):
        _worker(tiny_factory("llama").path, "verifier")


def test_host_rows_need_a_host_transport_and_a_host_tier(tiny_factory):
    """This worker has no host tier, and a device transport never carries host rows."""
    worker = _worker(tiny_factory("llama").path)
    for plan in (HandoffPlan(Transport.OBJECT_STORE, 1, None, 1, (3,)),
                 HandoffPlan(Transport.SHARED_MEMORY, 1, None, 1, (3,)),
                 HandoffPlan(Transport.DEVICE, 1, "nixl", 1, (3,))):
        with pytest.raises(ValueError, match="1 rows from the host tier through "
                                             f"{plan.transport.value}; expected a host"):
            worker.export_kv([0], [None] * 2, [16, 16], plan)
