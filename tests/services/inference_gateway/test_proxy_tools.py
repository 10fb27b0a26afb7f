"""The chat proxy with tools: schemas reach the chat template, replies come back with
parsed ``tool_calls``, and a conversation with calls and results extends token-wise."""

from __future__ import annotations

import json

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
            "id": "call_0",
            "type": "function",
            "function": {"name": "python", "arguments": '{"code": "print(1)"}'},
        }
    ]
    content, calls = parse_tool_calls(
        '{"name": "python", "parameters": {"code": "1"}}', ToolParser.llama3_json
    )
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"code": "1"}
    broken = "<tool_call>{oops</tool_call>"
    assert parse_tool_calls(broken, ToolParser.hermes) == (broken, [])  # left as content, as vLLM does
    assert parse_tool_calls("just words", ToolParser.hermes) == ("just words", [])


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
