"""STUB of vllm/outputs.py: only ``WeightVersionSpan``, copied from vLLM 0.33.0 (the real module imports torch)."""

from dataclasses import dataclass


@dataclass
class WeightVersionSpan:
    """Output tokens `[start, end)` were sampled by weights labelled `version`."""

    version: str
    start: int
    end: int
