"""Messages between the scheduler and workers.

This is the only module of ``scheduler/`` a worker may import. A step plan tells a
worker what changed since its previous step (sequences that are new to it, the new
blocks and token counts of sequences it already holds, forks, and the sequences to
drop); the worker keeps the rest as its own state. Messages cross process boundaries
as msgpack (``encode`` / ``decode``), so they hold only plain values.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import reprlib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

_MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20   # alternatives per token a request may ask for, as vLLM's default


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 3, 60, 40, 60


def shown(value: Any) -> str:
    """How an error shows a bad value: enough to recognize, never the whole of a huge
    one (a request's values reach these messages)."""
    return _SHOWN.repr(value)


class Role(str, enum.Enum):
    """What a worker is for; the scheduler places by it, the worker only carries it.

    A ``str`` so that it reads and compares as the YAML spelling (``"prefill"``)."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Any, name: str = "role") -> Role:
        """``value`` as a role, or a ``ValueError`` naming ``name`` and the roles allowed."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(r.value for r in cls)
            raise ValueError(f"{name}: got {shown(value)}; allowed: {allowed}") from None


@dataclass
class StructuredOutputsParams:
    """A constraint the output must match (vLLM's structured outputs), exactly one kind:
    a JSON schema (``json``, a dict or its text), any JSON object (``json_object``), a
    regular expression, one of ``choice``'s strings, or a Lark / GBNF ``grammar``.

    The worker compiles it into token masks; only the spec travels (plain values).
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs: got {kinds or 'none'}; set exactly one of "
                             "json, regex, choice, grammar, json_object")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice: got {shown(self.choice)}; expected a "
                             "non-empty list of non-empty strings")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name}: got {shown(value)}; expected a "
                                 "non-empty string")


@dataclass
class SamplingParams:
    """How to sample one request, with vLLM's field names and defaults.

    Invalid values raise ``ValueError`` naming the field, the value and what is
    allowed, before any work is done.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the raw logits
    prompt_logprobs: int | None = None   # top alternatives per prompt token (and its own)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, kind, expected in (("stop", (list, tuple), "a string or a list of strings"),
                                     ("stop_token_ids", (list, tuple), "a list of token ids"),
                                     ("logit_bias", dict, "a {token id: bias} mapping")):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise ValueError(f"{name}: got {shown(value)}; expected {expected}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        _check_int("n", self.n, lo=1, hi=128)
        _check_float("temperature", self.temperature, lo=0.0, hi=100.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=0, hi=None, note="0 or -1 disables it")
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, hi=100.0,
                     lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-_MAX_SEED, hi=_MAX_SEED)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=None)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: got {shown(s)}; each stop string must be a non-empty str")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0, hi=None)
        for t, bias in self.logit_bias.items():
            _check_int("logit_bias", t, lo=0, hi=None, note="keys are token ids")
            _check_float("logit_bias", bias, lo=-100.0, hi=100.0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}: got {shown(value)}; expected true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check_int(name: str, value: Any, lo: int | None, hi: int | None, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: got {shown(value)}; expected an integer")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        extra = f" ({note})" if note else ""
        raise ValueError(f"{name}: got {shown(value)}; allowed range is {rng}{extra}")


def _check_float(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name}: got {shown(value)}; expected a number")
    if (value <= lo if lo_open else value < lo) or value > hi:
        left = "(" if lo_open else "["
        raise ValueError(f"{name}: got {shown(value)}; allowed range is {left}{lo}, {hi}]")


@dataclass
class NewSequence:
    """A sequence the worker does not hold yet (first schedule, or after preemption)."""

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    num_scheduled_tokens: int
    sampling: SamplingParams
    sample_index: int = 0


@dataclass
class TierChange:
    """A long sequence's new mode (a ``kvcache.long_context.KVMode`` value) and its blocks
    that changed tier.

    The device blocks ``offload_block_ids`` (the sequence's blocks from index
    ``first_offloaded`` on, in order) are copied to the host blocks ``host_block_ids``
    before the step writes anything: the scheduler has already freed them and may hand
    them to another sequence in the same plan. ``recall_block_ids`` join the sequence's
    recall cache. The first change of a sequence carries all of its host and recall
    blocks. The first ``num_received`` host blocks already hold their KV (a handoff wrote
    it there); ``offload_block_ids`` name the sources of the rest.
    """

    seq_id: str
    mode: int
    first_offloaded: int = 0
    offload_block_ids: list[int] = field(default_factory=list)
    host_block_ids: list[int] = field(default_factory=list)
    recall_block_ids: list[int] = field(default_factory=list)
    num_received: int = 0


@dataclass
class ContinuedSequence:
    """A sequence the worker holds: blocks appended to its table and tokens to run."""

    seq_id: str
    new_block_ids: list[int]
    num_scheduled_tokens: int


@dataclass
class ForkedSequence:
    """A child of an ``n > 1`` request, split off after the prompt's prefill.

    The child shares the parent's full blocks; the parent's partial last block (if
    any) was copied into ``copy_dst`` so the two can diverge. ``first_token`` is the
    child's own first sampled token, replacing the parent's.
    """

    seq_id: str
    parent_id: str
    sample_index: int
    block_ids: list[int]
    first_token: int
    copy_src: int = -1
    copy_dst: int = -1


@dataclass
class StepPlan:
    """What one worker runs in one step; only what changed since the last step.

    The worker applies, in order: ``reset``, forks, drops (``finished``), new sequences,
    tier changes, then runs ``new`` and ``continued`` sequences in one forward pass, in
    the order given.
    """

    step_id: int
    new: list[NewSequence] = field(default_factory=list)
    continued: list[ContinuedSequence] = field(default_factory=list)
    forks: list[ForkedSequence] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    tiers: list[TierChange] = field(default_factory=list)
    # Forget every sequence held: the first plan of a scheduler that adopted the worker
    # after a restart (what it held belongs to requests the new scheduler never saw).
    reset: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return (sum(s.num_scheduled_tokens for s in self.new)
                + sum(s.num_scheduled_tokens for s in self.continued))

    @property
    def is_empty(self) -> bool:
        return not (self.new or self.continued or self.forks or self.finished or self.tiers
                    or self.reset)


@dataclass
class TokenLogprobs:
    """Log-probabilities of one sampled token and the top alternatives."""

    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SequenceOutput:
    """Tokens sampled for one sequence in one step.

    Normally one token; ``n`` tokens when an ``n > 1`` request's prompt completes
    (one per child, in sample-index order); none while a chunked prefill is partial.
    ``prompt_logprobs`` (requests asking for them): the logprobs of the prompt tokens
    from position ``prompt_logprobs_start`` on that this step's chunk predicted.
    """

    seq_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0


@dataclass
class TierStats:
    """A worker's host tier and recall cache since it started (long-context sequences)."""

    host_blocks: int = 0        # host-tier blocks in the worker's store
    offloaded_blocks: int = 0   # pool blocks copied to the host tier
    received_blocks: int = 0    # pool blocks a handoff wrote straight into the host tier
    recalled_blocks: int = 0    # (layer, KV head) slices of pool blocks copied back
    recall_hits: int = 0        # ... found in the recall cache instead
    selections: int = 0         # (sequence, layer) top-k selections made


@dataclass
class WorkerStats:
    """A worker's view of itself after a step, for placement, metrics and autoscaling."""

    num_free_blocks: int = 0
    num_blocks: int = 0
    step_time_s: float = 0.0
    num_tokens: int = 0
    num_seqs: int = 0
    prepare_s: float = 0.0   # laying out the step's inputs
    forward_s: float = 0.0   # the model, logits included
    sample_s: float = 0.0
    tier: TierStats | None = None  # None when long contexts are off


@dataclass
class StepOutput:
    step_id: int
    outputs: list[SequenceOutput] = field(default_factory=list)
    stats: WorkerStats = field(default_factory=WorkerStats)


T = TypeVar("T")


def encode(msg: Any) -> bytes:
    """Serialize a protocol dataclass to msgpack."""
    return msgpack.packb(_to_plain(msg), use_bin_type=True)


def decode(cls: type[T], data: bytes) -> T:
    """Rebuild a protocol dataclass of type ``cls`` from ``encode``'s output."""
    return _from_plain(cls, msgpack.unpackb(data, raw=False, strict_map_key=False))


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return [_to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, list):
        return [_to_plain(x) for x in obj]
    return obj


_HINTS: dict[type, list[tuple[str, Any]]] = {}


def _field_types(cls: type) -> list[tuple[str, Any]]:
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    return _HINTS[cls]


def _from_plain(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        kwargs = {name: _from_plain(ftp, v) for (name, ftp), v in zip(_field_types(tp), value)}
        obj = tp.__new__(tp)
        obj.__dict__.update(kwargs)
        return obj
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item_tp):
            return [_from_plain(item_tp, v) for v in value]
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_plain(args[0], value)
    return value
