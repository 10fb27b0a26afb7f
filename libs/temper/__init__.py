"""Temper: RL post-training of LLM agents in real execution environments (shared library)."""

__version__ = "0.1.0"
