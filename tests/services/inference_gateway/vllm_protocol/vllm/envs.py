"""STUB of vllm/envs.py: only the two limits the vendored protocol reads, with vLLM 0.33.0's defaults."""

VLLM_MAX_COMPLETION_PROMPTS = 1024
VLLM_MAX_STOP_STRINGS = 4
