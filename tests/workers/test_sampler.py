"""The sampler against independent oracles: HF logits processors, hand-written loops,
and known distributions drawn with fixed seeds (deterministic, so never flaky)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from scheduler.protocol import SamplingParams
from workers.sampler import _TOP_P_CANDIDATES, Sampler, SamplingRow, stream_seed

EOS = 2


def row(prompt=(5, 6, 7), output=(), sample_index=0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), sample_index)


def random_row(rnd: random.Random, vocab: int) -> SamplingRow:
    """A row with a random mix of every feature, each on about half the time."""
    def maybe(value, default):
        return value if rnd.random() < 0.5 else default

    prompt = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 30))]
    output = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 30))]
    params = SamplingParams(
        temperature=maybe(0.0, rnd.uniform(0.2, 2.0)),
        top_k=maybe(rnd.randrange(1, 60), 0),
        top_p=maybe(rnd.uniform(0.05, 0.99), 1.0),
        min_p=maybe(rnd.uniform(0.0, 0.3), 0.0),
        repetition_penalty=maybe(rnd.uniform(0.5, 2.0), 1.0),
        presence_penalty=maybe(rnd.uniform(-2.0, 2.0), 0.0),
        frequency_penalty=maybe(rnd.uniform(-2.0, 2.0), 0.0),
        min_tokens=maybe(rnd.randrange(0, 40), 0),
        max_tokens=None,
        seed=maybe(rnd.randrange(2**63), None),
    )
    return SamplingRow(params, prompt, output, rnd.randrange(4))


def hand_penalized(logits: torch.Tensor, r: SamplingRow, eos: list[int]) -> torch.Tensor:
    """min_tokens and all penalties for one row, the slow obvious way (HF for repetition)."""
    p = r.params
    scores = logits.clone().unsqueeze(0)
    history = torch.tensor([list(r.prompt_token_ids) + list(r.output_token_ids)])
    if len(r.output_token_ids) < p.min_tokens:
        blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else eos)
        if blocked:
            scores = MinNewTokensLengthLogitsProcessor(
                len(r.prompt_token_ids), p.min_tokens, blocked)(history, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(history, scores)
    scores = scores.squeeze(0)
    for tok in r.output_token_ids:
        scores[tok] -= p.frequency_penalty
    for tok in set(r.output_token_ids):
        scores[tok] -= p.presence_penalty
    return scores


def hf_probabilities(logits: torch.Tensor, r: SamplingRow, eos: list[int]) -> torch.Tensor:
    p = r.params
    scores = hand_penalized(logits, r, eos)
    if p.temperature == 0.0:
        return torch.nn.functional.one_hot(scores.argmax(), scores.numel()).float()
    ids = torch.zeros((1, 0), dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores.unsqueeze(0))
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores.softmax(-1).squeeze(0)


@pytest.mark.parametrize("batch_seed", range(6))
def test_probabilities_match_hf_processors_row_by_row(batch_seed: int) -> None:
    rnd = random.Random(batch_seed)
    vocab = 512
    rows = [random_row(rnd, vocab) for _ in range(16)]
    gen = torch.Generator().manual_seed(batch_seed)
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    sampler = Sampler(vocab, [EOS, 3])
    probs = sampler.probabilities(logits, rows)
    for i, r in enumerate(rows):
        expected = hf_probabilities(logits[i], r, [EOS, 3])
        torch.testing.assert_close(probs[i], expected, atol=1e-6, rtol=0, msg=f"row {i}: {r}")


def test_large_vocab_top_p_matches_hf_in_and_beyond_the_candidate_window() -> None:
    """The nucleus is sought among the best _TOP_P_CANDIDATES first: flat rows reach past it."""
    vocab = 4 * _TOP_P_CANDIDATES
    rnd = random.Random(3)
    rows, scales = [], []
    for i in range(24):
        rows.append(row(temperature=rnd.uniform(0.5, 1.5), top_p=rnd.uniform(0.3, 0.99),
                        top_k=rnd.choice([0, 0, 20, 2 * _TOP_P_CANDIDATES]),
                        min_p=rnd.choice([0.0, 0.05]), seed=i))
        scales.append(rnd.choice([0.05, 0.5, 2.0, 8.0]))
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(rows), vocab, generator=gen) * torch.tensor(scales)[:, None]
    window_mass = torch.stack([
        hf_probabilities(logits[i], row(temperature=r.params.temperature), [])
        .topk(_TOP_P_CANDIDATES).values.sum() for i, r in enumerate(rows)])
    beyond = window_mass < torch.tensor([r.params.top_p for r in rows])
    assert beyond.any() and not beyond.all()
    probs = Sampler(vocab, [EOS]).probabilities(logits, rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(probs[i], hf_probabilities(logits[i], r, [EOS]),
                                   atol=1e-6, rtol=0, msg=f"row {i}: {r}")


def test_presence_and_frequency_penalties_match_a_hand_loop() -> None:
    vocab = 64
    rows = [row(output=[1, 1, 1, 4, 9, 9], presence_penalty=0.7, frequency_penalty=0.3),
            row(output=[4, 4], presence_penalty=-1.5),
            row(output=[9, 1, 9], frequency_penalty=-2.0),
            row(output=[1, 4])]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(1))
    expected = logits.clone()
    for i, r in enumerate(rows):
        counts = {t: list(r.output_token_ids).count(t) for t in r.output_token_ids}
        for tok, c in counts.items():
            expected[i, tok] -= r.params.presence_penalty + r.params.frequency_penalty * c
    probs = Sampler(vocab, [EOS]).probabilities(logits, rows)
    torch.testing.assert_close(probs, expected.softmax(-1), atol=1e-6, rtol=0)


def test_greedy_rows_take_the_argmax_of_penalized_logits() -> None:
    rnd = random.Random(7)
    vocab = 300
    rows = [random_row(rnd, vocab) for _ in range(24)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(7)) * 2
    out = Sampler(vocab, [EOS, 3])(logits, rows)
    greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
    assert greedy
    for i in greedy:
        assert out.token_ids[i] == int(hand_penalized(logits[i], rows[i], [EOS, 3]).argmax())


def test_all_greedy_batch_is_plain_argmax_with_ties_to_lowest_id() -> None:
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(3))
    logits[0, [10, 20, 30]] = 50.0
    rows = [row(temperature=0.0) for _ in range(32)]
    out = Sampler(1000, [EOS])(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[0] == 10
    assert out.logprobs == [None] * 32


def test_seeded_row_is_the_same_alone_or_in_any_batch() -> None:
    vocab = 2000
    gen = torch.Generator().manual_seed(11)
    target_logits = torch.randn(vocab, generator=gen)
    others = [row(temperature=0.0), row(), row(seed=1), row(seed=5, sample_index=1),
              row(top_k=5, temperature=0.5), row(top_p=0.5, repetition_penalty=1.3),
              row(min_p=0.2, logprobs=3), row(presence_penalty=1.0, output=[4, 4, 8]),
              row(frequency_penalty=0.5, seed=42, output=[1])]
    for position in range(20):
        target = row(seed=1234, sample_index=2, output=list(range(position)),
                     temperature=0.9, top_p=0.95)
        alone = Sampler(vocab, [EOS], seed=0)(target_logits[None], [target]).token_ids[0]
        for slot in (0, 4, 9):
            rows = others[:slot] + [target] + others[slot:]
            logits = torch.randn(len(rows), vocab, generator=gen)
            logits[slot] = target_logits
            batched = Sampler(vocab, [EOS], seed=99)(logits, rows).token_ids[slot]
            assert batched == alone, (position, slot)


def test_sample_index_and_position_select_independent_streams() -> None:
    vocab = 50
    logits = torch.zeros(1, vocab)
    sampler = Sampler(vocab, [EOS])

    def draws(sample_index: int, seed: int = 7) -> list[int]:
        return [sampler(logits, [row(seed=seed, sample_index=sample_index,
                                     output=[0] * pos)]).token_ids[0] for pos in range(200)]

    first, second, other_seed = draws(0), draws(1), draws(0, seed=8)
    assert len(set(first)) > 30  # each position is a fresh draw
    # Independent uniform draws over 50 tokens agree about 1 time in 50.
    assert sum(a == b for a, b in zip(first, second)) < 15
    assert sum(a == b for a, b in zip(first, other_seed)) < 15
    assert first == draws(0)


def test_stream_seed_is_63_bit_and_distinct() -> None:
    seeds = {stream_seed(s, i, p) for s in (-1, 0, 2**63 - 1) for i in range(4) for p in range(50)}
    assert len(seeds) == 3 * 4 * 50
    assert all(0 <= s < 2**63 for s in seeds)


KNOWN = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


@pytest.mark.parametrize("seeded", [False, True])
def test_draws_follow_the_distribution(seeded: bool) -> None:
    n = 4000
    logits = KNOWN.log().expand(n, 5).contiguous()
    rows = [row(seed=i if seeded else None) for i in range(n)]
    out = Sampler(5, [], seed=2024)(logits, rows)
    assert (frequencies(out.token_ids, 5) - KNOWN).abs().max() < 0.03


def test_draws_follow_temperature_and_top_p() -> None:
    n = 4000
    logits = KNOWN.log().expand(n, 5).contiguous()
    hot = [row(seed=i, temperature=2.0) for i in range(n)]
    expected = KNOWN.sqrt() / KNOWN.sqrt().sum()
    freq = frequencies(Sampler(5, [], seed=1)(logits, hot).token_ids, 5)
    assert (freq - expected).abs().max() < 0.03
    # top_p=0.5 keeps the 0.3 and 0.25 tokens (0.3 alone is short of 0.5).
    nucleus = [row(seed=i, top_p=0.5) for i in range(n)]
    freq = frequencies(Sampler(5, [], seed=1)(logits, nucleus).token_ids, 5)
    expected = torch.tensor([0.0, 0.0, 0.3, 0.25, 0.0]) / 0.55
    assert (freq - expected).abs().max() < 0.03


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    vocab = 20
    logits = torch.zeros(6, vocab)
    logits[:, EOS] = 30.0
    logits[:, 7] = 20.0
    logits[:, 9] = 10.0
    rows = [row(temperature=0.0, min_tokens=3, output=[1]),
            row(temperature=0.0, min_tokens=3, output=[1, 1, 1]),
            row(temperature=0.0, min_tokens=3, output=[1], stop_token_ids=[7]),
            row(temperature=0.0, min_tokens=3, output=[1], stop_token_ids=[7], ignore_eos=True),
            row(min_tokens=3, output=[1], stop_token_ids=[7], seed=3),
            row(temperature=0.0, min_tokens=1, output=[], stop_token_ids=[EOS, 7, 9, 25])]
    out = Sampler(vocab, [EOS])(logits, rows)
    assert out.token_ids == [7, EOS, 9, EOS, 9, 0]


def test_logprobs_are_raw_with_sorted_top_n() -> None:
    vocab = 100
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(5)) * 2
    rows = [row(logprobs=5, temperature=0.7, repetition_penalty=1.5, seed=1),
            row(logprobs=0, temperature=0.0, presence_penalty=2.0, output=[3]),
            row(logprobs=20, top_k=3),
            row(),
            row(logprobs=1, min_tokens=2)]
    out = Sampler(vocab, [EOS])(logits, rows)
    raw = logits.log_softmax(-1)
    assert out.logprobs[3] is None
    for i in (0, 1, 2, 4):
        lp = out.logprobs[i]
        n = rows[i].params.logprobs
        assert lp is not None
        assert lp.token_logprob == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        values, ids = raw[i].topk(n)
        assert lp.top_token_ids == ids.tolist()
        assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert out.logprobs[1].top_token_ids == [] and out.logprobs[1].top_logprobs == []


def test_padded_vocab_columns_are_never_sampled() -> None:
    vocab, padded = 10, 16
    logits = torch.randn(6, padded, generator=torch.Generator().manual_seed(2))
    logits[:, vocab:] = 1e4
    rows = [row(temperature=0.0, logprobs=20), row(), row(seed=1, top_k=3),
            row(top_p=0.9, logprobs=2), row(repetition_penalty=0.5, output=[9, 9]),
            row(min_p=0.5)]
    sampler = Sampler(vocab, [EOS])
    for _ in range(20):
        out = sampler(logits, rows)
        assert all(0 <= t < vocab for t in out.token_ids)
    assert out.logprobs[0].top_token_ids == logits[0, :vocab].argsort(descending=True).tolist()
    assert sampler.probabilities(logits, rows).shape == (6, vocab)


def test_input_logits_are_left_unchanged() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    rows = [row(repetition_penalty=2.0, min_tokens=5), row(temperature=0.5, top_p=0.5),
            row(temperature=0.0, presence_penalty=1.0, output=[1])]
    Sampler(50, [EOS])(logits, rows)
    assert torch.equal(logits, before)


def test_wrong_logits_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler(50, [EOS])(torch.zeros(2, 40), [row(), row()])


VOCAB = 40

params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.0, 100.0)),
    top_k=st.integers(0, VOCAB + 5),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    min_p=st.floats(0.0, 1.0),
    repetition_penalty=st.floats(0.0, 100.0, exclude_min=True),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    seed=st.one_of(st.none(), st.integers(-(2**63) + 1, 2**63 - 1)),
    min_tokens=st.integers(0, 4),
    max_tokens=st.just(None),
    stop_token_ids=st.lists(st.integers(0, VOCAB + 3), max_size=3),
    ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)

rows_strategy = st.builds(
    SamplingRow,
    params=params_strategy,
    prompt_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    output_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=6),
    sample_index=st.integers(0, 3),
)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(rows_strategy, min_size=1, max_size=6),
       scale=st.floats(0.01, 100.0), logits_seed=st.integers(0, 2**32 - 1))
def test_sampled_token_always_has_nonzero_probability(rows, scale, logits_seed) -> None:
    gen = torch.Generator().manual_seed(logits_seed)
    logits = torch.randn(len(rows), VOCAB + 3, generator=gen) * scale
    sampler = Sampler(VOCAB, [EOS, VOCAB + 1])
    probs = sampler.probabilities(logits, rows)
    out = sampler(logits, rows)
    assert not probs.isnan().any()
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(rows)))
    for i, token in enumerate(out.token_ids):
        assert 0 <= token < VOCAB
        assert probs[i, token] > 0, (i, rows[i])
        lp = out.logprobs[i]
        assert (lp is None) == (rows[i].params.logprobs is None)
        if lp is not None:
            assert lp.token_logprob <= 0.0
