"""The environment.yaml manifest and the package archive: what is accepted, and errors
that name the field and its line."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from temper.envpkg.archive import PackageError, pack, read_package
from temper.envpkg.grader import GradeFailed, read_components
from temper.envpkg.models import ManifestError, parse_manifest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "environments" / "wordcount-pkg"
GOOD = (EXAMPLE / "environment.yaml").read_text()


def errors_of(text: str) -> list[tuple[str, int | None, str]]:
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    return info.value.errors


def test_the_example_manifest_validates_and_splits_public_from_hidden_files() -> None:
    files = {str(p.relative_to(EXAMPLE)): p.read_text() for p in EXAMPLE.rglob("*") if p.is_file()}
    pkg = read_package(pack(files))
    assert pkg.manifest.rubric == {"correct": 1.0, "used_tool": 0.25}
    assert sorted(pkg.hidden) == ["expected.json", "grade.py"]
    assert "environment.yaml" not in pkg.public and not any(p.startswith("hidden/") for p in pkg.public)


def test_a_bad_field_is_named_with_its_line() -> None:
    bad = GOOD.replace("command: python3 tools/count.py {path}", "command: python3 tools/count.py {file}")
    line = next(i for i, ln in enumerate(bad.splitlines(), 1) if "{file}" in ln)
    (field, at, message), *_ = errors_of(bad)
    assert field == "tools.0" and "placeholder {file}" in message
    assert at is not None and at <= line  # the tool's entry, which holds the bad command
    [(field, at, message)] = errors_of(GOOD.replace("max_turns: 4", "max_turns: 0"))
    assert (field, at) == (
        "max_turns",
        GOOD.splitlines().index("max_turns: 4") + 1,
    ) and "greater than or equal to 1" in message


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        (("network: none", "network: host"), "network", "allowed: none, loopback, allowlist"),
        (("network: none", "network: allowlist"), "network", "needs at least one host:port in allow"),
        (("action_format: hermes", "action_format: code_block"), "action_format", "function-calling format"),
        (("action_format: hermes", "action_format: hermez"), "action_format", "hermes"),
        (("limits: {wall_s: 10, cpu_s: 10}", "limits: {network: true}"), "limits", "top-level 'network'"),
        (("limits: {wall_s: 10, cpu_s: 10}", "limits: {wall_s: -1}"), "limits", "wall_s"),
        (("  correct: 1.0\n", "  correct: lots\n"), "rubric.correct", "valid number"),
        (("grade: python3 hidden/grade.py\n", ""), "grade", "Field required"),
        (("version: 1.0.0", "version: ../x"), "version", "pattern"),
        (("name: wordcount-pkg", "name: wordcount-pkg\nsandbox: docker"), "sandbox", "Extra inputs"),
    ],
)
def test_refused_values_say_why(change: tuple[str, str], field: str, says: str) -> None:
    errors = errors_of(GOOD.replace(*change))
    assert any(f == field and says in m for f, _, m in errors), errors
    assert all(line is not None for _, line, _ in errors)


def test_yaml_that_does_not_parse_names_its_line() -> None:
    [(field, line, message)] = errors_of("name: x\nversion: [1\n")
    assert field == "(document)" and line is not None and "not valid YAML" in message


def _tar(add) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        add(tar)
    return out.getvalue()


def test_unsafe_or_binary_archives_are_refused() -> None:
    def link(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("evil")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)

    def escape(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("../up.txt")
        tar.addfile(info, io.BytesIO(b""))

    def binary(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("blob.bin")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"\xff\xfe"))

    for add, says in ((link, "regular files"), (escape, "inside the package"), (binary, "not UTF-8")):
        with pytest.raises(PackageError, match=says):
            read_package(_tar(add))
    with pytest.raises(PackageError, match="not a gzip'd tar"):
        read_package(b"plain bytes")
    with pytest.raises(ManifestError, match="no environment.yaml"):
        read_package(pack({"tools/x.py": "print(1)\n"}))


@pytest.mark.parametrize(
    ("stdout", "says"),
    [
        ("", "printed nothing"),
        ("ok\n", "not JSON"),
        ("[1, 2]\n", "not a JSON object"),
        ('{"correct": 1}\n', "missing ['used_tool']"),
        ('{"correct": 1, "used_tool": 0, "bonus": 1}\n', "not in the rubric ['bonus']"),
        ('{"correct": true, "used_tool": 0}\n', "not a finite number"),
        ('{"correct": NaN, "used_tool": 0}\n', "not a finite number"),
    ],
)
def test_grader_output_must_be_the_rubrics_numbers(stdout: str, says: str) -> None:
    with pytest.raises(GradeFailed, match=re_escape(says)):
        read_components(stdout, {"correct": 1.0, "used_tool": 0.25})


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_grader_output_may_log_before_its_last_line() -> None:
    assert read_components(
        'checking...\n{"correct": 1, "used_tool": 0.5}\n\n', {"correct": 1, "used_tool": 1}
    ) == {
        "correct": 1.0,
        "used_tool": 0.5,
    }


def test_the_walkthrough_shows_the_tested_package_and_its_error() -> None:
    doc = (EXAMPLE.parents[2] / "docs" / "environments.md").read_text().split("## Tenant packages", 1)[1]
    assert doc.split("```yaml\n", 1)[1].split("```\n", 1)[0] == GOOD
    assert (
        doc.split("```python\n", 1)[1].split("```\n", 1)[0] == (EXAMPLE / "hidden" / "grade.py").read_text()
    )
    [(field, line, message)] = errors_of(GOOD.replace("network: none", "network: host"))
    said = " ".join(doc.split("- A manifest that does not validate")[1].split("\n- ")[0].split())
    assert f"invalid environment.yaml: {field} (line {line}): {message}"[:80] in said.replace("`", "")


async def test_a_pinned_package_environment_shows_the_agent_only_public_files(tmp_path) -> None:
    from temper.envpkg import service
    from temper.envs import make_environment
    from temper.jobspec import JobSpec, SpecError
    from temper.storage import LocalStore

    store = LocalStore(tmp_path)
    files = {str(p.relative_to(EXAMPLE)): p.read_text() for p in EXAMPLE.rglob("*") if p.is_file()}
    await service.upload(store, tenant_id="acme", data=pack(files))
    base = {"name": "j", "policy": {"model": "tiny"}, "tasks": {"taskset": "ts"},
            "environment": {"kind": "package", "name": "wordcount-pkg", "version": "1.0.0"}}  # fmt: skip
    spec = JobSpec.model_validate(base)
    await service.pin(store, tenant_id="acme", spec=spec)
    assert spec.rewards == {"correct": 1.0, "used_tool": 0.25} and spec.environment.action_format == "hermes"
    with pytest.raises(SpecError, match="no environment package 'wordcount-pkg'"):
        await service.pin(store, tenant_id="other", spec=JobSpec.model_validate(base))

    env_spec = spec.environment
    task = {"id": "fox", "kind": "math", "prompt": "How many words?", "spec": {"files": {"text.txt": "a b"}}}
    env = make_environment("package", task, max_turns=env_spec.max_turns, action_format=env_spec.action_format,
                           tools=env_spec.tools, package=env_spec.package)  # fmt: skip
    start = env.setup_files()
    assert {"text.txt", "tools/count.py", "tools/setup.py"} <= set(start)
    assert not any("hidden" in p or "expected" in p or p == "environment.yaml" for p in start)
    assert env.setup_actions() == [{"kind": "run_command", "command": "python3 tools/setup.py"}]
    system, user = env.first_messages()
    assert "sandboxed workspace" in system["content"] and user["content"].startswith(
        "How many words?\nRecord"
    )
    action = env.parse(
        '<tool_call>{"name": "count_words", "arguments": {"path": "a b.txt"}}</tool_call>', turn=0
    )
    assert action.command == {"kind": "run_command", "command": "python3 tools/count.py 'a b.txt'"}
    action = env.parse('<tool_call>{"name": "read_file", "arguments": {"path": "x"}}</tool_call>', turn=0)
    assert action.kind == "invalid" and "unknown tool 'read_file'" in (action.error or "")
    sub = env.submission(None, final_text="", snapshot_key="snap", session_id="s")
    assert sub["kind"] == "package" and sub["package"]["key"].startswith("tenants/acme/environments/")
