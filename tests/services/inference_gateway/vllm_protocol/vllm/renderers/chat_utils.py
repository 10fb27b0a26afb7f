"""STUB of vllm/renderers/chat_utils.py: ``make_tool_call_id``."""

from vllm.utils import random_uuid


def make_tool_call_id(id_type: str = "random", func_name=None, idx=None) -> str:
    return f"chatcmpl-tool-{random_uuid()}"
