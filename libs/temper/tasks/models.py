"""The task format: one task per JSONL line (or a YAML list), validated by pydantic.

A task is what an episode works on: a prompt, the files the agent starts with, the
hidden tests and reference solution that the reward scorer and the validation
pipeline use, or the expected answer of a math problem. docs/tasks-and-rewards.md
documents every field.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from enum import StrEnum
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from temper.limits import LanguageName, SandboxLimits
from temper.tasks.chat import ChatMessage, ChatTool, check_conversation, check_preference, prompt_of

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:=-]{0,150}$")


MAX_PROMPT_CHARS = 1 << 20  # one task's prompt; a task set upload is limited as a whole too

# Where a code task's agent writes its code when the task names no solution_file.
SOLUTION_FILES = {
    LanguageName.python: "solution.py",
    LanguageName.bash: "solution.sh",
    LanguageName.c: "solution.c",
    LanguageName.cpp: "solution.cpp",
    LanguageName.java: "Solution.java",
    LanguageName.go: "solution.go",
    LanguageName.rust: "solution.rs",
    LanguageName.nodejs: "solution.js",
    LanguageName.typescript: "solution.ts",
}


class TaskKind(StrEnum):
    code = "code"  # write code; hidden tests in its language run against it
    math = "math"  # give an answer; it is compared with the known one
    shell = "shell"  # act on a workspace with commands; hidden Python tests check the result
    chat = "chat"  # a conversation to learn from (sft jobs): messages, optional tools; no tests
    # a preferred and a dispreferred continuation of one conversation (reward_model and dpo jobs)
    preference = "preference"


class TaskStatus(StrEnum):
    pending = "pending"  # not validated yet (sampled, like a valid task)
    valid = "valid"
    invalid = "invalid"  # never sampled; status_reasons say why


class TaskMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    source: str = ""
    tags: list[str] = []
    difficulty: float | None = Field(None, ge=0, le=1, description="an author's estimate, 0 easy .. 1 hard")
    tolerance: float | None = Field(None, ge=0, description="math: relative tolerance of answer_match")


class TaskSpec(BaseModel):
    """One task as written in a task-set file."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(description="unique within the task set: letters, digits and . _ / : = -")
    kind: TaskKind = TaskKind.code
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    files: dict[str, str] = Field(default_factory=dict, description="starting files: path -> content")
    language: LanguageName = Field(
        LanguageName.python,
        description="code: the language of the solution and of its hidden tests (SandboxFusion's names)",
    )
    tests: str | None = Field(
        None,
        description="hidden tests: Python (check(candidate), test_* functions or asserts), or "
        "assert-style statements in the task's language",
    )
    entry_point: str | None = Field(
        None, description="the function under test; Python tests get it as `candidate`"
    )
    solution: str | None = Field(
        None, description="reference solution: the content of solution_file (math: worked answer)"
    )
    solution_file: str = Field(
        "solution.py",
        description="where the agent's code is expected (default: solution.<the language's suffix>)",
    )
    oracle: str | None = Field(
        None, description="shell: a bash script that solves the task in the workspace (Harbor's solution.sh)"
    )
    answer: str | None = Field(None, description="math: the expected final answer")
    messages: list[ChatMessage] | None = Field(
        None, description="chat: the conversation (OpenAI chat format; train or weight per assistant turn)"
    )
    tools: list[ChatTool] | None = Field(
        None, description="chat, preference: OpenAI function schemas the template shows"
    )
    chosen: list[ChatMessage] | None = Field(
        None, description="preference: the preferred continuation of messages (its assistant turns)"
    )
    rejected: list[ChatMessage] | None = Field(
        None, description="preference: the dispreferred continuation of messages"
    )
    metadata: TaskMeta = TaskMeta()
    limits: SandboxLimits | None = Field(
        None, description="sandbox limits for this task's episodes and scoring"
    )

    @model_validator(mode="before")
    @classmethod
    def _language_file(cls, data: Any) -> Any:
        # a task in another language expects its code in solution.<suffix> unless it says
        if (
            isinstance(data, dict)
            and "solution_file" not in data
            and data.get("language") not in (None, "python")
        ):
            try:
                data = {**data, "solution_file": SOLUTION_FILES[LanguageName(data["language"])]}
            except ValueError:
                pass  # the field's own error names the language
        return data

    @model_validator(mode="before")
    @classmethod
    def _chat_prompt(cls, data: Any) -> Any:
        # a conversation's prompt (what listings show) is its first user message
        conversational = (TaskKind.chat.value, TaskKind.preference.value)
        if isinstance(data, dict) and data.get("kind") in conversational and not data.get("prompt"):
            messages = data.get("messages") or data.get("chosen")
            if isinstance(messages, list) and messages:
                try:
                    data = {**data, "prompt": prompt_of([ChatMessage.model_validate(m) for m in messages])}
                except (ValueError, TypeError):
                    data = {**data, "prompt": "(conversation)"}  # the field errors come from messages
        return data

    @field_validator("id")
    @classmethod
    def _key(cls, v: str) -> str:
        if not _KEY.match(v):
            raise ValueError(
                "use 1-151 characters: letters, digits and . _ / : = - (starting with a letter or digit)"
            )
        return v

    @field_validator("files")
    @classmethod
    def _paths(cls, files: dict[str, str]) -> dict[str, str]:
        for path in files:
            parts = path.split("/")
            if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"file path {path!r} must be relative and stay inside the workspace")
        return files

    @model_validator(mode="after")
    def _complete(self) -> TaskSpec:
        chat_only = [f for f in ("tools",) if getattr(self, f) is not None]
        if self.kind in (TaskKind.chat, TaskKind.preference):
            if self.kind is TaskKind.chat:
                if self.messages is None:
                    raise ValueError("a chat task needs messages")
                if self.chosen is not None or self.rejected is not None:
                    raise ValueError("chosen and rejected apply to preference tasks only (this one is chat)")
                check_conversation(self.messages)
            else:
                self.messages, self.chosen, self.rejected = check_preference(
                    self.messages, self.chosen, self.rejected
                )
            given = [f for f in ("tests", "solution", "oracle", "answer", "entry_point") if getattr(self, f)]
            if given or self.files:
                raise ValueError(f"a {self.kind} task has no {', '.join(given or ['files'])} (it is not run)")
            return self
        if self.chosen is not None or self.rejected is not None:
            raise ValueError(f"chosen and rejected apply to preference tasks only (this one is {self.kind})")
        if self.messages is not None or chat_only:
            raise ValueError(f"messages and tools apply to chat tasks only (this one is {self.kind})")
        if self.language is not LanguageName.python:
            if self.kind is not TaskKind.code:
                raise ValueError(
                    f"language applies to code tasks only (a {self.kind} task's checks are Python)"
                )
            if self.entry_point:
                raise ValueError(
                    f"entry_point binds `candidate` in Python tests only; {self.language} tests name "
                    "the function themselves"
                )
        if self.kind is TaskKind.math:
            if not (self.answer and self.answer.strip()):
                raise ValueError("a math task needs an answer")
        elif not (self.tests and self.tests.strip()):
            raise ValueError(f"a {self.kind} task needs hidden tests")
        return self

    # --- hashes used for duplicate detection ------------------------------------------
    @property
    def prompt_hash(self) -> str:
        if self.kind in (TaskKind.chat, TaskKind.preference):  # a duplicate is the same one, whole
            return sha256(f"{self.kind}:" + json.dumps(self.spec_dict(), sort_keys=True))
        return sha256(normalise_prompt(self.prompt))

    @property
    def tests_hash(self) -> str:
        if self.kind in (TaskKind.chat, TaskKind.preference):
            return ""
        if self.kind is TaskKind.math:
            return sha256("answer:" + (self.answer or "").strip())
        return sha256(normalise_code(self.tests or "") + "\0" + (self.entry_point or ""))

    def spec_dict(self) -> dict[str, Any]:
        """What the tasks table keeps in ``spec`` (everything but id, kind, prompt, metadata;
        the language only when it is not Python, so a Python task's row is as it was)."""
        exclude = {"id", "kind", "prompt", "metadata"}
        if self.language is LanguageName.python:
            exclude.add("language")
        return self.model_dump(mode="json", exclude=exclude)

    @classmethod
    def from_row(
        cls, key: str, kind: str, prompt: str, spec: dict[str, Any], meta: dict[str, Any]
    ) -> TaskSpec:
        return cls.model_validate({"id": key, "kind": kind, "prompt": prompt, "metadata": meta, **spec})


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def normalise_prompt(prompt: str) -> str:
    """Case, Unicode compatibility forms and whitespace normalised: two prompts that differ
    only in those are duplicates. Punctuation is kept — in code prompts it is meaning
    (HumanEval/56 and /61 differ only in ``<>`` versus ``()``)."""
    text = unicodedata.normalize("NFKC", prompt).casefold()
    return " ".join(text.split())


