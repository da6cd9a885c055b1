"""Decode steps through the graph runner's static buffers, padding rows and table widths
(captured eagerly here: CUDA graphs need a GPU) give the eager runner's tokens exactly."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cluster import LLM, SamplingParams
from workers.decode_graphs import table_widths
from workers.model_runner import ModelRunner


def count_graph_runs(runner) -> Counter:
    """How often each captured graph, keyed (batch size, table width), runs."""
    runs: Counter = Counter()
    graphs = runner.graphs.graphs
    for key, replay in graphs.items():
        graphs[key] = lambda key=key, replay=replay: (runs.update([key]), replay())[1]
    return runs


def shrinking_batch() -> tuple[list[dict], list[SamplingParams]]:
    """Five requests whose decode batch shrinks 5, 4, 3, 2, 1 as they finish, one of them
    a 240-token prompt whose table grows past 16 blocks (the narrowest graphs') to 17
    while it decodes."""
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()}
               for n in (7, 30, 18, 12, 240)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                     for m in (40, 12, 25, 33, 30)]


@pytest.mark.slow
def test_graph_decodes_equal_eager_decodes(tiny_factory, monkeypatch):
    """Captured sizes 1, 2, 4: 5 sequences run eagerly (over the largest), 3 padded to 4."""
    tiny = tiny_factory("llama")
    prompts, params = shrinking_batch()
    kw = dict(device="cpu", kv_cache_bytes=1 << 20, max_model_len=512)
    want = [o.outputs[0].token_ids
            for o in LLM(tiny.path, ops="torch", **kw).generate(prompts, params)]

    def graphed_runner(*args, decode_graph_sizes=None, **kwargs):
        assert decode_graph_sizes is None   # the engine's default: not enforce_eager
        return ModelRunner(*args, decode_graph_sizes=(1, 2, 4), graph_capture=lambda fn: fn,
                           **kwargs)

    monkeypatch.setattr("cluster.engine.ModelRunner", graphed_runner)
    llm = LLM(tiny.path, ops="torch", **kw)
    runner = llm.engine.runner
    assert runner.kv_caches[0].shape[1] == runner.num_blocks + 1   # the pad block
    assert set(runner.graphs.graphs) == {(b, w) for b in (1, 2, 4) for w in (16, 32)}
    runs = count_graph_runs(runner)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert set(runs) == {(4, 16), (4, 32), (2, 16), (1, 16)}


@pytest.mark.parametrize(("max_blocks", "widths"), [(8, [8]), (16, [16]), (40, [16, 32, 40]),
                                                    (512, [16, 32, 64, 128, 256, 512])])
def test_table_widths_double_up_to_the_widest(max_blocks, widths):
    assert table_widths(max_blocks) == widths


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
