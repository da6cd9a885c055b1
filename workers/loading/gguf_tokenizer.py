"""A GGUF file's ``tokenizer.ggml.*`` metadata as an HF ``tokenizer.json`` + config.

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``, used by SmolLM, Llama 3 and
Qwen) is rebuilt. How text is split before BPE is not in the vocabulary: llama.cpp picks
a list of regexes by the ``tokenizer.ggml.pre`` name, applying each to the pieces the
previous one produced. That is a sequence of isolating ``Split`` pre-tokenizers here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                 r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizer:
    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole vocabulary token is kept whole
    add_bos: bool = False  # llama.cpp's default when the file does not say


_GPT2 = _PreTokenizer((_GPT2_SPLIT,))
_DIGITS_THEN_GPT2 = _PreTokenizer((r"\p{N}", _GPT2_SPLIT))
_LLAMA3 = _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizer((_QWEN2_SPLIT,))

# "default" (what files older than the pre-tokenizer key amount to) gets the GPT-2 regex,
# as in HF transformers, rather than llama.cpp's heuristic of isolating punctuation.
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "phi-2", "roberta-bpe"),
                    _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _DIGITS_THEN_GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _QWEN2),
}


@dataclass(frozen=True)
class GGUFTokenizerFiles:
    """What ``Tokenizer.from_hf_dir`` reads: ``tokenizer.json`` text and ``tokenizer_config``."""

    tokenizer_json: str
    tokenizer_config: dict[str, Any]


def check_gguf_tokenizer(meta: Mapping[str, Any]) -> str | None:
    """Why this file's tokenizer cannot be rebuilt, or None when it can."""
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        if "tokenizer.ggml.tokens" not in meta or "tokenizer.ggml.merges" not in meta:
            return ("the GGUF's byte-level BPE tokenizer lacks tokenizer.ggml.tokens or "
                    "tokenizer.ggml.merges; pass tokenizer=<HF tokenizer directory>")
        return None
    if model == "llama":
        return ("the GGUF's tokenizer is SentencePiece (tokenizer.ggml.model='llama'), which "
                "is not rebuilt from GGUF metadata; pass tokenizer=<directory with the "
                "model's HF tokenizer.json> (load_checkpoint(..., tokenizer=...))")
    return (f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2', byte-level "
            f"BPE); pass tokenizer=<HF tokenizer directory> (load_checkpoint(..., tokenizer=...))")


def convert_gguf_tokenizer(meta: Mapping[str, Any]) -> GGUFTokenizerFiles:
    """Rebuild the tokenizer described by ``meta`` (GGUF key -> decoded value)."""
    problem = check_gguf_tokenizer(meta)
    if problem:
        raise ValueError(problem)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text with the GPT-2 regex "
                       "(known: %s)", pre_name, ", ".join(sorted(PRE_TOKENIZERS)))
        pre = _GPT2

    backend = BackendTokenizer(models.BPE(
        vocab=_byte_level_vocab(tokens, types),
        merges=[tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]],
        ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        logger.warning("the GGUF lists %d tokens but only %d are distinct; the duplicates' ids "
                       "are never produced by encoding", len(tokens),
                       backend.get_vocab_size(with_added_tokens=True))

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    config = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", pre.add_bos)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return GGUFTokenizerFiles(backend.to_str(), {k: v for k, v in config.items() if v is not None})


def _byte_level_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """Token -> id, every BPE token spelled in the byte-level alphabet.

    GGUF stores ordinary tokens byte-level spelled, but converters sometimes store
    user-defined text (like runs of spaces) raw; BPE could never produce those, so they
    are respelled. Control and user-defined tokens keep their raw text: they are matched
    in the input as added tokens, never produced by BPE.
    """
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_to_char = _byte_to_char()
    vocab: dict[str, int] = {}
    for index, (tok, kind) in enumerate(zip(tokens, types)):
        if kind not in (_CONTROL, _USER_DEFINED) and not set(tok) <= alphabet:
            tok = "".join(byte_to_char[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, index)
    return vocab


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
