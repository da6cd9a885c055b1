"""vLLM's ``serve`` flags for the settings we share, generated from the config schema,
and the same settings as ``LLM`` keywords (``--max-model-len`` is ``max_model_len``).

Each flag names only a config field (and what vLLM calls it); its type, its default
and the values it allows come from that field's dataclass and its validation, so the
command line, the ``LLM`` keywords and the YAML never drift apart: a flag sets exactly
what the same field in the config file would, with the same checks and error messages.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from cluster.config import EngineConfig


@dataclass(frozen=True)
class ConfigFlag:
    """A command-line flag that sets ``section.name``; ``aliases`` maps vLLM's
    spellings of a value to ours, and ``keep`` values leave the config as it is."""

    flags: tuple[str, ...]
    section: str
    name: str
    help: str
    aliases: dict[str, str] = field(default_factory=dict)
    keep: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return f"config.{self.section}.{self.name}"

    @property
    def keyword(self) -> str:
        """The flag as vLLM's ``LLM`` keyword: ``--max-model-len`` is ``max_model_len``."""
        return self.flags[0].removeprefix("--").replace("-", "_")

    def overrides(self, given: Any) -> dict[tuple[str, str], Any]:
        """What ``given`` sets: the field, with vLLM's spelling of the value mapped to
        ours; nothing for a ``keep`` value."""
        if given in self.keep:
            return {}
        return {(self.section, self.name): self.aliases.get(given, given)}


SERVE_FLAGS = (
    ConfigFlag(("--host",), "serving", "host", "address to listen on"),
    ConfigFlag(("--port",), "serving", "port", "port to listen on"),
    ConfigFlag(("--api-key",), "serving", "api_key",
               "require 'Authorization: Bearer KEY' on /v1 (also $LLM_CLUSTER_API_KEY)"),
    ConfigFlag(("--served-model-name", "--served-name"), "serving", "model_name",
               "the model id clients send (default: the checkpoint's name)"),
    ConfigFlag(("--generation-config",), "model", "generation_config",
               "where sampling defaults come from: auto (the checkpoint's "
               "generation_config.json), vllm (vLLM's defaults) or a folder"),
    ConfigFlag(("--reasoning-parser",), "serving", "reasoning_parser",
               "qwen3 or deepseek_r1: <think> text goes to reasoning_content"),
    ConfigFlag(("--quantization", "-q"), "model", "quantization",
               "int8 linear layers: w8a8 (int8 activations too) or w8a16; none: off"),
    ConfigFlag(("--enforce-eager",), "model", "enforce_eager",
               "no CUDA graphs: every decode step runs eagerly (graphs exist only on CUDA)"),
    ConfigFlag(("--max-model-len",), "scheduler", "max_model_len",
               "context length: prompt plus output tokens (default: the model's, within "
               "the KV pool)"),
    ConfigFlag(("--max-num-seqs",), "scheduler", "max_num_seqs",
               "most sequences in one worker's batch"),
    ConfigFlag(("--max-num-batched-tokens",), "scheduler", "max_num_batched_tokens",
               "most tokens one worker step runs (chunked prefill's budget)"),
    ConfigFlag(("--block-size",), "cache", "block_size", "tokens per KV block"),
    ConfigFlag(("--kv-cache-dtype",), "cache", "kv_dtype",
               "KV cache element type; auto: the model's dtype"),
    ConfigFlag(("--enable-prefix-caching",), "cache", "enable_prefix_caching",
               "reuse the KV blocks of prompt prefixes seen before"),
    ConfigFlag(("--gpu-memory-utilization",), "cache", "memory_fraction",
               "on an accelerator, the fraction of its free memory, measured after the "
               "weights are loaded, that the KV pool takes (vLLM's fraction counts the "
               "whole device, weights included); unused on a CPU and where "
               "cache.kv_cache_bytes is set"),
    ConfigFlag(("--dtype",), "model", "dtype", "weights and compute type",
               aliases={"half": "float16", "float": "float32"}, keep=("auto",)),
    ConfigFlag(("--chat-template",), "model", "chat_template",
               "a Jinja file, or the template text, replacing the checkpoint's"),
    ConfigFlag(("--seed",), "model", "seed", "the engine's random seed"),
    ConfigFlag(("--scheduling-policy",), "scheduler", "policy",
               "fcfs, or priority: requests' priority field orders the queue, lower first"),
)


def field_type(section: str, name: str) -> type:
    """The field's value type from the schema (``int`` for ``int | None``)."""
    section_type = typing.get_type_hints(EngineConfig)[section]
    tp = typing.get_type_hints(section_type)[name]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    return tp


def field_default(section: str, name: str) -> Any:
    section_type = typing.get_type_hints(EngineConfig)[section]
    f = next(f for f in dataclasses.fields(section_type) if f.name == name)
    return f.default


def add_config_flags(parser: argparse.ArgumentParser,
                     flags: tuple[ConfigFlag, ...] = SERVE_FLAGS) -> None:
    """Add ``flags`` to ``parser``; unset ones stay None, leaving the config's value."""
    group = parser.add_argument_group("vLLM-compatible settings (each sets a config field)")
    for flag in flags:
        tp = field_type(flag.section, flag.name)
        default = field_default(flag.section, flag.name)
        help_text = f"{flag.help} ({flag.section}.{flag.name}; default: {default})"
        if tp is bool:
            group.add_argument(*flag.flags, dest=flag.dest, default=None, help=help_text,
                               action=argparse.BooleanOptionalAction)
            continue
        if flag.aliases or flag.keep:
            help_text += f"; also {', '.join([*flag.aliases, *flag.keep])}"
        group.add_argument(*flag.flags, dest=flag.dest, type=tp, default=None,
                           metavar=flag.name.upper(), help=help_text)


def config_overrides(args: argparse.Namespace, flags: tuple[ConfigFlag, ...] = SERVE_FLAGS
                     ) -> dict[tuple[str, str], Any]:
    """The ``(section, field)`` values the flags given on the command line set."""
    out: dict[tuple[str, str], Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest)
        if value is not None:
            out.update(flag.overrides(value))
    return out


# The engine settings among the flags: the offline ``LLM`` takes these as keywords
# (the serving section's flags belong to the HTTP server alone).
LLM_FLAGS = {flag.keyword: flag for flag in SERVE_FLAGS if flag.section != "serving"}
