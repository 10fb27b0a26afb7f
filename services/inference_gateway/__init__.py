"""The inference gateway: routes generation requests to model backends (vLLM or the CPU model server)."""
