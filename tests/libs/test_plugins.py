"""The plugin registry: Temper's own plugins come from its entry points, an installed
distribution adds more without a change to Temper, and every failure names what is
installed."""

from __future__ import annotations

import json
import tomllib

import pytest

from temper import plugins
from temper.envs import UnknownEnvironment, make_environment
from temper.envs.tools import ToolCallError, parse_calls
from temper.jobspec import SpecError, parse_spec
from temper.rewards import FunctionComponent, ScoreContext, Skip, component_of
from temper.rewards.components import NotAComponent
from temper.rewards.models import Submission
from temper.tasks.models import TaskSpec
from tests.plugindist import ROOT, WORDCOUNT, on_path, project_dist, write_dist

BASE = {"name": "x", "policy": {"model": "m"}, "tasks": {"taskset": "t", "group_size": 1}}


def test_pyproject_registers_exactly_the_builtins():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared == {group.value: table for group, table in plugins.BUILTINS.items() if table}
    for group, table in plugins.BUILTINS.items():
        for name in table:
            assert plugins.load(group, name) is not None  # every target imports


def test_builtins_are_found_by_name_and_unknown_names_list_what_is_installed():
    assert {"code", "math", "shell"} <= set(plugins.names("temper.environments"))
    assert make_environment("shell", {"id": "t", "prompt": "p"}).kind == "shell"
    with pytest.raises(UnknownEnvironment) as err:
        make_environment("chess", {"id": "t", "prompt": "p"})
    assert (
        "unknown environment kind 'chess'; installed: agent (temper), code (temper), math (temper), shell (temper)"
        in str(err.value)
    )
    with pytest.raises(SpecError) as spec_err:
        parse_spec({**BASE, "environment": {"kind": "shel"}, "rewards": {"test_passed": 1.0}})
    fields = dict(spec_err.value.errors)
    assert "did you mean 'shell'?" in fields["environment.kind"]
    assert (
        "installed: " in fields["rewards.test_passed"]
        and "tests_passed (temper)" in fields["rewards.test_passed"]
    )


def test_an_installed_distribution_adds_an_environment_and_a_reward(tmp_path):
    with on_path(tmp_path / "site", "temper_wordcount"):
        dist = project_dist(tmp_path / "site", WORDCOUNT)
        assert dist == "temper-wordcount"
        assert "wordcount" in plugins.names("temper.environments")
        spec = parse_spec({**BASE, "environment": {"kind": "wordcount"}, "rewards": {"close_count": 1.0}})
        env = make_environment(spec.environment.kind, {"id": "t", "prompt": "How many words?"})
        assert env.parse("```sh\nwc -w text.txt\n```", turn=0).command == {
            "kind": "run_command",
            "command": "wc -w text.txt\n",
        }
        assert env.parse("ANSWER: 7", turn=1).answer == "7"
        with pytest.raises(SpecError, match=r"wordcount \(temper-wordcount\)"):
            parse_spec({**BASE, "environment": {"kind": "wordcunt"}})
    # gone from the path, gone from the registry
    assert "wordcount" not in plugins.names("temper.environments")


def test_two_distributions_claiming_one_name_and_a_broken_plugin_are_named(tmp_path):
    site = tmp_path / "site"
    with on_path(site, "pa", "pb", "broken"):
        write_dist(site, "plugin-a", {"pa": "X = 1\n"}, {"temper.rewards": {"dup": "pa:X"}})
        write_dist(site, "plugin-b", {"pb": "X = 2\n"}, {"temper.rewards": {"dup": "pb:X"}})
        write_dist(site, "plugin-c", {"broken": "raise ImportError('no numpy here')\n"},
                   {"temper.environments": {"broken": "broken:Env", "notenv": "pa:X"}})  # fmt: skip
        with pytest.raises(
            plugins.PluginConflict,
            match=r"'dup' is registered differently by plugin-a \(pa:X\), plugin-b \(pb:X\)",
        ):
            plugins.load("temper.rewards", "dup")
        with pytest.raises(
            UnknownEnvironment,
            match=r"'broken' \(plugin-c: broken:Env\) failed to load: ImportError: no numpy",
        ):
            make_environment("broken", {"id": "t", "prompt": "p"})
        with pytest.raises(
            UnknownEnvironment, match=r"environment 'notenv' names 1, which is not a temper.envs.Environment"
        ):
            make_environment("notenv", {"id": "t", "prompt": "p"})


def _ctx(answer: str | None = "7") -> ScoreContext:
    task = TaskSpec(id="m", kind="math", prompt="?", answer="8")
    return ScoreContext(task=task, submission=Submission(answer=answer), runner=None)  # type: ignore[arg-type]


async def test_reward_functions_that_return_garbage_or_raise_are_that_components_error():
    def garbage(ctx):
        return {"value": "lots"}

    def raises(ctx):
        raise RuntimeError("bad plugin")

    async def fine(ctx):
        return 0.25

    def skips(ctx):
        raise Skip("nothing to measure")

    assert (await component_of("fine", fine).compute(_ctx())).value == 0.25
    bad = await component_of("garbage", garbage).compute(_ctx())
    assert not bad.ok and "returned {'value': 'lots'}, not a finite number" in bad.reason
    boom = await FunctionComponent("raises", raises).compute(_ctx())
    assert not boom.ok and boom.reason == "reward 'raises' raised RuntimeError: bad plugin"
    skipped = await component_of("skips", skips).compute(_ctx())
    assert not skipped.ok and skipped.reason == "nothing to measure"
    nan = await component_of("nan", lambda ctx: float("nan")).compute(_ctx())
    assert not nan.ok
    with pytest.raises(NotAComponent):
        component_of("str", "not callable")


