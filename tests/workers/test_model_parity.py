"""Logits and greedy text of the whole engine against HF transformers.

Tiny random checkpoints of every supported family go through the real loader, the
scheduler, the msgpack seam and the paged KV pool. A spy on the sampler records the
logits of every sampled step together with the context they followed; HF's forward
over each finished sequence gives the oracle logits for every such context.
"""

from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams

ARCHS = ["llama", "llama3-rope", "qwen2", "qwen3", "pangu"]
TOL = 1e-4


class LogitsSpy:
    """Wraps the real sampler; remembers (context, logits row) for every sampled row."""

    def __init__(self, sampler) -> None:
        self.inner = sampler
        self.rows: list[tuple[list[int], torch.Tensor]] = []

    def __call__(self, logits, rows):
        for row_logits, row in zip(logits, rows):
            context = list(row.prompt_token_ids) + list(row.output_token_ids)
            self.rows.append((context, row_logits.clone()))
        return self.inner(logits, rows)


def spy_on(llm: LLM) -> LogitsSpy:
    spy = LogitsSpy(llm.engine.runner.sampler)
    llm.engine.runner.sampler = spy
    return spy


def assert_logits_match_hf(hf, spy: LogitsSpy, finals: list[list[int]],
                           tol: float = TOL) -> float:
    """The largest difference from HF's logits (on HF's device), checked against ``tol``."""
    with torch.no_grad():
        oracle = [hf(torch.tensor([f], device=hf.device)).logits[0] for f in finals]
    assert spy.rows
    worst = 0.0
    for context, row in spy.rows:
        j = next(i for i, f in enumerate(finals) if f[:len(context)] == context)
        worst = max(worst, (oracle[j][len(context) - 1] - row).abs().max().item())
    assert worst <= tol, f"max |logits - HF| = {worst}"
    return worst


def prompts_for(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 40, 17, 33, 1)]
    prompts.append(prompts[1][:32] + [7, 8, 9])  # shares two blocks with prompt 1
    return prompts


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt], device=hf.device), max_new_tokens=n,
                      min_new_tokens=n, do_sample=False,
                      attention_mask=torch.ones(1, len(prompt), device=hf.device))
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [2048, 24], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("ops", ["auto", "torch"], ids=["device-ops", "reference-ops"])
def test_mixed_batch_matches_hf(tiny_factory, arch, budget, ops):
    tiny = tiny_factory(arch)
    llm = LLM(tiny.path, device="cpu", kv_cache_bytes=4 << 20,
              max_num_batched_tokens=budget, ops=ops)
    assert llm.engine.runner.ops.name == ("cpu" if ops == "auto" else "torch")
    spy = spy_on(llm)
    prompts = prompts_for(0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    finals = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    assert_logits_match_hf(tiny.hf, spy, finals)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny.hf, p, 12)
    assert llm.engine.scheduler.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_after_prefix_cache_hit_matches_hf(tiny_factory, arch):
    tiny = tiny_factory(arch)
    llm = LLM(tiny.path, device="cpu", kv_cache_bytes=4 << 20)
    base = prompts_for(1)[1]
    llm.generate({"prompt_token_ids": base}, GREEDY)
    spy = spy_on(llm)
    follow = base[:36] + [11, 12, 13, 14]
    out = llm.generate({"prompt_token_ids": follow}, GREEDY)[0]
    stats = llm.engine.scheduler.kv.stats
    assert stats.hit_tokens >= 32
    assert_logits_match_hf(tiny.hf, spy, [follow + out.outputs[0].token_ids])


@pytest.mark.parametrize("arch", ["llama", "pangu"])
def test_preemption_and_recompute_match_hf(tiny_factory, arch):
    tiny = tiny_factory(arch)
    # 2 layers x 2 KV heads x 16 dims x fp32: 8 KiB per 16-token block; 14 blocks.
    llm = LLM(tiny.path, device="cpu", kv_cache_bytes=14 * 8192, max_model_len=200,
              max_num_batched_tokens=256)
    spy = spy_on(llm)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (30, 41, 25, 37, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.scheduler.num_preemptions > 0
    finals = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    assert_logits_match_hf(tiny.hf, spy, finals)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny.hf, p, 30)
    assert llm.engine.scheduler.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("block_size", [32, 256])
def test_other_block_sizes_match_hf(tiny_factory, block_size):
    tiny = tiny_factory("qwen2")
    llm = LLM(tiny.path, device="cpu", kv_cache_bytes=8 << 20, block_size=block_size,
              max_num_batched_tokens=24)
    spy = spy_on(llm)
    prompts = prompts_for(2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_logits_match_hf(tiny.hf, spy, [p + o.outputs[0].token_ids
                                          for p, o in zip(prompts, outs)])
