"""The cluster on the real default model (SmolLM2-135M-Instruct): greedy text and tokens
equal the one-process engine's for 1 prefill + 1 decode, 2 + 2 and one mixed worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.config import config_from_dict

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three prime numbers.", "Explain what a CPU does in one sentence.",
             "Hi!"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PRESET = Path(__file__).resolve().parents[2] / "configs" / "cpu-1p1d.yaml"
KV_BYTES = 64 << 20


def _conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected():
    outs = LLM(kv_cache_bytes=KV_BYTES).chat(_conversations(), GREEDY)
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


def _cluster_config(name: str, pools: list[dict]):
    return config_from_dict({"cache": {"kv_cache_bytes": KV_BYTES},
                             "cluster": {"name": name, "prefill_threshold": 32,
                                         "pools": pools}})


@pytest.mark.parametrize("layout", ["preset-1p1d", "2p2d", "mixed"])
def test_greedy_chat_equals_the_one_process_engine(ray_instance, expected, layout):
    if layout == "preset-1p1d":
        # The documented usage: the preset file, with a smaller KV pool for the test.
        llm = LLM(config=PRESET, kv_cache_bytes=KV_BYTES)
    else:
        pools = ([{"role": "prefill", "count": 2, "resources": {"CPU": 0.5}},
                  {"role": "decode", "count": 2, "resources": {"CPU": 0.5}}]
                 if layout == "2p2d" else [{"role": "mixed", "resources": {"CPU": 1}}])
        llm = LLM(config=_cluster_config(f"default-{layout}", pools))
    try:
        outs = llm.chat(_conversations(), GREEDY)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs] == expected
    if layout != "mixed":   # the long chat prompts went through a KV handoff
        assert sum(w.kv_sent.count for w in stats.workers) >= 4


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0"])
def test_killed_worker_mid_run_changes_no_text(ray_instance, expected, mid_run_kill, victim):
    """1 prefill + 1 decode on the default model; one worker is killed mid-run (see
    ``MidRunKill``). The survivor takes over (mixed fallback) and every answer equals
    the one-process engine's."""
    config = _cluster_config(f"default-kill-{victim}",
                             [{"role": "prefill", "resources": {"CPU": 0.5}},
                              {"role": "decode", "resources": {"CPU": 0.5}}])
    config.scheduler.max_num_batched_tokens = 64   # prefills span many steps
    llm = LLM(config=config)
    engine = llm.engine
    tok = llm.get_tokenizer()
    try:
        kill = mid_run_kill(engine, victim)
        ids = []
        for i, conv in enumerate(_conversations()):
            text = tok.apply_chat_template(conv, add_generation_prompt=True)
            _, tokens = engine.tokenize_prompt(text, add_special_tokens=False)
            engine.add_request(f"k{i}", text, tokens, GREEDY, stream=True)
            ids.append(f"k{i}")
        done, seen = {}, 0
        while engine.has_unfinished():
            for out in engine.step():
                seen += 1
                kill(seen)
                if out.finished:
                    done[out.request_id] = (out.outputs[0].text, out.outputs[0].token_ids)
        stats = engine.stats()
    finally:
        llm.shutdown()
    assert [done[r] for r in ids] == expected
    assert kill.killed_at is not None
    assert stats.num_recovered > 0
