"""The one configuration file: YAML, validated at start, every option defaulted.

Each section is a dataclass owned by the part it configures (the KV pool's
``CacheConfig`` in ``kvcache``, the batching policy's ``SchedulerConfig`` in
``scheduler``); this module only assembles them and turns YAML into them with
errors that name the field, the value and what is allowed. The empty file is the
embedded default: SmolLM2-135M-Instruct on the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.config_schema import ConfigError, build
from cluster.reasoning import REASONING_PARSERS
from cluster.tool_calls import TOOL_CALL_PARSERS
from kvcache.config import CacheConfig
from kvcache.long_context import LongContextConfig, from_environment, log_sources
from scheduler.config import SchedulerConfig
from scheduler.protocol import Role, SamplingParams
from workers.device import DEVICES, default_block_size
from workers.loading.checkpoint import DEFAULT_MODEL_FILE
from workers.loading.generation_defaults import (
    SAMPLING_DEFAULT_FIELDS,
    resolve_sampling_defaults,
)
from workers.loading.hub import is_hub_id
from workers.ops import OPS_BACKENDS
from workers.ops.quant_linear import check_quantization

DTYPES = ("float32", "float16", "bfloat16")
log = logging.getLogger(__name__)


@dataclass
class ModelConfig:
    """Which checkpoint to load and how to compute with it.

    ``path`` None is the embedded default model; otherwise an HF checkpoint
    directory or a ``.gguf`` file. fp32 is the default because bf16/fp16 matrix
    products are hundreds of times slower on CPUs. ``ops`` ``torch`` forces the
    reference kernels (the oracle) instead of the device's own. ``generation_config``
    (vLLM's flag): where requests' sampling defaults come from: ``auto`` the
    checkpoint's ``generation_config.json``, ``vllm`` none, or a directory holding one.
    ``chat_template``: a Jinja file, or the template itself, replacing the checkpoint's
    (vLLM's ``--chat-template``). ``quantization``: ``w8a8`` (int8 weights and per-token
    int8 activations) or ``w8a16`` (int8 weights, fp activations) for the decoder layers'
    linear layers, made at load. ``enforce_eager`` (vLLM's flag): no CUDA graphs, every
    decode step runs eagerly (graphs exist only on CUDA).
    """

    path: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    ops: str = "auto"
    generation_config: str = "auto"
    quantization: str = "none"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: got {self.dtype!r}; allowed: {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ValueError(f"device: got {self.device!r}; allowed: {', '.join(DEVICES)}")
        if self.ops not in OPS_BACKENDS:
            raise ValueError(f"ops: got {self.ops!r}; allowed: {', '.join(OPS_BACKENDS)}")
        if self.generation_config not in ("auto", "vllm") \
                and not Path(self.generation_config).is_dir():
            raise ValueError(f"generation_config: got {self.generation_config!r}; allowed: "
                             "auto, vllm, or an existing folder with a generation_config.json")
        check_quantization(self.quantization)


@dataclass
class WorkerPoolConfig:
    """``count`` worker actors of one role, each with ``resources`` from Ray.

    ``resources``: what one worker takes, e.g. ``{CPU: 1}``, ``{GPU: 1}`` or
    ``{NPU: 1}``, so Ray places one per device. ``num_threads``: torch threads per
    worker; None follows the worker's CPU share (at least 1). ``min_workers`` /
    ``max_workers``: the autoscaler keeps the pool within them (None: ``count``, so a
    pool with neither is fixed); ``count`` is where it starts.
    """

    role: Role = Role.MIXED
    count: int = 1
    resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    num_threads: int | None = None
    min_workers: int | None = None
    max_workers: int | None = None

    def __post_init__(self) -> None:
        self.role = Role.parse(self.role)
        if self.count < 1:
            raise ValueError(f"count: got {self.count}; expected an integer >= 1")
        low, high = self.bounds
        if not 1 <= low <= self.count <= high:
            raise ValueError(f"min_workers/count/max_workers: got {low}/{self.count}/{high}; "
                             "expected 1 <= min_workers <= count <= max_workers")
        for name, amount in self.resources.items():
            if amount <= 0:
                raise ValueError(f"resources: got {name}: {amount}; amounts must be > 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads: got {self.num_threads}; expected an integer >= 1 "
                             "or null for the CPU share")

    @property
    def bounds(self) -> tuple[int, int]:
        """(min_workers, max_workers), each ``count`` where not given."""
        return (self.count if self.min_workers is None else self.min_workers,
                self.count if self.max_workers is None else self.max_workers)

    @property
    def threads(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        return max(1, int(self.resources.get("CPU", 1)))


@dataclass
class AutoscaleConfig:
    """When the autoscaler adds or removes a worker of a pool whose ``min_workers`` and
    ``max_workers`` differ.

    A pool grows by one when any of its signals is over its limit: prefill (and mixed)
    pools on ``queued_prefill_tokens`` per worker and ``ttft_target_s``; decode (and
    mixed) pools on ``kv_usage_high``, ``running_seqs_high`` per worker and
    ``tpot_target_s``; then waits ``scale_up_cooldown_s`` (the new worker loads) before
    growing again. It shrinks by one once every signal, counted as if it had one worker
    fewer, has stayed under ``scale_down_fraction`` of its limit for
    ``scale_down_delay_s`` (hysteresis: the smaller pool starts well under the limits
    that would grow it back). ``interval_s``: how often it decides.
    """

    interval_s: float = 1.0
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.25
    queued_prefill_tokens: int = 2048
    kv_usage_high: float = 0.8
    running_seqs_high: int = 32
    scale_down_fraction: float = 0.5
    scale_down_delay_s: float = 30.0
    scale_up_cooldown_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "ttft_target_s", "tpot_target_s", "scale_up_cooldown_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: got {getattr(self, name)}; expected > 0 seconds")
        if self.scale_down_delay_s < 0:
            raise ValueError(f"scale_down_delay_s: got {self.scale_down_delay_s}; expected "
                             ">= 0 seconds")
        for name in ("queued_prefill_tokens", "running_seqs_high"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}; expected >= 1")
        for name in ("kv_usage_high", "scale_down_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name}: got {getattr(self, name)}; expected a fraction "
                                 "in (0, 1]")


@dataclass
class ClusterConfig:
    """The Ray cluster. No ``pools``: the one-process engine, no Ray at all.

    ``address``: a Ray cluster to join (None: start or reuse a local instance).
    ``name``: the global scheduler's actor name is ``llm-scheduler-<name>``.
    ``prefill_threshold``: prompts with fewer tokens are prefilled on a decode worker.
    ``max_prefill_queue_tokens``: once every prefill worker has this many prompt tokens
    waiting, a prompt goes to the worker where it costs least: queued prefill tokens plus
    its own, counted once more per sequence that worker decodes, decode workers included
    (None: prompts always wait for a prefill worker).
    ``max_waiting``: requests queued (not yet running) before submissions are refused
    as overloaded. ``transfer_timeout_s``: a KV handoff slower than this is abandoned
    and the sequence recomputed. ``prefix_push``: a long prompt's finished chunks move
    to its decode worker while the rest prefills, so its handoff moves only the last
    chunk. ``replace_backoff_s``: a dead worker is replaced after
    this long, doubled for each failure of its pool in a row (at most a minute).
    ``autoscale``: how pools with ``min_workers`` < ``max_workers`` grow and shrink.
    """

    name: str = "default"
    address: str | None = None
    pools: list[WorkerPoolConfig] = field(default_factory=list)
    prefill_threshold: int = 0
    max_prefill_queue_tokens: int | None = 512
    max_waiting: int = 1024
    transfer_timeout_s: float = 30.0
    prefix_push: bool = True
    replace_backoff_s: float = 1.0
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)

    def __post_init__(self) -> None:
        if self.replace_backoff_s <= 0:
            raise ValueError(f"replace_backoff_s: got {self.replace_backoff_s}; expected > 0 "
                             "seconds")
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"name: got {self.name!r}; expected letters, digits, - and _")
        if self.prefill_threshold < 0:
            raise ValueError(f"prefill_threshold: got {self.prefill_threshold}; expected >= 0")
        if self.max_prefill_queue_tokens is not None and self.max_prefill_queue_tokens < 0:
            raise ValueError(f"max_prefill_queue_tokens: got {self.max_prefill_queue_tokens}; "
                             "expected >= 0, or null to never prefill on decode workers "
                             "for load")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting: got {self.max_waiting}; expected >= 1")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s: got {self.transfer_timeout_s}; "
                             "expected > 0 seconds")


@dataclass
class ServingConfig:
    """The HTTP server (``python -m cluster serve``, ``serve run``).

    ``model_name``: the id clients send as ``model`` and ``/v1/models`` lists (None:
    the checkpoint's name). ``api_key``: when set (or ``LLM_CLUSTER_API_KEY`` is), every
    ``/v1`` request needs ``Authorization: Bearer <key>``. ``max_request_bytes``: larger
    bodies are refused with 413. Router replicas autoscale between ``min_replicas`` and
    ``max_replicas`` on ``target_ongoing_requests`` per replica. ``default_sampling``:
    sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for requests
    that leave them out, over the model's own (``model.generation_config``).
    ``reasoning_parser`` (vLLM's flag): ``qwen3`` or ``deepseek_r1`` moves ``<think>``
    text into ``reasoning_content``; null leaves it in the answer.
    ``tool_call_parser`` (vLLM's flag): the format tool calls are read in and forced to,
    ``hermes`` (``<tool_call>`` JSON: Qwen2.5/Qwen3, SmolLM2) or ``llama3_json``; null
    picks it from the chat template.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = 4 << 20
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 64.0
    max_ongoing_requests: int = 512
    default_sampling: dict[str, float] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: got {self.tool_call_parser!r}; allowed: "
                             f"{', '.join(TOOL_CALL_PARSERS)}, or null to pick it from the "
                             "chat template")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: got {self.reasoning_parser!r}; allowed: "
                             f"{', '.join(REASONING_PARSERS)}, or null for none")
        unknown = sorted(set(self.default_sampling) - set(SAMPLING_DEFAULT_FIELDS))
        if unknown:
            raise ValueError(f"default_sampling: unknown field(s) {', '.join(unknown)}; "
                             f"allowed: {', '.join(SAMPLING_DEFAULT_FIELDS)}")
        try:
            SamplingParams(**{k: SAMPLING_DEFAULT_FIELDS[k](v)
                              for k, v in self.default_sampling.items()})
        except ValueError as e:
            raise ValueError(f"default_sampling.{e}") from None
        if not 0 < self.port < 65536:
            raise ValueError(f"port: got {self.port}; expected 1 to 65535")
        if self.model_name is not None and not self.model_name.strip():
            raise ValueError("model_name: got an empty name; give a name or null")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes: got {self.max_request_bytes}; expected "
                             ">= 1024")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas/max_replicas: got {self.min_replicas}/"
                             f"{self.max_replicas}; expected 1 <= min_replicas <= max_replicas")
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests: got {self.target_ongoing_requests}; "
                             "expected > 0")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests: got {self.max_ongoing_requests}; "
                             "expected >= 1")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    long_context: LongContextConfig = field(default_factory=LongContextConfig)

    def __post_init__(self) -> None:
        if not self.long_context.enabled:
            return
        try:
            self.long_context.check_block_size(self.block_size)
        except ValueError as e:
            raise ConfigError(f"long_context.{e}") from e

    @property
    def block_size(self) -> int:
        """The KV block size: the configured one, else the model device's default."""
        return self.cache.block_size or default_block_size(self.model.device)


