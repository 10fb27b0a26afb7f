"""STUB of vllm/utils: ``random_uuid`` as vLLM defines it."""

import uuid


def random_uuid() -> str:
    return str(uuid.uuid4().hex)
