"""STUB package root (not vLLM's): only the protocol modules listed in ../README.md are vLLM's own."""
