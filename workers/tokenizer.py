"""Text <-> token ids, special tokens and chat templates for one model.

A thin layer over a ``tokenizers.Tokenizer`` (the Rust fast tokenizer, the same engine
HF uses) plus the few settings that live outside ``tokenizer.json``: which tokens are
BOS/EOS, whether encoding adds them, and the chat template. GGUF checkpoints are
converted to the same two files (see ``workers.loading.gguf_tokenizer``), so every
checkpoint ends up here through ``from_hf_dir``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from workers.chat_template import render_chat_template

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True)
class TokenizerSettings:
    """What ``tokenizer_config.json`` adds to ``tokenizer.json``."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None
    tool_chat_template: str | None = None  # a named "tool_use" template, used when tools are given

    @classmethod
    def from_hf_dir(cls, path: Path) -> TokenizerSettings:
        cfg = {**_read_json(path / "special_tokens_map.json"),
               **_read_json(path / "tokenizer_config.json")}
        templates = _named_templates(cfg.get("chat_template"))
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        return cls(
            **{name: _token_content(cfg.get(name)) for name in _SPECIAL_TOKEN_NAMES},
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
            chat_template=templates.get("default"),
            tool_chat_template=templates.get("tool_use"),
        )


class Tokenizer:
    """Encodes, decodes and renders chat prompts exactly as HF transformers would."""

    def __init__(self, backend: tokenizers.Tokenizer, settings: TokenizerSettings) -> None:
        self._backend = backend
        self._settings = settings
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._token_id(settings.bos_token, "bos_token")
        self.eos_token_id: int | None = self._token_id(settings.eos_token, "eos_token")
        self.eos_token_ids: tuple[int, ...] = (
            (self.eos_token_id,) if self.eos_token_id is not None else ())
        self.chat_template: str | None = settings.chat_template
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        # tokenizer.json's post-processor may already add BOS/EOS (Llama 3 does); the
        # config flags only add what it does not, so nothing is doubled.
        added = backend.encode("", add_special_tokens=True).ids
        self._prepend_bos = (settings.add_bos_token and self.bos_token_id is not None
                             and added[:1] != [self.bos_token_id])
        self._append_eos = (settings.add_eos_token and self.eos_token_id is not None
                            and added[-1:] != [self.eos_token_id])

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``)."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {directory}: expected an HF tokenizer directory "
                f"(tokenizer.json, optionally tokenizer_config.json); slow-only tokenizers "
                f"(tokenizer.model alone) must be converted with transformers first")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        return cls(backend, TokenizerSettings.from_hf_dir(directory))

    @property
    def settings(self) -> TokenizerSettings:
        return self._settings

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their ids."""
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._prepend_bos:
                ids.insert(0, self.bos_token_id)
            if self._append_eos:
                ids.append(self.eos_token_id)
        return ids

    def to_json_str(self) -> str:
        """The backend as ``tokenizer.json`` text (what grammar libraries read)."""
        return self._backend.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        tokens = []
        for i in ids:
            token = self._backend.id_to_token(i)
            if token is None:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            tokens.append(token)
        return tokens

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def add_eos_token_ids(self, ids: Iterable[int]) -> None:
        """Also stop on ``ids`` (a checkpoint's generation config often lists more than one)."""
        self.eos_token_ids += tuple(i for i in dict.fromkeys(ids) if i not in self.eos_token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for ``messages``; raises ``ValueError`` if it cannot be rendered."""
        template = self.template_for(bool(tools))
        special = {name: value for name in _SPECIAL_TOKEN_NAMES
                   if (value := getattr(self._settings, name)) is not None}
        return render_chat_template(template, messages,
                                    add_generation_prompt=add_generation_prompt, tools=tools,
                                    special_tokens=special, **kwargs)

    def template_for(self, tools: bool) -> str | None:
        """The chat template a request uses: the named ``tool_use`` one when it has tools
        and the checkpoint has one."""
        if tools and self._settings.tool_chat_template:
            return self._settings.tool_chat_template
        return self.chat_template

    def _token_id(self, token: str | None, role: str) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{role} {token!r} is not in the tokenizer's vocabulary")
        return token_id


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_templates(value: Any) -> dict[str, str]:
    """``chat_template`` is either one template or a list of ``{name, template}``."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {item["name"]: item["template"] for item in value}
    return {}
