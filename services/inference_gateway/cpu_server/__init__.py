"""Temper's CPU model server: a torch causal LM behind vLLM's OpenAI-compatible API subset."""

from services.inference_gateway.cpu_server.core import (
    BatchScheduler,
    Engine,
    GenOutput,
    GenRequest,
    SamplingParams,
)

__all__ = ["BatchScheduler", "Engine", "GenOutput", "GenRequest", "SamplingParams"]
