"""The chat proxy with tools: schemas reach the chat template, replies come back with
parsed ``tool_calls``, and a conversation with calls and results extends token-wise."""

from __future__ import annotations

import json
import re

import pytest

from services.inference_gateway.tool_calls import parse_tool_calls
from temper.policy import default_tokenizer
from temper.settings.inference import ToolParser
from tests.services.inference_gateway.test_gateway import gateway  # noqa: F401

pytestmark = pytest.mark.timeout(60)
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "run Python",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


def test_replies_are_parsed_into_openai_tool_calls():
    text = 'Let me run it.\n<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    content, calls = parse_tool_calls(text, ToolParser.hermes)
    assert content == "Let me run it."
    assert calls == [
        {
            "id": calls[0]["id"],
            "type": "function",
            "function": {"name": "python", "arguments": '{"code": "print(1)"}'},
        }
    ]
    # nine letters and digits (what Mistral's templates accept), the same for the same reply
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0]["id"])
    assert parse_tool_calls(text, ToolParser.hermes)[1][0]["id"] == calls[0]["id"]
    content, calls = parse_tool_calls(
        '{"name": "python", "parameters": {"code": "1"}}', ToolParser.llama3_json
    )
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"code": "1"}
    broken = "<tool_call>{oops</tool_call>"
    assert parse_tool_calls(broken, ToolParser.hermes) == (broken, [])  # left as content, as vLLM does
    assert parse_tool_calls("just words", ToolParser.hermes) == ("just words", [])


def test_mistral_pythonic_and_tool_code_replies_are_parsed_too():
    text = 'Checking. [TOOL_CALLS] [{"name": "python", "arguments": {"code": "1"}, "id": "Ab3dE6gH9"}]'
    content, calls = parse_tool_calls(text, ToolParser.mistral)
    assert content == "Checking." and calls[0]["id"] == "Ab3dE6gH9"
    assert json.loads(calls[0]["function"]["arguments"]) == {"code": "1"}
    content, calls = parse_tool_calls('[python(code="1"), submit(answer="2")]', ToolParser.pythonic)
    assert content == "" and [c["function"]["name"] for c in calls] == ["python", "submit"]
    content, calls = parse_tool_calls('Run:\n```tool_code\npython(code="1")\n```', ToolParser.tool_code)
    assert content == "Run:" and calls[0]["function"]["name"] == "python"
    for broken, parser in (("[TOOL_CALLS] [{oops", ToolParser.mistral), ("[python(1)]", ToolParser.pythonic)):
        assert parse_tool_calls(broken, parser) == (broken, [])


async def test_tools_reach_the_template_and_calls_extend_the_conversation(gateway) -> None:  # noqa: F811
    c, svc = gateway
    tok = default_tokenizer()
    h = {"X-Temper-Episode": "ep-tools"}
    msgs = [{"role": "user", "content": "17 * 23?"}]
    body = {"messages": msgs, "tools": [PYTHON], "max_tokens": 4, "seed": 1}
    r1 = await c.post("/v1/chat/completions", headers=h, json=body)
    assert r1.status_code == 200, r1.text
    d1 = r1.json()
    assert '"name": "python"' in tok.decode(d1["prompt_token_ids"])  # rendered by the template's tools
    assert d1["choices"][0]["message"]["tool_calls"] == []  # a random model's reply has no call
    # the client answers as an agent framework would: the reply, then a call and its result
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "python", "arguments": '{"code": "print(17*23)"}'},
    }
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": d1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "use the tool"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "391"},
    ]
    r2 = await c.post("/v1/chat/completions", headers=h, json={**body, "messages": msgs2})
    assert r2.status_code == 200, r2.text
    d2 = r2.json()
    first = d1["prompt_token_ids"] + d1["choices"][0]["token_ids"]
    assert d2["prompt_token_ids"][: len(first)] == first and svc.sessions.extended == 1
    tail = tok.decode(d2["prompt_token_ids"][len(first) :], skip_special=False)
    assert '<tool_call>{"name": "python", "arguments": {"code": "print(17*23)"}}</tool_call>' in tail
    assert tail.endswith("<|tool|>391<|end|><|assistant|>")
    bad = {**call, "function": {"name": "python", "arguments": "{not json"}}
    r3 = await c.post(
        "/v1/chat/completions", json={**body, "messages": [*msgs, {"role": "assistant", "tool_calls": [bad]}]}
    )
    assert r3.status_code == 400 and "not JSON" in r3.json()["detail"]


def test_qwen3_coder_calls_come_back_with_the_types_of_the_requests_tools():
    text = "Editing.\n<tool_call>\n<function=edit>\n<parameter=line>\n7\n</parameter>\n<parameter=path>\na.py\n</parameter>\n</function>\n</tool_call>"
    schema = {"type": "object", "properties": {"line": {"type": "integer"}, "path": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "edit", "parameters": schema}}]
    content, calls = parse_tool_calls(text, "qwen3_coder", tools=tools)
    assert content == "Editing." and json.loads(calls[0]["function"]["arguments"]) == {
        "line": 7,
        "path": "a.py",
    }
    # without the schema the values stay the text the model wrote
    assert json.loads(parse_tool_calls(text, "qwen3_coder")[1][0]["function"]["arguments"]) == {
        "line": "7",
        "path": "a.py",
    }
