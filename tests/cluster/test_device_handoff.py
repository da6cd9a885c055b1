"""A KV handoff through a Ray Direct Transport, for real: two worker actors in a gloo
collective group (the transport Ray has for host tensors, standing in for NIXL, NCCL or
HCCL on accelerators) hand a sequence over bit for bit, the scheduler's plan names the
device transport, and the receiver decodes on exactly as the sender would have."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.ray_worker import RayWorkerHandle
from kvcache.config import CacheConfig
from kvcache.kv_transport import Transport, plan_handoff
from scheduler.protocol import ContinuedSequence, NewSequence, StepOutput, StepPlan, decode, encode
from tests.workers.test_worker import GREEDY, PROMPT
from workers.worker import Worker, WorkerSpec

pytestmark = pytest.mark.slow


def _step(ray, actor, plan: StepPlan) -> list[int]:
    out = decode(StepOutput, ray.get(actor.step.remote(encode(plan))))
    return [t for o in out.outputs for t in o.token_ids]


def test_a_handoff_through_gloo_is_bit_exact_and_says_so(ray_instance, tiny_factory):
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    ray = ray_instance
    spec = WorkerSpec(tiny_factory("llama").path, None, "float32", "cpu", 0, "torch",
                      CacheConfig(kv_cache_bytes=1 << 20), None, 1, tensor_transport="gloo")
    cls = ray.remote(num_cpus=0, enable_tensor_transport=True)(Worker)
    sender, receiver = cls.remote(spec, "prefill"), cls.remote(spec, "decode")
    group = create_collective_group([sender, receiver], backend="torch_gloo")
    try:
        src_place, dst_place = (ray.get(a.info.remote()).place for a in (sender, receiver))
        plan = plan_handoff(src_place, dst_place, 3)
        assert (plan.transport, plan.tensor_transport) == (Transport.DEVICE, "gloo")
        first = _step(ray, sender, StepPlan(0, new=[NewSequence("s", PROMPT, 40, 0, [2, 0, 1],
                                                                40, GREEDY)]))
        export = RayWorkerHandle(sender).export_kv([2, 0, 1], [None] * 3, [16, 16, 8], plan)

        async def move() -> tuple[object, int]:
            info = await export.ready()
            return info, await RayWorkerHandle(receiver).import_kv(export, [7, 3, 9], 0, [])

        info, nbytes = asyncio.run(move())
        assert info.label == "device:gloo" and nbytes == info.nbytes > 0
        def blocks(actor, ids: list[int]) -> list[torch.Tensor]:
            return ray.get(actor.__ray_call__.remote(
                lambda w, ids: [kv[:, ids].clone() for kv in w.runner.kv_caches], ids))

        sent, got = blocks(sender, [2, 0, 1]), blocks(receiver, [7, 3, 9])
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(sent, got))
        here = _step(ray, sender, StepPlan(1, continued=[ContinuedSequence("s", [], 1)]))
        there = _step(ray, receiver, StepPlan(0, new=[NewSequence(
            "s", PROMPT + first, 40, 40, [7, 3, 9], 1, GREEDY)]))
        assert here == there
    finally:
        destroy_collective_group(group)
        for a in (sender, receiver):
            ray.kill(a)