def normalise_code(code: str) -> str:
    """Comments, blank lines and trailing spaces removed."""
    lines = []
    for line in code.splitlines():
        stripped = re.sub(r"\s+#.*$|^\s*#.*$", "", line).rstrip()
        if stripped:
            lines.append(stripped)
    return "\n".join(lines)


# --- parsing -------------------------------------------------------------------------


class TaskFormatError(ValueError):
    """A task-set file that does not validate. ``errors`` lists (line, field, message);
    line is the 1-based line of the JSONL file (YAML: of the list item)."""

    def __init__(self, errors: list[tuple[int, str, str]]) -> None:
        self.errors = errors
        shown = "; ".join(f"line {line}: {field}: {msg}" for line, field, msg in errors[:20])
        more = f" (and {len(errors) - 20} more)" if len(errors) > 20 else ""
        super().__init__(shown + more)


def _field_errors(line: int, exc: ValidationError) -> list[tuple[int, str, str]]:
    out = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(task)"
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        out.append((line, field, msg))
    return out


def parse_tasks(data: str | bytes, *, filename: str = "") -> list[TaskSpec]:
    """Parse a task-set file: JSONL (one task per line) or YAML (a list of tasks, or a
    mapping with ``tasks:``). Every bad line is reported, not only the first."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    is_yaml = filename.endswith((".yaml", ".yml")) or (
        not filename.endswith(".jsonl") and _looks_like_yaml(text)
    )
    items = _yaml_items(text) if is_yaml else _jsonl_items(text)
    errors: list[tuple[int, str, str]] = []
    tasks: list[TaskSpec] = []
    seen: dict[str, int] = {}
    for line, raw in items:
        if isinstance(raw, str):  # a parse error of that line
            errors.append((line, "(line)", raw))
            continue
        if not isinstance(raw, dict):
            errors.append((line, "(task)", "a task must be a JSON object"))
            continue
        if "chosen" in raw and "rejected" in raw and "kind" not in raw:  # a preference pair
            raw = {"kind": TaskKind.preference.value, **raw}
        elif "messages" in raw and "kind" not in raw:  # an OpenAI fine-tuning line
            raw = {"kind": TaskKind.chat.value, **raw}
        if raw.get("kind") in (TaskKind.chat.value, TaskKind.preference.value) and "id" not in raw:
            raw = {"id": f"line-{line}", **raw}
        try:
            task = TaskSpec.model_validate(raw)
        except ValidationError as exc:
            errors.extend(_field_errors(line, exc))
            continue
        if task.id in seen:
            errors.append((line, "id", f"duplicate id {task.id!r} (first on line {seen[task.id]})"))
            continue
        seen[task.id] = line
        tasks.append(task)
    if not items:
        errors.append((1, "(file)", "no tasks found"))
    if errors:
        raise TaskFormatError(errors)
    return tasks


def _looks_like_yaml(text: str) -> bool:
    first = next(
        (ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), ""
    )
    return not first.startswith("{")


def _jsonl_items(text: str) -> list[tuple[int, Any]]:
    items: list[tuple[int, Any]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append((n, json.loads(line)))
        except json.JSONDecodeError as exc:
            items.append((n, f"not valid JSON: {exc.msg} (column {exc.colno})"))
    return items


def _yaml_items(text: str) -> list[tuple[int, Any]]:
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        return [((mark.line + 1) if mark else 1, f"not valid YAML: {getattr(exc, 'problem', exc)}")]
    if root is None:
        return []
    if isinstance(root, yaml.MappingNode):
        for k, v in root.value:
            if k.value == "tasks":
                root = v
                break
        else:
            return [
                (root.start_mark.line + 1, "a YAML task set is a list of tasks or a mapping with 'tasks:'")
            ]
    if not isinstance(root, yaml.SequenceNode):
        return [(root.start_mark.line + 1, "a YAML task set is a list of tasks")]
    loader_items = yaml.safe_load(text)
    values = loader_items["tasks"] if isinstance(loader_items, dict) else loader_items
    return [(node.start_mark.line + 1, value) for node, value in zip(root.value, values, strict=True)]


def dump_jsonl(tasks: list[TaskSpec]) -> str:
    return "".join(t.model_dump_json(exclude_none=True) + "\n" for t in tasks)
