"""Multi-turn, token-in/token-out, against chat templates in the shapes real models ship
(``templates/``: Qwen2.5's and Llama 3.1's with tools, Mistral-7B-Instruct-v0.3's,
Gemma 3's), each with a BPE tokenizer trained here and loaded from a directory laid out
as on a model hub: first that each fixture renders its model's format (literal text), then
that episodes with tool calls stay token-exact on it (the ids the model sampled are the
ids the trainer sees, and with canonical sampling they equal the whole conversation
re-rendered), that the template check at the door passes what works and refuses what
cannot with the template's own error, and the templates' own quirks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from temper.envs import make_environment
from temper.policy import ChatTokenizer, TemplateError
from tests.libs.policy.real_templates import SHIPPED, hub_tokenizer

pytestmark = pytest.mark.timeout(120)

TASK = {"id": "t", "kind": "math", "prompt": "Compute 17 * 23.", "spec": {}}
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
CALL = {
    "id": "Ab3dE6gH9",
    "type": "function",
    "function": {"name": "python", "arguments": {"code": "print(17 * 23)"}},
}


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, ChatTokenizer]:
    root = tmp_path_factory.mktemp("hub")
    return {name: hub_tokenizer(name, root / name) for name in SHIPPED}


def environment(name: str, **over):
    s = SHIPPED[name]
    options = {"action_format": s.parser, "tool_role": s.tool_role, "max_turns": 4, **s.job, **over}
    return make_environment("math", TASK, **options)


# --- each fixture renders its model's format ----------------------------------------------------


def conversation(result_role: str = "tool", call_content: str = "") -> list[dict]:
    result = {"role": result_role, "content": "391"}
    if result_role == "tool":
        result |= {"tool_call_id": CALL["id"], "name": "python"}
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Compute 17 * 23."},
        {"role": "assistant", "content": call_content, "tool_calls": [CALL]},
        result,
        {"role": "assistant", "content": "391."},
    ]


def test_the_templates_are_in_tokenizer_config_json_as_on_a_hub(tmp_path):
    hub_tokenizer("mistral-v0.3", tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == SHIPPED["mistral-v0.3"].text
    assert not (tmp_path / "chat_template.jinja").exists()


def test_qwen25_renders_qwens_format(toks):
    text = toks["qwen2.5"].render_text(conversation(), tools=[PYTHON], add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(PYTHON)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nCompute 17 * 23.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "python", "arguments": {"code": "print(17 * 23)"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n391.<|im_end|>\n"
    )
    plain = toks["qwen2.5"].render_text([{"role": "user", "content": "hi"}])
    assert plain == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama31_renders_llamas_format(toks):
    text = toks["llama3.1"].render_text(conversation(), tools=[PYTHON], add_generation_prompt=False)
    assert (
        text
        == (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
            "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            "value}.Do not use variables.\n\n"
            + json.dumps(PYTHON, indent=4)
            + "\n\nCompute 17 * 23.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            '{"name": "python", "parameters": {"code": "print(17 * 23)"}}<|eot_id|>'
            '<|start_header_id|>ipython<|end_header_id|>\n\n"391"<|eot_id|>'  # a string result, quoted
            "<|start_header_id|>assistant<|end_header_id|>\n\n391.<|eot_id|>"
        )
    )
    two = conversation()
    two[2] = {**two[2], "tool_calls": [CALL, CALL]}
    with pytest.raises(TemplateError, match="This model only supports single tool-calls at once!"):
        toks["llama3.1"].render_text(two, tools=[PYTHON])


def test_mistral_v03_renders_mistrals_format(toks):
    tok = toks["mistral-v0.3"]
    tools = (
        '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "python", "description": "Run Python.", '
        '"parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]'
        "[/AVAILABLE_TOOLS]"
    )
    assert tok.render_text(conversation(), tools=[PYTHON], add_generation_prompt=False) == (
        f"<s>{tools}[INST] Compute 17 * 23.[/INST]"  # the system text: only with the last message's user turn
        '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "print(17 * 23)"}, "id": "Ab3dE6gH9"}]</s>'
        '[TOOL_RESULTS] {"content": 391, "call_id": "Ab3dE6gH9"}[/TOOL_RESULTS] 391.</s>'
    )
    assert tok.render_text(conversation()[:2], tools=[PYTHON]) == (
        f"<s>{tools}[INST] Be brief.\n\nCompute 17 * 23.[/INST]"
    )
    # what Temper sent before tool messages carried ids: the template's own refusal
    no_id = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
        {"role": "tool", "content": "1"},
    ]
    with pytest.raises(TemplateError, match="Tool call IDs should be alphanumeric strings with length 9!"):
        tok.render_text(no_id)
    with pytest.raises(TemplateError, match="roles must alternate user/assistant"):
        tok.render_text([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])


def test_gemma3_renders_gemmas_format(toks):
    tok = toks["gemma3"]
    call = '```tool_code\npython(code="print(17 * 23)")\n```'
    text = tok.render_text(conversation("user", call), tools=[PYTHON], add_generation_prompt=False)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nCompute 17 * 23.<end_of_turn>\n"
        f"<start_of_turn>model\n{call}<end_of_turn>\n"
        "<start_of_turn>user\n391<end_of_turn>\n"
        "<start_of_turn>model\n391.<end_of_turn>\n"
    )
    # no tool role, and the tools are dropped without a word
    with pytest.raises(
        TemplateError, match=re.escape("Conversation roles must alternate user/assistant/user/assistant/...")
    ):
        tok.render_text(conversation("tool"), tools=[PYTHON])
    first = conversation()[:2]
    assert tok.render_text(first, tools=[PYTHON]) == tok.render_text(first)


# --- episodes stay token-exact --------------------------------------------------------------------


def sandbox_result(stdout: str) -> dict:
    return {"exit_code": 0, "stdout": stdout, "wall_s": 0.01}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_multi_turn_episode_with_tool_calls_is_token_exact(toks, name):
    """Three turns: two tool calls in the model's own format, then the answer. Temper's
    sequence (first prompt, sampled ids, continuation, ...) is the whole conversation
    rendered by the template with OpenAI-shaped ``tool_calls`` and ``tool_call_id``s,
    token for token; the tool results answer the calls' ids."""
    s, tok = SHIPPED[name], toks[name]
    env = environment(name)
    env.check_template(tok)  # what the door checks passes
    prompt = env.first_prompt_ids(tok)
    assert prompt == tok.render(env.first_messages(), tools=env.tool_schemas())
    seen = tok.decode(prompt, skip_special=False)
    assert "python" in seen and "submit" in seen, "the model is told about its tools"

    eot = tok.end_of_turn_ids[0]
    ids, messages = list(prompt), list(env.first_messages())
    for code, out in (("print(17 * 23)", "391"), ("print(391 % 10)", "1")):
        text = s.call_text(code)
        sampled = tok.encode(text) + [eot]  # the model stopped on its end-of-turn token
        action = env.parse(tok.decode(sampled), turn=0)  # as the dispatcher decodes a reply
        assert action.kind == "sandbox" and action.command == {"kind": "run_python", "code": code}
        assert [c["function"] for c in action.calls] == [{"name": "python", "arguments": {"code": code}}]
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in action.calls)
        observations = env.observe(action, sandbox_result(out))
        ids += [*sampled, *env.observation_ids(tok, sampled, observations, calls=action.calls)]
        if s.tool_role == "user":  # Gemma: the call is the turn's text, the result a user turn
            messages.append({"role": "assistant", "content": text})
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": action.calls})
        messages += env.observation_messages(observations, calls=action.calls)
    final = tok.encode(s.answer) + [eot]
    assert env.parse(tok.decode(final), turn=2).answer == "391"
    ids += [*final, *tok.close_turn(final)]
    messages.append({"role": "assistant", "content": s.answer})

    whole = tok.render(messages, tools=env.tool_schemas(), add_generation_prompt=False)
    assert tok.decode(ids, skip_special=False) == tok.decode(whole, skip_special=False)
    assert ids == whole
    if name == "mistral-v0.3":  # the results carry the id the model wrote
        assert tok.decode(ids, skip_special=False).count('"call_id": "Ab3dE6gH9"') == 2


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_ids_the_model_sampled_are_the_ids_the_trainer_sees(toks, name):
    """A sampler may draw a tokenisation that re-tokenising the text would not give: the
    conversation keeps those ids where they were sampled (the trainer's model segment is
    exactly them), and its text is still the template's."""
    s, tok = SHIPPED[name], toks[name]
    env = environment(name)
    prompt = env.first_prompt_ids(tok)
    text = s.call_text("print(17 * 23)")
    canonical = tok.encode(text)
    odd = [i for ch in text for i in tok.encode(ch)]  # one token per character
    assert odd != canonical and tok.decode(odd, skip_special=False) == text
    sampled = [*odd, tok.end_of_turn_ids[0]]
    action = env.parse(tok.decode(sampled), turn=0)
    observations = env.observe(action, sandbox_result("391"))
    ids = [*prompt, *sampled, *env.observation_ids(tok, sampled, observations, calls=action.calls)]
    assert ids[len(prompt) : len(prompt) + len(sampled)] == sampled
    assert ids[: len(prompt)] == prompt
    message = (
        {"role": "assistant", "content": text}
        if s.tool_role == "user"
        else {"role": "assistant", "content": "", "tool_calls": action.calls}
    )
    rendered = tok.render(
        [*env.first_messages(), message, *env.observation_messages(observations, calls=action.calls)],
        tools=env.tool_schemas(),
    )
    assert tok.decode(ids, skip_special=False) == tok.decode(rendered, skip_special=False)
    assert ids != rendered


