"""Decode steps through the graph runner's static buffers and padding rows (captured
eagerly here: CUDA graphs need a GPU) give the eager runner's tokens exactly."""

from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from workers.model_runner import ModelRunner


@pytest.mark.slow
def test_graph_decodes_equal_eager_decodes(tiny_factory, monkeypatch):
    tiny = tiny_factory("llama")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 30, 18, 12, 25)]
    # Different lengths: the batch shrinks 5 (eager: over the largest size), 4, 3 (padded
    # to 4), 2, 1 as sequences finish.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (40, 12, 25, 33, 18)]
    kw = dict(device="cpu", kv_cache_bytes=1 << 20, max_model_len=128)
    want = [o.outputs[0].token_ids
            for o in LLM(tiny.path, ops="torch", **kw).generate(
                [{"prompt_token_ids": p} for p in prompts], params)]

    replays: dict[int, int] = {}

    def eager_capture(fn):
        def replay():
            out = fn()
            replays[out.shape[0]] = replays.get(out.shape[0], 0) + 1
            return out
        return replay

    def graphed_runner(*args, decode_graph_sizes=None, **kwargs):
        assert decode_graph_sizes is None   # the engine's default: not enforce_eager
        return ModelRunner(*args, decode_graph_sizes=(1, 2, 4), graph_capture=eager_capture,
                           **kwargs)

    monkeypatch.setattr("cluster.engine.ModelRunner", graphed_runner)
    llm = LLM(tiny.path, ops="torch", **kw)
    runner = llm.engine.runner
    assert runner.kv_caches[0].shape[1] == runner.num_blocks + 1   # the pad block
    got = [o.outputs[0].token_ids
           for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert set(replays) == {1, 2, 4} and replays[4] > 0


def test_enforce_eager_reaches_the_runner_as_no_graph_sizes(tiny_factory, monkeypatch):
    """``enforce_eager`` (vLLM's flag) asks for no graphs; unset leaves the device's
    default (graphs on CUDA, tested in test_cuda_gpu)."""
    asked: list = []

    def recording_runner(*args, **kwargs):
        asked.append(kwargs["decode_graph_sizes"])
        return ModelRunner(*args, **kwargs)

    monkeypatch.setattr("cluster.engine.ModelRunner", recording_runner)
    for eager in (True, False):
        LLM(tiny_factory("llama").path, device="cpu", kv_cache_bytes=1 << 20,
            enforce_eager=eager)
    assert asked == [(), None]
