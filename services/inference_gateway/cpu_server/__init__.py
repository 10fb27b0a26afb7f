"""Temper's CPU model server: a torch causal LM behind vLLM's OpenAI-compatible API subset."""

from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.runner import (
    GenOutput,
    GenRequest,
    ModelRunner,
    SamplingParams,
)

__all__ = ["BatchScheduler", "ModelRunner", "GenOutput", "GenRequest", "SamplingParams"]
