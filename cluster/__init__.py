"""The user-facing layer: configuration, the offline ``LLM`` API, the engine loop,
the CLI (and, as they land, the Serve router and the batch job)."""

from cluster.llm import LLM
from cluster.outputs import CompletionOutput, Logprob, RequestOutput
from scheduler.protocol import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