def sampling_defaults(config: EngineConfig) -> dict[str, float | int]:
    """The sampling defaults in force for requests that omit a field; logged, since they
    change what an unqualified request returns."""
    try:
        merged = resolve_sampling_defaults(config.model.path, config.model.generation_config,
                                           config.serving.default_sampling)
    except ValueError as e:
        raise ConfigError(f"model.{e}") from e
    log.info("sampling defaults for requests that omit them: %s (model.generation_config=%s, "
             "serving.default_sampling=%s)", merged or "vLLM's (temperature 1.0, ...)",
             config.model.generation_config, config.serving.default_sampling or "{}")
    return merged


def with_overrides(config: EngineConfig, overrides: dict[tuple[str, str], Any]) -> EngineConfig:
    """``config`` with ``(section, field)`` values replaced, validated as the YAML is
    (errors name ``section.field``): how ``LLM`` keywords and CLI flags override it."""
    data = dataclasses.asdict(config)
    for (section, name), value in overrides.items():
        data[section][name] = value
    return config_from_dict(data)


def with_default_pools(config: EngineConfig) -> EngineConfig:
    """The config to serve with: the given one, or, when it names no worker pools, the
    same with one prefill and one decode worker of one CPU each (what ``serve`` and
    ``batch`` run by default; the offline ``LLM`` keeps the one-process engine)."""
    if config.cluster.pools:
        return config
    pools = [WorkerPoolConfig(role="prefill"), WorkerPoolConfig(role="decode")]
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, pools=pools))


def served_model_name(config: EngineConfig) -> str:
    """The model id clients send: the configured name, else the checkpoint's."""
    if config.serving.model_name:
        return config.serving.model_name
    if config.model.path and is_hub_id(config.model.path):
        return config.model.path   # vLLM serves a model id under that id
    path = Path(config.model.path or DEFAULT_MODEL_FILE.split(".")[0])
    return path.name.removesuffix(".gguf")


def load_config(path: str | Path | None) -> EngineConfig:
    """Read and validate a YAML config file (None or an empty file: all defaults)."""
    if path is None:
        return config_from_dict({})
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing YAML file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
    return config_from_dict(data)


def config_from_dict(data: Any) -> EngineConfig:
    """Build and validate; ``long_context`` values the file leaves out may come from the
    reference design's ``VLLM_RETRIEVAL_*`` variables (logged with their source)."""
    if isinstance(data, dict) and (data.get("long_context") is None
                                   or isinstance(data["long_context"], dict)):
        data = dict(data)
        try:
            data["long_context"], sources = from_environment(data.get("long_context"))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        config = build(EngineConfig, data)
        log_sources(config.long_context, sources)
        return config
    return build(EngineConfig, data)
