"""Structured output: the grammar mask in the sampler, on the default model's tokenizer.

Oracles: ``json`` + ``jsonschema`` (a finished constrained output must parse and validate
against the schema it was asked for), Python's ``re`` for regexes (``[0-9]``, not ``\\d``,
which llguidance reads as Unicode's digits, of a newer Unicode than Python's), and the
sampler's own output for the same rows without any constrained neighbour.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.protocol import SamplingParams, StructuredOutputsParams, decode, encode
from workers.sampler import Sampler, SamplingRow
from workers.structured_output import StructuredOutputs, grammar_for, unpack_bitmask
from workers.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_path) -> Tokenizer:
    from workers.loading import cache_root
    from workers.loading.gguf_checkpoint import converted_dir

    conv = converted_dir(Path(default_model_path), cache_root(), require_tokenizer=True)
    return Tokenizer.from_hf_dir(conv.directory)


@pytest.fixture(scope="module")
def grammar(tokenizer) -> StructuredOutputs:
    return StructuredOutputs(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


# Schemas whose every instance is short, so a random walk through the grammar ends.
_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 1000)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda xs: {"enum": xs},
              st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4,
                       unique=True)),
)
_schemas = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n},
              inner, st.integers(0, 3)),
    st.builds(lambda props: {"type": "object", "properties": props,
                             "required": sorted(props), "additionalProperties": False},
              st.dictionaries(st.sampled_from(["a", "bb", "name", "x_1"]), inner,
                              min_size=1, max_size=3))), max_leaves=6)


def _walk(grammar: StructuredOutputs, spec: StructuredOutputsParams, seed: int,
          max_tokens: int = 80) -> tuple[list[int], bool]:
    """Sample from random logits under ``spec``'s mask until EOS; checks every step that
    the sampled token is allowed and that disallowed tokens have no probability."""
    sampler = Sampler(grammar.vocab_size, grammar.eos_token_ids, seed=seed)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    matcher = grammar.matcher(spec, [])
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        mask = grammar.masks_async([matcher]).result()
        allowed = unpack_bitmask(mask, grammar.vocab_size)[0]
        logits = torch.randn(1, grammar.vocab_size, generator=gen) * 4
        row = SamplingRow(params, [1], out, grammar_mask=mask[0])
        probs = sampler.probabilities(logits, [row])[0]
        assert probs[~allowed].sum().item() == 0.0
        token = sampler(logits, [row]).token_ids[0]
        assert allowed[token], f"sampled token {token}, which the mask forbids"
        if token in grammar.eos_token_ids:
            return out, True
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    return out, False


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schemas, seed=st.integers(0, 2**16))
def test_mask_never_lets_an_invalid_token_through(grammar, tokenizer, schema, seed):
    tokens, finished = _walk(grammar, StructuredOutputsParams(json=schema), seed)
    text = tokenizer.decode(tokens)
    if finished:
        jsonschema.validate(json.loads(text), schema)   # the whole output is a valid instance
    else:   # an 80-token walk may still be inside whitespace; what came is a valid prefix
        assert grammar.matcher(StructuredOutputsParams(json=schema), tokens) is not None


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_regex_and_choice_outputs_match(grammar, tokenizer, seed):
    tokens, finished = _walk(grammar, StructuredOutputsParams(regex=r"[a-c]{2,5}-[0-9]{3}"), seed)
    assert finished and re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", tokenizer.decode(tokens))
    choices = ["Paris", "Rome", "New York"]
    tokens, finished = _walk(grammar, StructuredOutputsParams(choice=choices), seed)
    assert finished and tokenizer.decode(tokens) in choices


def test_spec_survives_the_wire_and_bad_specs_are_refused():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    back = decode(SamplingParams, encode(params))
    assert back.structured_outputs == params.structured_outputs
    assert json.loads(back.structured_outputs.json)["properties"]["a"] == {"type": "integer"}
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: cannot be compiled"):
        grammar_for(StructuredOutputsParams(regex="a(b"))
    with pytest.raises(ValueError, match="structured_outputs.json"):
        grammar_for(StructuredOutputsParams(json="{not json"))


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(grammar="start: start"),
    StructuredOutputsParams(grammar="start: a\na: b\nb: a"),
    StructuredOutputsParams(json={"$ref": "#"})])
def test_a_grammar_that_no_text_can_start_is_refused(spec):
    """Before, such a sequence got a mask with no token and ended at once, empty, as if
    its text had matched."""
    with pytest.raises(ValueError, match="cannot be compiled .no text matches it"):
        grammar_for(spec)


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(grammar='start: ""'), StructuredOutputsParams(regex="a*"),
    StructuredOutputsParams(grammar='start: x\nx: "a" x')])
def test_a_grammar_some_text_starts_is_kept(spec):
    """The empty text, or a text that only grows, still starts: nothing to refuse."""
    assert grammar_for(spec)


@pytest.fixture(scope="module")
def llm():
    from cluster.llm import LLM

    return LLM()


@pytest.mark.slow
def test_constrained_and_unconstrained_rows_do_not_affect_each_other(llm):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    free = SamplingParams(temperature=0.8, seed=7, max_tokens=24)
    bound = SamplingParams(temperature=0.8, seed=8, max_tokens=40,
                           structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ["The capital of France is", "Answer in JSON: the capital of Italy."]
    together = llm.generate(prompts, [free, bound])
    alone_free = llm.generate(prompts[:1], free)[0].outputs[0]
    alone_bound = llm.generate(prompts[1:], bound)[0].outputs[0]
    assert together[0].outputs[0].token_ids == alone_free.token_ids
    assert together[1].outputs[0].token_ids == alone_bound.token_ids
    jsonschema.validate(json.loads(alone_bound.text), schema)
    assert alone_bound.finish_reason == "stop"


@pytest.mark.slow
def test_forked_children_keep_to_the_grammar(llm):
    """n > 1: each child is forked from the parent after the prompt, with its own first
    token; its matcher must start from that token, not the parent's."""
    choices = ["red", "green", "blue", "yellow"]
    params = SamplingParams(n=4, temperature=1.5, seed=3, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    outs = llm.generate("My favourite colour is", params)[0].outputs
    assert len(outs) == 4 and all(o.text in choices for o in outs)
    assert all(o.finish_reason == "stop" for o in outs)
