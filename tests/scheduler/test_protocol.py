"""Step plans and outputs survive msgpack unchanged; bad sampling values are named."""

from __future__ import annotations

import pytest

from scheduler.protocol import (
    ContinuedSequence,
    ForkedSequence,
    NewSequence,
    SamplingParams,
    SequenceOutput,
    StepOutput,
    StepPlan,
    StructuredOutputsParams,
    TokenLogprobs,
    WorkerStats,
    decode,
    encode,
)


def test_every_message_round_trips():
    sp = SamplingParams(n=2, temperature=0.7, top_k=5, seed=-3, stop="\n\n", logprobs=2)
    plan = StepPlan(
        step_id=7,
        new=[NewSequence("a", [1, 2, 3], 3, 0, [4, 5], 3, sp, sample_index=1)],
        continued=[ContinuedSequence("b", [9], 1), ContinuedSequence("c", [], 16)],
        forks=[ForkedSequence("a#1", "a", 1, [4, 6], 42, 5, 6)],
        finished=["d", "e"])
    back = decode(StepPlan, encode(plan))
    assert back == plan
    assert isinstance(back.new[0].sampling, SamplingParams)
    assert back.new[0].sampling.stop == ["\n\n"]
    out = StepOutput(7, [SequenceOutput("a", [5, 6], [TokenLogprobs(-0.5, [5, 1], [-0.5, -1.5]),
                                                      TokenLogprobs(-2.0, [], [])]),
                         SequenceOutput("b", [])], WorkerStats(3, 10, 0.25, 20, 2))
    assert decode(StepOutput, encode(out)) == out


def test_a_continued_decode_costs_a_few_bytes():
    plan = StepPlan(1, continued=[ContinuedSequence(f"s{i}", [], 1) for i in range(256)])
    assert len(encode(plan)) < 256 * 12


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.1, "temperature: got -0.1; allowed range is [0.0, 100.0]"),
    ("top_p", 0.0, "top_p: got 0.0; allowed range is (0.0, 1.0]"),
    ("top_k", -5, "top_k: got -5"),
    ("min_p", 1.5, "min_p: got 1.5"),
    ("n", 0, "n: got 0"),
    ("max_tokens", 0, "max_tokens: got 0"),
    ("presence_penalty", 3.0, "presence_penalty: got 3.0"),
    ("repetition_penalty", 0.0, "repetition_penalty: got 0.0"),
    ("logprobs", 21, "logprobs: got 21"),
    ("seed", "x", "seed: got 'x'; expected an integer"),
    ("stop", [""], "stop: got ''"),
    ("stop", 5, "stop: got 5; expected a string or a list of strings"),
    ("stop_token_ids", 7, "stop_token_ids: got 7; expected a list of token ids"),
    ("logit_bias", [1], "logit_bias: got [1]; expected a {token id: bias} mapping"),
])
def test_invalid_sampling_values_name_field_and_range(field, value, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert message in str(e.value)


@pytest.mark.parametrize("make,start", [
    (lambda: SamplingParams(logit_bias=list(range(100_000))), "logit_bias: got [0, 1, 2"),
    (lambda: SamplingParams(seed="9" * 100_000), "seed: got '9999"),
    (lambda: StructuredOutputsParams(choice=["x" * 100_000, ""]),
     "structured_outputs.choice: got ['xxx"),
])
def test_a_huge_bad_value_is_shown_shortened(make, start):
    """A request's values reach these messages, and a message goes back to its client:
    a huge value is shown by its start, not whole."""
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value).startswith(start) and len(str(e.value)) < 300


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1).top_k == 0
