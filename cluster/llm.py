"""``LLM``: offline generation with vLLM's calling convention.

``LLM(model).generate(prompts, SamplingParams(...))`` returns one ``RequestOutput``
per prompt, in order; ``chat`` applies the model's chat template first. Every prompt
and parameter is validated before any work starts, so one bad input fails the call
without leaving half the batch running.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from cluster.config import EngineConfig, load_config, with_overrides
from cluster.engine import LocalEngine
from cluster.openai_protocol import parse_messages
from cluster.openai_tools import OfferedTools
from cluster.outputs import RequestOutput
from cluster.tool_calls import ToolCallParser, chat_prompt
from cluster.vllm_args import LLM_FLAGS
from scheduler.protocol import SamplingParams
from workers.tokenizer import Tokenizer

if TYPE_CHECKING:
    from cluster.cluster_engine import ClusterEngine


def _start_engine(config: EngineConfig) -> LocalEngine | ClusterEngine:
    """The one-process engine, or the cluster when ``cluster.pools`` names any: only a
    cluster imports Ray, so offline generation in one process runs where Ray is absent."""
    if not config.cluster.pools:
        return LocalEngine(config)
    from cluster.cluster_engine import ClusterEngine

    return ClusterEngine(config)


PromptInput = str | dict[str, Any] | Sequence[int]

# LLM keywords beyond vLLM's flags (``vllm_args.LLM_FLAGS``) -> (config section, field)
_OVERRIDES = {
    "model": ("model", "path"), "tokenizer": ("model", "tokenizer"),
    "device": ("model", "device"), "ops": ("model", "ops"),
    "kv_cache_bytes": ("cache", "kv_cache_bytes"),
    "enable_chunked_prefill": ("scheduler", "enable_chunked_prefill"),
}


def engine_config(model: str | None, config: str | Path | EngineConfig | None,
                  kwargs: dict[str, Any]) -> EngineConfig:
    """The config an ``LLM(model, config=config, **kwargs)`` runs (see ``LLM``)."""
    unknown = sorted(set(kwargs) - set(_OVERRIDES) - set(LLM_FLAGS))
    if unknown:
        allowed = ", ".join(["model", "config", *sorted({*_OVERRIDES, *LLM_FLAGS} - {"model"})])
        raise TypeError(f"LLM got unknown argument(s) {', '.join(unknown)}; "
                        f"allowed: {allowed}")
    base = config if isinstance(config, EngineConfig) else load_config(config)
    if model is not None:
        kwargs = {**kwargs, "model": model}
    overrides = {_OVERRIDES[k]: v for k, v in kwargs.items() if k in _OVERRIDES}
    for key in kwargs.keys() & LLM_FLAGS.keys():
        overrides.update(LLM_FLAGS[key].overrides(kwargs[key]))
    return with_overrides(base, overrides)


class LLM:
    def __init__(self, model: str | None = None, *, config: str | Path | EngineConfig | None = None,
                 **kwargs: Any) -> None:
        """``model``: an HF checkpoint directory or a GGUF file (None: the embedded
        SmolLM2-135M-Instruct). ``config``: a YAML file or ``EngineConfig``; keyword
        arguments override it: vLLM's (``dtype``, ``seed``, ``max_model_len``,
        ``gpu_memory_utilization``, ... as ``serve``'s flags take them, vLLM's value
        spellings included) and ``tokenizer``, ``device``, ``ops``, ``kv_cache_bytes``,
        ``enable_chunked_prefill``."""
        self.config = engine_config(model, config, kwargs)
        self.engine: LocalEngine | ClusterEngine = _start_engine(self.config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the cluster's actors (a no-op for the one-process engine)."""
        if not isinstance(self.engine, LocalEngine):
            self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def tool_call_parser(self) -> ToolCallParser | None:
        """The tool-call format ``serving.tool_call_parser`` names (None: the chat
        template's), in which earlier calls in a conversation are written for a template
        that renders none."""
        name = self.config.serving.tool_call_parser
        return ToolCallParser(name) if name else None

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no ``SamplingParams``: the
        model's generation config (see ``model.generation_config``) over vLLM's defaults."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = False,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        batch = _as_batch(prompts)
        return self._run([self._parse(p) for p in batch], sampling_params, use_tqdm, priority)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = False, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations. ``tools``
        (OpenAI's shape) are offered in the prompt as the chat endpoint offers them; the
        output is the model's text, calls unparsed (as vLLM's ``LLM.chat``).
        ``continue_final_message`` (with ``add_generation_prompt=False``): the model goes
        on with the last message, an assistant reply begun by the caller."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        tool_dicts = OfferedTools(tools=tools).tool_dicts()
        one = isinstance(messages, str) or (messages and isinstance(messages[0], dict))
        parsed = []
        for conv in [messages] if one else messages:
            text = chat_prompt(tok, parse_messages(conv), tool_dicts, self.tool_call_parser,
                               add_generation_prompt,
                               continue_final_message=continue_final_message,
                               **(chat_template_kwargs or {}))
            parsed.append(self._parse({"prompt": text}, add_special_tokens=False))
        return self._run(parsed, sampling_params, use_tqdm, None)

    # ---- internals -------------------------------------------------------------------
    def _parse(self, prompt: PromptInput,
               add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt dict has keys {sorted(prompt)}; expected 'prompt' "
                                 "or 'prompt_token_ids'")
        return self.engine.tokenize_prompt(prompt, add_special_tokens)

    def _run(self, parsed: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, priority: Sequence[int] | None) -> list[RequestOutput]:
        params = _per_prompt(sampling_params if sampling_params is not None
                             else self.get_default_sampling_params(), len(parsed))
        prios = list(priority) if priority is not None else [0] * len(parsed)
        if len(prios) != len(parsed):
            raise ValueError(f"priority has {len(prios)} entries for {len(parsed)} prompts")
        ids = [str(next(self._ids)) for _ in parsed]
        for rid, (text, tokens), sp, prio in zip(ids, parsed, params, prios):
            self.engine.add_request(rid, text, tokens, sp, prio)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate")
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]


def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts: got {type(prompts).__name__}; expected text, token ids, "
                         "a {'prompt' or 'prompt_token_ids': ...} dict, or a list of those")
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _per_prompt(sp: SamplingParams | Sequence[SamplingParams],
                n: int) -> list[SamplingParams]:
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sps = list(sp) if isinstance(sp, Sequence) else [sp]
    wrong = next((s for s in sps if not isinstance(s, SamplingParams)), None)
    if wrong is not None:
        raise ValueError(f"sampling_params: got {type(wrong).__name__}; expected "
                         "SamplingParams, or a list of one per prompt")
    if len(sps) != n:
        raise ValueError(f"got {len(sps)} sampling params for {n} prompts; give one, or one "
                         "per prompt")
    return sps
