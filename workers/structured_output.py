"""Token masks for structured output: JSON schemas, regexes, choices and grammars.

llguidance does the work (vLLM's default backend too): a spec becomes an llguidance
grammar, each constrained sequence keeps a matcher that has consumed its output tokens,
and before each sampling step the matchers fill one bitmask row each (bit ``t`` set:
token ``t`` may come next). The masks are computed on a helper thread while the forward
pass runs (llguidance releases the GIL), so they cost the step little; the sampler
applies them to the rows that have one. llguidance was chosen over xgrammar because it
installs without dependencies and compiles a schema ~10x faster, at a similar mask cost
per token (benchmarks/RESULTS.md, "Structured output").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import tokenizers
import torch

from scheduler.protocol import StructuredOutputsParams
from workers.tokenizer import Tokenizer


@functools.lru_cache(maxsize=256)
def _grammar_cached(kind: str, text: str) -> str:
    if kind == "json":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(text)
    elif kind == "choice":
        grammar = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    else:
        grammar = llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(error)
    _check_some_text_matches(grammar)
    return grammar


def _check_some_text_matches(grammar: str) -> None:
    """Refuse a grammar that no text can start (``start: start``, a schema that only
    refers to itself): a sequence under it could only end at once, empty. llguidance
    finds out at the first mask, so one is computed over a vocabulary of the 256 bytes,
    where every text is spelt."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    matcher.compute_bitmask()
    if matcher.is_error():   # its error is a parser state dump, too long to show
        raise ValueError("no text matches it: its start can never produce a first "
                         "character")


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)} | {"<eos>": len(alphabet)}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=len(vocab),
                                  eos_token=len(alphabet))


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``spec``; a ``ValueError`` names what is wrong with it."""
    if spec.json_object:
        kind, text = "json", '{"type": "object"}'
    elif spec.choice is not None:
        kind, text = "choice", json.dumps(spec.choice)
    else:
        kind = next(k for k in ("json", "regex", "grammar") if getattr(spec, k) is not None)
        text = getattr(spec, kind)
    try:
        return _grammar_cached(kind, text)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{kind}: cannot be compiled ({e}); fix the "
                         f"{'JSON schema' if kind == 'json' else kind}") from None


class StructuredOutputs:
    """A worker's grammar machinery: its tokenizer's view for llguidance, matchers, masks."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
        self.eos_token_ids = eos
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_json_str(), n_vocab=vocab_size,
                                                 eos_token=eos or None)
        self._executor = llguidance.LLExecutor()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.num_words = (vocab_size + 31) // 32
        self._eos_words = torch.zeros(self.num_words, dtype=torch.int32)
        for t in eos:
            self._eos_words[t // 32] |= _bit(t % 32)

    def matcher(self, spec: StructuredOutputsParams,
                output_token_ids: Sequence[int]) -> llguidance.LLMatcher:
        """A matcher for ``spec`` that has consumed ``output_token_ids`` (a sequence that
        arrives with output already: recomputed, handed over or forked)."""
        m = llguidance.LLMatcher(self._tokenizer, grammar_for(spec), log_level=0)
        if output_token_ids and not m.consume_tokens(list(output_token_ids)):
            raise ValueError(f"the output so far does not match its grammar: {m.get_error()}")
        return m

    def masks_async(self, matchers: list[llguidance.LLMatcher]) -> Future[torch.Tensor]:
        """Each matcher's next-token bitmask, [len(matchers), words] int32, computed on the
        helper thread (start it before the forward pass, collect it before sampling)."""
        return self._thread.submit(self._masks, matchers)

    def _masks(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        bitmask = torch.empty((len(matchers), self.num_words), dtype=torch.int32)
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing that
        # module (it builds a torch.compile kernel at import: seconds of start-up).
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), self.num_words * 4,
            len(matchers))
        # A matcher in an error state allows nothing: let it end the sequence instead.
        empty = (bitmask == 0).all(dim=1)
        if empty.any():
            bitmask[empty] = self._eos_words
        return bitmask

    @staticmethod
    def advance(matcher: llguidance.LLMatcher, token_id: int) -> None:
        """Consume a sampled token (the mask allowed it, so this cannot fail but for EOS
        after the grammar already stopped, which is harmless)."""
        if not matcher.is_stopped():
            matcher.consume_token(token_id)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (on the CPU) -> [rows, vocab_size] bool (True: allowed);
    bit ``t % 32`` of word ``t // 32`` is token ``t`` (little-endian bytes, as llguidance
    writes them). numpy's ``unpackbits`` is 2x faster than a torch table lookup here."""
    raw = bitmask.contiguous().numpy().view(np.uint8)
    bits = np.unpackbits(raw, axis=1, bitorder="little").view(np.bool_)
    return torch.from_numpy(bits[:, :vocab_size])