def test_a_parser_plugin_reads_tool_calls_for_any_environment(tmp_path):
    source = (
        "def parse(text):\n"
        "    if not text.startswith('CALL '):\n"
        "        return []\n"
        "    name, _, arg = text[5:].partition(' ')\n"
        "    return [{'name': name, 'arguments': {'command': arg}}]\n"
        "def broken(text):\n"
        "    return 'nope'\n"
    )
    site = tmp_path / "site"
    with on_path(site, "callparser"):
        write_dist(site, "callparser", {"callparser": source},
                   {"temper.parsers": {"call": "callparser:parse", "broken": "callparser:broken"}})  # fmt: skip
        spec = parse_spec({**BASE, "environment": {"kind": "shell", "action_format": "call"}})
        env = make_environment(
            "shell", {"id": "t", "prompt": "p"}, action_format=spec.environment.action_format
        )
        assert env.calls_functions and env.tool_schemas()  # tools reach the chat template
        assert env.parse("CALL bash ls -la", turn=0).command == {"kind": "run_command", "command": "ls -la"}
        undeclared = env.parse("CALL python print(1)", turn=0)
        assert undeclared.kind == "invalid" and "unknown tool 'python'; available: bash, submit" in (
            undeclared.error or ""
        )
        with pytest.raises(ToolCallError, match="returned str, not a list of calls"):
            parse_calls("x", "broken")


def test_the_walkthrough_shows_the_tested_example(tmp_path):
    doc = (ROOT / "docs" / "environments.md").read_text()
    python = doc.split("```python\n", 1)[1].split("```\n", 1)[0]
    assert python == (WORDCOUNT / "temper_wordcount.py").read_text()
    toml = doc.split("```toml\n", 1)[1].split("```\n", 1)[0]
    assert toml in (WORDCOUNT / "pyproject.toml").read_text()
    with on_path(tmp_path / "site", "temper_wordcount"):
        project_dist(tmp_path / "site", WORDCOUNT)
        with pytest.raises(SpecError) as err:
            parse_spec({**BASE, "environment": {"kind": "wordcunt"}})
    said = " ".join(" ".join(doc.split("- A name nobody registered")[1].split("\n- ")[0].split()).split())
    assert str(err.value) in said.replace("`", ""), (str(err.value), said)


def test_another_distribution_cannot_take_over_a_builtin_name(tmp_path):
    site = tmp_path / "site"
    with on_path(site, "evil"):
        write_dist(site, "evil", {"evil": "X = 1\n"}, {"temper.environments": {"code": "evil:X"}})
        with pytest.raises(
            UnknownEnvironment,
            match=r"'code' is registered differently by temper \(temper.envs.code:CodeEnvironment\), evil \(evil:X\)",
        ):
            make_environment("code", {"id": "t", "prompt": "p"})


def test_temper_admin_plugins_lists_what_is_installed(tmp_path, capsys):
    from temper.cli import main

    with on_path(tmp_path / "site", "temper_wordcount"):
        project_dist(tmp_path / "site", WORDCOUNT)
        assert main(["admin", "plugins"]) == 0
        text = capsys.readouterr().out
        assert main(["admin", "plugins", "--json"]) == 0
        table = json.loads(capsys.readouterr().out)
    assert "temper.environments\n  agent " in text and "temper.envs.code:CodeEnvironment" in text
    assert table["temper.environments"]["wordcount"] == {
        "dist": "temper-wordcount",
        "target": "temper_wordcount:WordCountEnvironment",
    }
    assert table["temper.rewards"]["close_count"]["dist"] == "temper-wordcount"
    assert set(table["temper.parsers"]) == {
        "hermes",
        "llama3_json",
        "mistral",
        "pythonic",
        "tool_code",
        "qwen3_coder",
    }
    assert table["temper.tools"] == {}


def test_a_tool_plugin_is_named_in_a_spec_and_runs_as_its_command(tmp_path):
    tool = (
        "TOOL = {'function': {'name': 'count_words', 'description': 'Count the words of a file.',\n"
        "        'parameters': {'type': 'object', 'properties': {'path': {'type': 'string'}}, 'required': ['path']}},\n"
        "        'command': 'wc -w {path}'}\n"
    )
    site = tmp_path / "site"
    tools = [{"function": {"name": "count_words"}}, {"function": {"name": "submit"}}]
    with on_path(site, "wc_tool"):
        write_dist(site, "wc-tool", {"wc_tool": tool}, {"temper.tools": {"count_words": "wc_tool:TOOL"}})
        spec = parse_spec(
            {**BASE, "environment": {"kind": "shell", "action_format": "hermes", "tools": tools}}
        )
        bound = spec.environment.tools[0]
        assert bound.command == "wc -w {path}" and bound.function.description == "Count the words of a file."
        env = make_environment(
            "shell", {"id": "t", "prompt": "p"}, action_format="hermes", tools=spec.environment.tools
        )
        call = '<tool_call>{"name": "count_words", "arguments": {"path": "my file.txt"}}</tool_call>'
        assert env.parse(call, turn=0).command == {"kind": "run_command", "command": "wc -w 'my file.txt'"}
        with pytest.raises(
            SpecError,
            match=r"or a temper.tools plugin of that name \(unknown tool 'count_word'; installed: count_words \(wc-tool\); did you mean 'count_words'\?\)",
        ):
            parse_spec({**BASE, "environment": {"tools": [{"function": {"name": "count_word"}}]}})
    # stored with its command, the spec no longer needs the plugin
    again = parse_spec(spec.model_dump(mode="json"))
    assert again.environment.tools and again.environment.tools[0].command == "wc -w {path}"
