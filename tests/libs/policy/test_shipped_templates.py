"""Chat templates byte for byte as the models ship them (``templates/shipped/``, with their
sources and sha256 in ``SOURCES.json``), and Mistral's real tokenizer from the
``mistral_common`` wheel.

The token-exact multi-turn tests of ``test_real_templates.py`` run on the shipped Qwen2.5,
Llama 3.1 and Gemma 3 templates too (``real_templates.SHIPPED``'s ``*-shipped`` entries).
Here: the fixtures are the bytes their sources hold; the hand-written reproductions render
exactly what the shipped templates render; and an episode with two tool calls that Temper
builds token for token, on Mistral's v3 SentencePiece vocabulary with Mistral's own v3
template, is the token sequence ``mistral_common`` itself encodes for that conversation."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from mistral_common.protocol.instruct.messages import (
    AssistantMessage,
    SystemMessage,
    ToolMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from temper.envs import make_environment
from temper.policy import ChatTokenizer
from tests.libs.policy.real_templates import (
    MISTRAL_V3,
    SHIPPED_DIR,
    hub_tokenizer,
    mistral_common_file,
    mistral_v3_tokenizer,
)
from tests.libs.policy.test_real_templates import PYTHON, TASK, conversation, sandbox_result

pytestmark = pytest.mark.timeout(180)


def test_the_fixtures_are_the_bytes_their_sources_name():
    sources = json.loads((SHIPPED_DIR / "SOURCES.json").read_text())
    files = sorted(p.name for p in SHIPPED_DIR.glob("*.jinja"))
    assert files == sorted(k for k in sources if k.endswith(".jinja"))
    for name in files:
        entry = sources[name]
        assert hashlib.sha256((SHIPPED_DIR / name).read_bytes()).hexdigest() == entry["sha256"], name
        assert entry["repository"] and entry["path"] and re.search(r"\b[0-9a-f]{40}\b", entry["commit"])


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1", "gemma3"])
def test_the_hand_written_reproductions_render_what_the_shipped_templates_render(tmp_path: Path, name: str):
    written = hub_tokenizer(name, tmp_path / "written")
    shipped = hub_tokenizer(f"{name}-shipped", tmp_path / "shipped")
    role = "user" if name == "gemma3" else "tool"
    call = '```tool_code\npython(code="print(17 * 23)")\n```' if name == "gemma3" else ""
    for messages, prompt in ((conversation(role, call), False), (conversation(role, call)[:2], True)):
        text = shipped.render_text(messages, tools=[PYTHON], add_generation_prompt=prompt)
        assert written.render_text(messages, tools=[PYTHON], add_generation_prompt=prompt) == text


# --- Mistral's real tokenizer (mistral_common) ---------------------------------------------------


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[ChatTokenizer, MistralTokenizer]:
    tok = mistral_v3_tokenizer(tmp_path_factory.mktemp("mistral-v3"))
    reference = MistralTokenizer.from_file(
        str(mistral_common_file(MISTRAL_V3)), mode=ValidationMode.finetuning
    )
    return tok, reference


def test_the_converted_vocabulary_encodes_text_as_mistral_common_does(mistral):
    tok, reference = mistral
    spm = reference.instruct_tokenizer.tokenizer
    assert tok.vocab_size == spm.n_words == 32768
    for text in (
        "Compute 17 * 23.",
        "print(17 * 23)\n391",
        "two  spaces, ünïcödé and a tab\t.",
        "[exit code 0]",
    ):
        assert tok.encode(text) == spm.encode(text, bos=False, eos=False), text
    assert tok.decode(spm.encode("Compute 17 * 23.", bos=False, eos=False)) == "Compute 17 * 23."
    # its control tokens are single tokens: [TOOL_CALLS] is 5 in both
    assert tok.encode("[TOOL_CALLS]") == [spm.get_special_token("[TOOL_CALLS]")] == [5]


def test_an_episode_with_two_tool_calls_is_the_token_sequence_mistral_common_encodes(mistral):
    """Temper's sequence (first prompt rendered by Mistral's template, the ids sampled,
    each continuation with the tool result) equals, id for id, what mistral_common's own
    v3 instruct tokenizer encodes for the same conversation: system prompt, tools, two
    calls with their ids, their results, and the answer."""
    tok, reference = mistral
    env = make_environment("math", TASK, action_format="mistral", max_turns=4, system_prompt="Be brief.")
    env.check_template(tok)
    assert tok.arguments_as_text  # Mistral's template takes the arguments' JSON text
    eot = tok.end_of_turn_ids[0]
    ids = env.first_prompt_ids(tok)
    messages: list = [SystemMessage(content="Be brief."), UserMessage(content=TASK["prompt"])]
    for i, (code, out) in enumerate((("print(17 * 23)", "391"), ("print(391 % 10)", "1"))):
        call_id = f"Ab3dE6gH{i}"
        text = f'[TOOL_CALLS] [{{"name": "python", "arguments": {{"code": "{code}"}}, "id": "{call_id}"}}]'
        sampled = [*tok.encode(text), eot]
        action = env.parse(tok.parse_text(sampled), turn=i)
        assert action.kind == "sandbox" and action.calls and action.calls[0]["id"] == call_id
        observations = env.observe(action, sandbox_result(out))
        ids += [*sampled, *env.observation_ids(tok, sampled, observations, calls=action.calls)]
        arguments = json.dumps({"code": code})
        messages += [
            AssistantMessage(
                tool_calls=[ToolCall(id=call_id, function=FunctionCall(name="python", arguments=arguments))]
            ),
            ToolMessage(content=observations[0], tool_call_id=call_id, name="python"),
        ]
    final = [*tok.encode("The answer is \\boxed{391}."), eot]
    assert env.parse(tok.parse_text(final), turn=2).answer == "391"
    ids += final
    messages.append(AssistantMessage(content="The answer is \\boxed{391}."))
    tools = [Tool(function=Function(**schema["function"])) for schema in env.tool_schemas() or []]
    encoded = reference.encode_chat_completion(ChatCompletionRequest(messages=messages, tools=tools))
    assert tok.decode(ids, skip_special=False) == tok.decode(encoded.tokens, skip_special=False)
    assert ids == encoded.tokens


def test_mistrals_template_would_escape_object_arguments_and_temper_sends_their_text(mistral):
    """What ``arguments_as_text`` is for: given an object, Mistral's template joins
    ``arguments|tojson|safe`` to plain text and the plain text's quotes come out HTML-escaped."""
    tok, _ = mistral
    call = {"id": "Ab3dE6gH9", "type": "function", "function": {"name": "python", "arguments": {"code": "1"}}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    raw = tok.hf.apply_chat_template(messages, tokenize=False)
    assert "[TOOL_CALLS] [{&#34;name&#34;: &#34;python&#34;" in raw
    assert (
        '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "1"}, "id": "Ab3dE6gH9"}]'
        in tok.render_text(messages, add_generation_prompt=False)
    )


# --- Qwen3-Coder's XML calls ----------------------------------------------------------------------


def test_qwen3_coder_calls_as_its_template_writes_them_parse_back_with_their_types(tmp_path: Path):
    """The calls its template renders from OpenAI ``tool_calls`` (a string, an integer, a
    list, an object, a boolean) read back by the ``qwen3_coder`` parser, the values typed by
    the tool's schema; a string that looks like a number stays a string."""
    from temper.envs.tools import ToolCallError, call_content, parse_calls, typed_arguments

    tok = hub_tokenizer("qwen3-coder-shipped", tmp_path)
    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "line": {"type": "integer"},
            "tags": {"type": "array"},
            "patch": {"type": "object"},
            "dry": {"type": "boolean"},
            "note": {"type": "string"},
        },
    }
    tool = {
        "type": "function",
        "function": {"name": "edit", "description": "Edit a file.", "parameters": schema},
    }
    args = {
        "path": "src/x.py",
        "line": 3,
        "tags": ["a", "b"],
        "patch": {"old": "-", "new": "+"},
        "dry": True,
        "note": "42",
    }
    call = {"id": "c1", "type": "function", "function": {"name": "edit", "arguments": args}}
    text = tok.render_text(
        [
            {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "On it.", "tool_calls": [call]},
        ],
        tools=[tool],
        add_generation_prompt=False,
    )
    reply = text.split("<|im_start|>assistant", 1)[1].removesuffix("<|im_end|>\n")
    assert "<function=edit>\n<parameter=path>\nsrc/x.py\n</parameter>" in reply
    [parsed] = parse_calls(reply, "qwen3_coder")
    assert parsed.raw and parsed.arguments["line"] == "3"  # text until the schema types it
    assert typed_arguments(parsed.arguments, schema) == args
    assert call_content(reply, "qwen3_coder") == "On it."
    with pytest.raises(ToolCallError, match="opened but never closed"):
        parse_calls("<tool_call>\n<function=edit>\n", "qwen3_coder")
    with pytest.raises(ToolCallError, match="text outside <parameter"):
        parse_calls("<tool_call>\n<function=edit>\nstray\n</function>\n</tool_call>", "qwen3_coder")