def test_mistral_calls_without_an_id_get_one_the_template_takes(toks):
    """Mistral models may leave the id out: Temper makes one (nine letters and digits, the
    same for the same reply), and the tool result carries it."""
    tok = toks["mistral-v0.3"]
    env = environment("mistral-v0.3")
    reply = '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "print(2)"}}]'
    sampled = tok.encode(reply) + [tok.end_of_turn_ids[0]]
    action = env.parse(tok.decode(sampled), turn=0)
    [call] = action.calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]) and env.parse(tok.decode(sampled), turn=0).calls == [
        call
    ]
    obs = tok.decode(env.observation_ids(tok, sampled, ["2"], calls=action.calls), skip_special=False)
    assert obs == f'[TOOL_RESULTS] {{"content": 2, "call_id": "{call["id"]}"}}[/TOOL_RESULTS]'
    # with the special tokens kept (the marker) it reads the same call
    [again] = env.parse(tok.decode(sampled[:-1], skip_special=False), turn=0).calls
    assert again["function"] == call["function"]


def test_mistral_drops_the_system_text_once_the_user_turn_is_not_last(toks):
    """The Mistral v0.3 template's own quirk: the system text rides with the user turn only
    while it is the conversation's last message. Temper extends what the model saw (the
    first prompt, with the system text), so its sequence is not the re-rendering, which
    has lost the system text; the trainer sees what the model saw."""
    tok = toks["mistral-v0.3"]
    env = environment("mistral-v0.3", system_prompt="Be brief.")
    prompt = env.first_prompt_ids(tok)
    assert "Be brief." in tok.decode(prompt)
    sampled = tok.encode(" 391.") + [tok.end_of_turn_ids[0]]
    ids = [*prompt, *sampled, *env.observation_ids(tok, sampled, ["Error: no final answer found"])]
    assert ids[: len(prompt)] == prompt and "Be brief." in tok.decode(ids)
    again = tok.render_text(
        [*env.first_messages(), {"role": "assistant", "content": " 391."}, *env.observation_messages(
            ["Error: no final answer found"], seed=",".join(map(str, sampled)))],
        tools=env.tool_schemas(),
    )  # fmt: skip
    assert "Be brief." not in again
    assert tok.decode(ids, skip_special=False).replace("Be brief.\n\n", "") == again


