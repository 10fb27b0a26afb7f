"""STUB of vllm/config/utils.py: ``replace`` (dataclasses.replace for the vendored dataclasses)."""

from dataclasses import replace  # noqa: F401
