"""Sparse-retrieval attention in the one-process engine, against dense attention.

With a budget that selects every middle block, a sparse step attends to exactly the
dense step's blocks in the same order, so its logits must be bit-identical to dense,
in sparse mode (all KV on the device) and in offload mode (middle blocks recalled from
the host tier into recall blocks), for every model family, whole and chunked prefill,
and for sequences that cross both boundaries while they decode. Block summaries must
equal summaries recomputed from the blocks' keys after every step.
"""

from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.config import config_from_dict
from kvcache.block_summary import summarize
from kvcache.long_context import SUMMARY_KINDS

ARCHS = ["llama", "llama3-rope", "qwen2", "qwen3", "pangu"]
# Scaled-down regions: 32 initial + 64 local tokens, 32-token retrieval blocks.
REGIONS = dict(enabled=True, initial_tokens=32, local_tokens=64, retrieval_block_size=32,
               dense_boundary=256, offload_boundary=384, host_kv_bytes=4 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def prompts() -> list[list[int]]:
    """One prompt that crosses both boundaries while decoding, one that starts sparse and
    crosses into offload, one that starts in offload mode, one that stays dense."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (230, 350, 420, 90)]


def make_llm(path: str, long_context: dict | None, chunk: int = 2048,
             kv_dtype: str = "auto", ops: str = "auto", caching: bool = True) -> LLM:
    return LLM(config=config_from_dict({
        "model": {"path": path, "ops": ops},
        "cache": {"kv_cache_bytes": 4 << 20, "kv_dtype": kv_dtype,
                  "enable_prefix_caching": caching},
        "scheduler": {"max_num_batched_tokens": chunk},
        "long_context": long_context or {}}))


class LogitsRecorder:
    def __init__(self, llm: LLM) -> None:
        self.inner = llm.engine.runner.sampler
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        llm.engine.runner.sampler = self

    def __call__(self, logits, rows):
        for row_logits, row in zip(logits, rows):
            context = tuple(row.prompt_token_ids) + tuple(row.output_token_ids)
            self.rows[context] = row_logits.clone()
        return self.inner(logits, rows)


def generate(llm: LLM) -> tuple[list[list[int]], dict]:
    spy = LogitsRecorder(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY)
    return [o.outputs[0].token_ids for o in outs], spy.rows


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "kv_dtype"), [(a, "auto") for a in ARCHS] + [("llama", "int8")])
@pytest.mark.parametrize("chunk", [2048, 96], ids=["whole", "chunked"])
def test_full_budget_is_bit_identical_to_dense(tiny_long_factory, arch, kv_dtype, chunk):
    """int8 KV too: its rows go to the host tier and back as stored, and its summaries
    are of the dequantized keys."""
    path = tiny_long_factory(arch).path
    dense_tokens, dense_rows = generate(make_llm(path, None, chunk, kv_dtype))
    for mode in ("sparse", "offload"):
        regions = {**REGIONS, "top_k_percent": 1.0}
        if mode == "sparse":
            regions["offload_boundary"] = 2048
        llm = make_llm(path, regions, chunk, kv_dtype)
        tokens, rows = generate(llm)
        assert tokens == dense_tokens, mode
        assert rows.keys() == dense_rows.keys()
        for context, row in rows.items():
            assert torch.equal(row, dense_rows[context]), (mode, len(context))
        stats = llm.engine.runner.long_context.stats
        assert stats.selections > 0
        if mode == "offload":
            assert stats.offloaded_blocks > 0 and stats.recalled_blocks > 0


@pytest.mark.slow
def test_reused_selections_keep_the_full_budget_bit_identical(tiny_long_factory):
    """With ``reselect_every`` 3 a row reuses its last selection two steps in three while
    its middle keeps its size: far fewer selections run, and the tables laid out from the
    reused ones (written for all device rows at once, or recalled in offload mode) still
    give dense's logits at the full budget."""
    path = tiny_long_factory("llama").path
    dense_tokens, dense_rows = generate(make_llm(path, None))
    selections = {}
    for every in (1, 3):
        llm = make_llm(path, {**REGIONS, "top_k_percent": 1.0, "reselect_every": every})
        tokens, rows = generate(llm)
        assert tokens == dense_tokens
        assert all(torch.equal(row, dense_rows[context]) for context, row in rows.items())
        selections[every] = llm.engine.runner.long_context.stats.selections
    assert 0 < selections[3] < 0.6 * selections[1]


def test_small_budget_attends_fewer_blocks_and_differs(tiny_long_factory):
    """A 20% budget recalls only part of the middle, so the logits move (the sparse path
    is really taken), while the tokens of a dense-only prompt stay dense's."""
    path = tiny_long_factory("llama").path
    dense_tokens, dense_rows = generate(make_llm(path, None))
    llm = make_llm(path, {**REGIONS, "top_k_percent": 0.2})
    tokens, rows = generate(llm)
    assert tokens[3] == dense_tokens[3]
    long_rows = [c for c in rows if len(c) > 300 and c in dense_rows]
    assert long_rows and any(not torch.equal(rows[c], dense_rows[c]) for c in long_rows)
    stats = llm.engine.runner.long_context.stats
    assert stats.recalled_blocks > 0 and stats.recall_hits > 0


@pytest.mark.parametrize("ops", ["torch", "auto"])
def test_offload_attends_what_sparse_attends(tiny_long_factory, ops):
    """The host tier changes where middle blocks live, not which are attended: at a 20%
    budget, every logit equals a run whose offload boundary is out of reach, for the
    prompts that grow from sparse into offload mode too (the middle's summaries go on
    from the sparse mode's, each block once)."""
    path = tiny_long_factory("llama").path
    sparse_tokens, sparse_rows = generate(
        make_llm(path, {**REGIONS, "offload_boundary": 2048}, ops=ops))
    llm = make_llm(path, REGIONS, ops=ops)
    tokens, rows = generate(llm)
    assert tokens == sparse_tokens
    assert all(torch.equal(row, sparse_rows[context]) for context, row in rows.items())
    assert llm.engine.runner.long_context.stats.offloaded_blocks > 0


@pytest.mark.parametrize(("caching", "every", "steps"),
                         [(True, 1, 9), (False, 1, 38), (True, 3, 25), (False, 3, 38)],
                         ids=["cached", "uncached", "cached-reselect-3", "uncached-reselect-3"])
def test_a_preempted_sequence_goes_on_as_it_would_have(tiny_long_factory, caching, every,
                                                       steps):
    """Preempted 37 tokens into its output in offload mode (a 420-token prompt), a
    sequence ends with the tokens of a run never preempted. Its recompute replays its
    sparse steps: with its blocks still cached, only those after its last full block
    (448..456, 9 steps to its next token); else all from its prompt's end (a prefill,
    then 37 steps). Selecting every 3rd step, the step at 448 reused the selection of
    447, so the replay starts at the last block boundary where a step selected: 432
    (25 steps)."""
    path = tiny_long_factory("llama").path
    prompt = prompts()[2]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = make_llm(path, {**REGIONS, "reselect_every": every}, caching=caching)
    want = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("r", None, prompt, params, 0)
    engine.step()
    (seq,) = engine.scheduler.seqs.values()
    while seq.num_output_tokens < 37:
        engine.step()
    engine.scheduler._preempt(seq)
    taken = 0
    while seq.num_output_tokens == 37:
        engine.step()
        taken += 1
    assert taken == steps
    while engine.has_unfinished():
        engine.step()
    assert seq.token_ids[len(prompt):] == want


@pytest.mark.parametrize("kind", SUMMARY_KINDS)
def test_summaries_match_the_keys_after_every_step(tiny_long_factory, kind):
    path = tiny_long_factory("qwen3").path
    llm = make_llm(path, {**REGIONS, "top_k_percent": 0.2, "summary": kind}, chunk=96)
    engine = llm.engine
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", None, p, GREEDY)
    runner, lc = engine.runner, engine.runner.long_context
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for state in runner.seqs.values():
            n = state.num_computed_tokens
            bs = runner.block_size
            blocks = [(b, min(bs, n - i * bs)) for i, b in enumerate(state.block_ids)
                      if b >= 0 and i * bs < n]
            ids = torch.tensor([b for b, _ in blocks])
            counts = torch.tensor([c for _, c in blocks])
            for layer, kv in enumerate(runner.kv_caches):
                want = summarize(kv[0][ids], counts, lc.config.summary)
                assert torch.equal(lc.summaries[layer][ids], want)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("sender_long_context", [True, False], ids=["sent", "recomputed"])
def test_summaries_survive_a_handoff(tiny_long_factory, sender_long_context):
    """The receiver holds the sender's summaries of the handed-over blocks: taken from the
    KV batch, or recomputed from the received keys when the sender sent none."""
    from kvcache.config import CacheConfig
    from kvcache.long_context import LongContextConfig
    from scheduler.protocol import NewSequence, StepPlan, encode
    from workers.worker import Worker, WorkerSpec

    path = tiny_long_factory("qwen2").path
    lc = LongContextConfig(**REGIONS)

    def worker(long_context):
        return Worker(WorkerSpec(path, None, "float32", "cpu", 0, "auto",
                                 CacheConfig(kv_cache_bytes=1 << 20), None, 1, long_context),
                      "mixed")

    sender, receiver = worker(lc if sender_long_context else None), worker(lc)
    prompt = prompts()[0][:100]                # 6 full blocks and 4 tokens
    src, dst = [3, 0, 5, 1, 2, 6, 4], [9, 12, 7, 8, 10, 11, 13]
    sender.step(encode(StepPlan(0, new=[NewSequence("s", prompt, 100, 0, src, 100, GREEDY)])))
    counts = [16] * 6 + [4]
    _, batch = sender.export_kv(src, [None] * 7, counts)
    assert ("summary" in batch.schema.names) == sender_long_context
    receiver.import_kv(batch, dst)
    got = receiver.runner.long_context.summaries[:, dst]
    ids = torch.tensor(src)
    want = torch.stack([summarize(kv[0][ids], torch.tensor(counts), lc.summary)
                        for kv in sender.runner.kv_caches])
    assert torch.equal(got, want)
    if sender_long_context:
        assert torch.equal(got, sender.runner.long_context.summaries[:, src])
