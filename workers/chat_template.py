"""Rendering chat templates the way HF transformers renders them.

Chat templates are Jinja programs shipped with a checkpoint, so they are untrusted:
they run in an immutable sandbox. The environment matches what templates written for
transformers expect (block trimming, loop controls, ``raise_exception``, a ``tojson``
that neither escapes HTML nor ASCII, ``strftime_now``), so a prompt rendered here is
byte-for-byte the prompt the model was trained and evaluated with.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders its body unchanged.

    Some templates mark the assistant's part for training masks; rendering a prompt
    only needs the text.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
            lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(Namespace):
    """``namespace()`` refusing underscore attributes, which could reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # No named ``self``, so that a template may call ``namespace(self=...)``.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attr_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attr_name(name)
        Namespace.__setitem__(self, name, value)


def _check_attr_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates may not set underscore attribute {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.globals["dict"] = _make_dict
    return env.from_string(template)


def render_chat_template(template: str | None, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = True,
                         continue_final_message: bool = False,
                         tools: list[dict[str, Any]] | None = None,
                         special_tokens: Mapping[str, str] | None = None,
                         **kwargs: Any) -> str:
    """Render ``messages`` with ``template``; any failure is a ``ValueError`` saying why.

    ``special_tokens`` (``bos_token``, ``eos_token``, ...) are visible to the template
    as variables; ``kwargs`` override them, as in transformers.
    ``continue_final_message``: the text stops right after the last message's content,
    before whatever closes its turn, so the model goes on with that message (an
    assistant reply begun by the caller), as transformers does it.
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be true with add_generation_prompt "
                         "true (a reply is either continued or begun); set "
                         "add_generation_prompt to false")
    if not template:
        raise ValueError(
            "this model has no chat template; format the prompt yourself (completions API) "
            "or load a tokenizer whose tokenizer_config.json or chat_template.jinja has one")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise ValueError(f"messages must be a list of dicts, got {messages!r:.200}")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ValueError(f"tools must be a list of JSON-schema dicts, got {tools!r:.200}")
    variables = {**(special_tokens or {}), **kwargs}
    try:
        text = _compile(template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
            **variables)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    return _cut_after_final(text, messages) if continue_final_message else text


def _cut_after_final(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` up to the end of the last occurrence of the final message's content, or
    of that content stripped, which templates often render."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the last message has no text to continue")
    for wanted in (content, content.strip()):
        at = text.rfind(wanted)
        if at >= 0:
            return text[:at + len(wanted)]
    raise ValueError("continue_final_message: the chat template does not render the last "
                     "message's content as given, so it cannot be continued")


def load_chat_template(value: str) -> str:
    """A template given by the user (vLLM's ``--chat-template``): the path of a Jinja
    file, or the template text itself; checked to compile."""
    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text(encoding="utf-8")
    elif "{" in value:
        template = value
    else:
        raise ValueError(f"chat_template: got {value!r}, which is neither an existing file "
                         "nor Jinja template text; give a .jinja file's path or the template")
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: the template from {value[:60]!r} does not compile: "
                         f"{e}") from None
    return template
