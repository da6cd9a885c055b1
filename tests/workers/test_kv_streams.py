"""Handoff copies on a side stream: the stream/event calls a worker makes (recorded by
the fake torch.npu) put each copy after the steps queued before it, make only the first
step that reads imported blocks wait for them, and leave the handoff bit-exact."""

from __future__ import annotations

import torch

from kvcache.config import CacheConfig
from scheduler.protocol import (
    ContinuedSequence,
    NewSequence,
    SamplingParams,
    StepOutput,
    StepPlan,
    decode,
    encode,
)
from workers.kv_streams import KVTransferStreams, transfer_streams
from workers.worker import Worker, WorkerSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = list(range(5, 45))   # 40 tokens: 2 full blocks and 8 tokens


def _worker(path: str, role: str) -> Worker:
    cache = CacheConfig(block_size=16, kv_cache_bytes=1 << 20)
    w = Worker(WorkerSpec(path, None, "float32", "cpu", 0, "torch", cache, None, 1), role)
    w.streams = KVTransferStreams(torch.npu)   # CPU tensors, the NPU's stream protocol
    return w


def _step(worker: Worker, plan: StepPlan) -> list[int]:
    out = decode(StepOutput, worker.step(encode(plan)))
    return [t for o in out.outputs for t in o.token_ids]


def _log(state, since: int) -> list[tuple]:
    """The stream/event calls since ``since``, as (name, stream-or-event, ...)."""
    return [(c.name, *c.args.values()) for c in state.calls[since:]
            if c.name.startswith(("stream.", "event."))]


def test_handoff_copies_run_on_a_side_stream_ordered_by_events(fake_npu, tiny_factory):
    path = tiny_factory("llama").path
    state = fake_npu()
    prefill, decode_w = _worker(path, "prefill"), _worker(path, "decode")
    first = _step(prefill, StepPlan(0, new=[NewSequence("s", PROMPT, 40, 0, [0, 1, 2], 40,
                                                         GREEDY)]))
    side = prefill.streams.side.name

    mark = len(state.calls)
    _, batch = prefill.export_kv([0, 1, 2], [None] * 3, [16, 16, 8])
    (_, ready, _), wait, enter, (_, done, _), leave, sync = _log(state, mark)
    assert wait == ("stream.wait_event", side, ready)          # after the queued steps
    assert enter == ("stream.enter", side) and leave == ("stream.exit", side)
    assert sync == ("event.synchronize", done)                 # the batch is on the host

    side = decode_w.streams.side.name
    mark = len(state.calls)
    decode_w.import_kv(batch, [7, 3, 9])
    log = _log(state, mark)
    assert [e[0] for e in log] == ["event.record", "stream.wait_event", "stream.enter",
                                   "event.record", "stream.exit"]   # no host wait
    imported = log[3][1]
    assert log[3][2] == side
    for src, dst in zip(prefill.runner.kv_caches, decode_w.runner.kv_caches):
        assert torch.equal(src[:, [0, 1, 2]], dst[:, [7, 3, 9]])

    # A step over other blocks does not wait for the import; the first step reading the
    # imported blocks waits on the device (the compute stream), once.
    mark = len(state.calls)
    _step(decode_w, StepPlan(0, new=[NewSequence("o", PROMPT[:10], 10, 0, [0], 10, GREEDY)]))
    assert _log(state, mark) == []
    here = _step(prefill, StepPlan(1, continued=[ContinuedSequence("s", [], 1)]))
    mark = len(state.calls)
    there = _step(decode_w, StepPlan(1, new=[NewSequence("s", PROMPT + first, 40, 40,
                                                          [7, 3, 9], 1, GREEDY)]))
    assert _log(state, mark) == [("stream.wait_event", "compute", imported)]
    assert here == there
    mark = len(state.calls)
    _step(decode_w, StepPlan(2, new=[NewSequence("t", PROMPT[:5], 5, 0, [7], 5, GREEDY)],
                             finished=["s"]))
    assert _log(state, mark) == []


def test_the_cpu_has_no_side_stream():
    assert transfer_streams(torch.device("cpu")) is None
