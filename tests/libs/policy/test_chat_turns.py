"""Multi-turn, token-in/token-out, against the templates themselves: where Temper's
sequence (first prompt + sampled ids + continuation + ...) equals the template's
rendering of the whole conversation re-tokenised, and where it cannot."""

from __future__ import annotations

import pytest

from temper.envs import make_environment
from temper.jobspec import ActionFormat
from temper.policy import ChatTokenizer
from temper.policy.build import CHATML_TEMPLATE, train_tokenizer

pytestmark = pytest.mark.timeout(60)

CORPUS = [
    "Compute 17 * 23 with python and give the answer.",
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(17 * 23)"}}\n</tool_call>',
    '{"name": "python", "parameters": {"code": "print(17 * 23)"}}',
    "391\nThe answer is \\boxed{391}.",
] * 30
TASK = {"id": "t", "kind": "math", "prompt": "Compute 17 * 23.", "spec": {}}
CALL = {"name": "python", "arguments": {"code": "print(17 * 23)"}}
REPLIES = {
    "chatml": (
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(17 * 23)"}}\n</tool_call>',
        "hermes",
    ),
    "llama3": ('{"name": "python", "parameters": {"code": "print(17 * 23)"}}', "llama3_json"),
}


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def setup(request) -> tuple[str, ChatTokenizer]:
    return request.param, train_tokenizer(CORPUS, template=request.param, vocab_size=420)


def test_temper_sequence_equals_the_whole_conversation_rendered(setup):
    name, tok = setup
    reply, parser = REPLIES[name]
    env = make_environment("math", TASK, max_turns=3, action_format=parser)
    prompt = env.first_prompt_ids(tok)
    assert prompt == tok.render(env.first_messages(), tools=env.tool_schemas())
    assert "python" in tok.decode(prompt, skip_special=False), "the tools reach the template"

    eot = tok.end_of_turn_ids[0]
    sampled1 = tok.encode(reply) + [eot]  # the model stopped on its end-of-turn token
    action = env.parse(tok.decode(sampled1), turn=0)
    assert action.kind == "sandbox" and action.command == {"kind": "run_python", "code": "print(17 * 23)"}
    obs = env.observation_ids(tok, sampled1, "391")
    sampled2 = tok.encode("The answer is \\boxed{391}.") + [eot]
    temper = [*prompt, *sampled1, *obs, *sampled2, *tok.close_turn(sampled2)]

    msgs = env.first_messages()
    msgs += [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
        {"role": "tool", "content": "391"},
        {"role": "assistant", "content": "The answer is \\boxed{391}."},
    ]
    whole = tok.render(msgs, tools=env.tool_schemas(), add_generation_prompt=False)
    assert tok.decode(temper, skip_special=False) == tok.decode(whole, skip_special=False)
    assert temper == whole


def test_a_turn_cut_by_max_tokens_is_closed_by_the_templates_end_of_turn(setup):
    name, tok = setup
    env = make_environment("math", TASK, max_turns=3, action_format=REPLIES[name][1])
    prompt = env.first_prompt_ids(tok)
    cut = tok.encode("The answer is")  # no end-of-turn sampled
    ids = [*prompt, *cut, *env.observation_ids(tok, cut, "Error: no final answer found")]
    msgs = [
        *env.first_messages(),
        {"role": "assistant", "content": "The answer is"},
        {"role": "tool", "content": "Error: no final answer found"},
    ]
    assert ids == tok.render(msgs, tools=env.tool_schemas())


def test_sampled_ids_are_kept_even_where_re_tokenising_would_merge_them(setup):
    _, tok = setup
    text = "print(17 * 23)"
    canonical = tok.encode(text)
    odd = [i for ch in text for i in tok.encode(ch)]  # one token per character: what a sampler may draw
    assert odd != canonical and tok.decode(odd) == text
    prompt = tok.render([{"role": "user", "content": "go"}])
    ids = [*prompt, *odd, *tok.continuation(odd, [{"role": "tool", "content": "391"}])]
    assert ids[len(prompt) : len(prompt) + len(odd)] == odd  # never re-tokenised
    whole = tok.render(
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": text},
            {"role": "tool", "content": "391"},
        ]
    )
    assert tok.decode(ids, skip_special=False) == tok.decode(whole, skip_special=False)
    assert ids != whole  # same text, other ids: the re-rendering is not what the model sampled


def test_a_template_that_drops_earlier_reasoning_still_extends_token_wise():
    # Qwen3-style: earlier assistant turns lose their <think>...</think> when rendered again.
    template = CHATML_TEMPLATE.replace(
        "{% if message.content %}{{ message.content }}{% endif %}",
        "{% if message.content %}{{ message.content if loop.last else message.content.split('</think>')[-1].lstrip() }}{% endif %}",
    )
    tok = train_tokenizer(CORPUS, template="chatml", vocab_size=420)
    tok.hf.chat_template = template
    tok.__dict__.pop("end_of_turn_text", None)
    tok.__dict__.pop("end_of_turn_ids", None)
    first = [{"role": "user", "content": "Compute 17 * 23."}]
    prompt = tok.render(first)
    sampled = tok.encode("<think>17*23=391</think>\nThe answer is 391.") + tok.end_of_turn_ids[:1]
    ids = [*prompt, *sampled, *tok.continuation(sampled, [{"role": "user", "content": "Sure?"}])]
    rendered = tok.render(
        [*first, {"role": "assistant", "content": "<think>17*23=391</think>\nThe answer is 391."},
         {"role": "user", "content": "Sure?"}]
    )  # fmt: skip
    assert "<think>" in tok.decode(ids) and "<think>" not in tok.decode(rendered)
    assert ids[: len(prompt) + len(sampled)] == prompt + sampled
    assert tok.decode(ids).endswith(
        tok.decode(rendered)[-40:]
    )  # the new turn is rendered as the template does


def test_parsers_are_validated_by_name():
    from temper.jobspec import SpecError, parse_spec

    base = {"name": "x", "policy": {"model": "m"}, "tasks": {"taskset": "t"}}
    with pytest.raises(
        SpecError,
        match=r"installed: code_block, tool_call, hermes \(temper\), llama3_json \(temper\), "
        r"mistral \(temper\), pythonic \(temper\), qwen3_coder \(temper\), tool_code \(temper\)",
    ):
        parse_spec({**base, "environment": {"action_format": "qwen3_xml"}})
    for name in ("mistral", "pythonic", "tool_code"):
        assert parse_spec({**base, "environment": {"action_format": name}}).environment.action_format == name
    assert parse_spec({**base, "environment": {"action_format": "hermes"}}).environment.action_format == (
        ActionFormat.hermes
    )


def test_two_calls_in_one_turn_get_two_tool_messages_as_the_template_renders_them(setup):
    name, tok = setup
    reply, parser = REPLIES[name]
    env = make_environment("math", TASK, max_turns=3, action_format=parser)
    prompt = env.first_prompt_ids(tok)
    sampled = tok.encode(reply) + [tok.end_of_turn_ids[0]]
    obs = env.observation_ids(tok, sampled, ["391", "done"])
    calls = [{"type": "function", "function": CALL}] * 2
    msgs = [
        *env.first_messages(),
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "391"},
        {"role": "tool", "content": "done"},
    ]
    rendered = tok.decode(tok.render(msgs, tools=env.tool_schemas()), skip_special=False)
    ours = tok.decode([*prompt, *sampled, *obs], skip_special=False)
    # the observations are the template's own rendering of two tool messages, in order
    assert ours.endswith(rendered[rendered.index("391") - 40 :]) and rendered.count("done") == 1
