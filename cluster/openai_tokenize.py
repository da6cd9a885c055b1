"""vLLM's utility endpoints beside the OpenAI API: ``/tokenize``, ``/detokenize`` and
``/version``, with vLLM's request and response shapes, so its clients and scripts work
unchanged. The router supplies the tokenizer; this module only validates and shapes.
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.openai_protocol import APIError, ChatMessage
from cluster.openai_tools import OfferedTools
from cluster.tool_calls import ToolCallParser, chat_prompt
from workers.tokenizer import Tokenizer

PACKAGE = "ray-llm-cluster"


class TokenizeCompletionRequest(BaseModel):
    """Text as ``/v1/completions`` would tokenize it."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OfferedTools):
    """Messages (and the tools offered) as ``/v1/chat/completions`` would template and
    tokenize them."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def tokenize_request_type(body: Any) -> type[BaseModel]:
    """vLLM tells the two forms apart by ``messages``."""
    return TokenizeChatRequest if isinstance(body, dict) and "messages" in body \
        else TokenizeCompletionRequest


def tokenize(tokenizer: Tokenizer | None, req: BaseModel, max_model_len: int,
             parser: ToolCallParser | None = None) -> dict[str, Any]:
    """vLLM's ``/tokenize`` answer: the ids, their count and the context length; chat
    messages as the chat endpoint renders them (``parser``: the server's call format)."""
    tok = _need(tokenizer)
    if isinstance(req, TokenizeChatRequest):
        text = chat_text(tok, [m.as_template_input() for m in req.messages],
                         req.tool_dicts(), parser,
                         req.add_generation_prompt, req.continue_final_message)
    else:
        text = req.prompt
    ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def chat_text(tok: Tokenizer, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None, parser: ToolCallParser | None,
              add_generation_prompt: bool, continue_final_message: bool,
              template_kwargs: dict[str, Any] | None = None) -> str:
    """A chat request's prompt text (``tool_calls.chat_prompt``); a refusal is a 400
    naming the request field at fault, ``messages`` for the template's own."""
    try:
        return chat_prompt(tok, messages, tools, parser, add_generation_prompt,
                           continue_final_message=continue_final_message,
                           **(template_kwargs or {}))
    except Exception as e:   # a template's own refusal, e.g. roles out of order
        if str(e).startswith("continue_final_message:"):
            raise APIError.bad_value(e) from None
        raise APIError(400, f"messages: the chat template refused them: {e}",
                       param="messages") from None


def detokenize(tokenizer: Tokenizer | None, req: DetokenizeRequest, vocab_size: int
               ) -> dict[str, Any]:
    """vLLM's ``/detokenize`` answer: the text of the ids, special tokens included."""
    tok = _need(tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"tokens: got {bad[0]}; token ids lie in [0, {vocab_size})",
                       param="tokens")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


def version() -> dict[str, str]:
    """The server's version, as vLLM's ``/version`` reports its own."""
    try:
        return {"version": importlib.metadata.version(PACKAGE)}
    except importlib.metadata.PackageNotFoundError:   # run from a checkout, not installed
        return {"version": "unknown"}


def _need(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer; send and read token ids instead")
    return tokenizer