# --- the door's check -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_template_check_passes_each_model_as_its_jobs_configure_it(toks, name):
    environment(name).check_template(toks[name])
    # and the code-block format (no tools rendered) too, where the template has a tool role
    if SHIPPED[name].tool_role is None:
        environment(name, action_format="code_block").check_template(toks[name])


def test_the_check_refuses_gemma_without_tool_role_user(toks):
    env = environment("gemma3", tool_role=None)  # results as tool messages
    with pytest.raises(TemplateError, match=re.escape("Conversation roles must alternate user/assistant/")):
        env.check_template(toks["gemma3"])


def test_the_check_refuses_a_template_that_drops_the_tools_no_prompt_names(toks):
    env = environment("gemma3", system_prompt="Solve it with python.")  # submit is named nowhere
    with pytest.raises(TemplateError, match="ignores tools .* does not name submit: describe the tools"):
        env.check_template(toks["gemma3"])
    env = environment("gemma3", system_prompt="")
    with pytest.raises(TemplateError, match="does not name python, submit"):
        env.check_template(toks["gemma3"])


def test_the_check_reports_the_templates_own_error(toks, tmp_path: Path):
    """A Mistral-shaped template that refuses every tool result, as the v0.3 template did
    for Temper's id-less tool messages: the check says the template's words."""
    tok = toks["mistral-v0.3"]
    broken = ChatTokenizer(
        tok.hf.__class__.from_pretrained(str(_saved(tok, tmp_path))), eos_token_ids=tok.stop_ids
    )
    broken.hf.chat_template = SHIPPED["mistral-v0.3"].text.replace(
        "message.tool_call_id | length != 9", "message.tool_call_id | length != 10"
    )
    with pytest.raises(TemplateError, match="Tool call IDs should be alphanumeric strings with length 9!"):
        environment("mistral-v0.3").check_template(broken)


def _saved(tok: ChatTokenizer, d: Path) -> Path:
    tok.save(d)
    return d


def test_parsers_read_the_reply_with_its_special_tokens(toks):
    """What the dispatcher hands a parser: the sampled ids with their special tokens (Mistral's
    [TOOL_CALLS]), the stop token left out; the engine's text where a stop string cut it."""
    tok = toks["mistral-v0.3"]
    reply = '[TOOL_CALLS] [{"name": "python", "arguments": {"code": "1"}}]'
    ids = [*tok.encode(reply), tok.end_of_turn_ids[0]]
    assert tok.decode(ids) == ' [{"name": "python", "arguments": {"code": "1"}}]'  # the marker is gone
    assert tok.parse_text(ids, tok.decode(ids)) == reply
    assert tok.parse_text(ids) == reply
    assert tok.parse_text(ids, "[{") == "[{"  # cut by a stop string: the engine's text
