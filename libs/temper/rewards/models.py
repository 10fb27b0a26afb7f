"""Schemas of the reward side: component names, what an agent submitted, and the
outcome of one run of the hidden tests."""

from __future__ import annotations

import posixpath
import re
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from temper.limits import LanguageName
from temper.rewards.polyglot import FENCE_NAMES


class ComponentName(StrEnum):
    tests_passed = "tests_passed"  # fraction of hidden tests passed
    compiles = "compiles"  # 1 if every submitted Python file compiles
    coverage = "coverage"  # line and branch coverage of the agent's code under the hidden tests
    efficiency = "efficiency"  # reference run time / agent run time, bounded to [0, 1]
    answer_match = "answer_match"  # math: the final answer equals the known one
    format = "format"  # type: ignore[assignment]  # the agent followed the action format (shadows str.format)
    turn_penalty = (
        "turn_penalty"  # share of the turn budget used beyond the first turn (weight it negatively)
    )
    reward_model = "reward_model"  # a reward model's score of the episode's transcript
    judge = "judge"  # a language model's verdict on the transcript against a rubric (RLAIF)


class Submission(BaseModel):
    """What the dispatcher sends in ``RewardRequest.submission``: the agent's workspace
    files (path -> text), its final answer if it gave one, and its last message."""

    model_config = ConfigDict(extra="allow")
    files: dict[str, str] = Field(default_factory=dict)
    answer: str | None = None
    text: str = ""

    def code_for(self, solution_file: str, language: LanguageName = LanguageName.python) -> str | None:
        """The agent's code for ``solution_file``: that file, else the only file it wrote with
        that file's suffix, else the last fenced block of its final message labelled with the
        language (```python, ```cpp …) or not labelled."""
        if solution_file in self.files:
            return self.files[solution_file]
        suffix = posixpath.splitext(solution_file)[1] or ".py"
        same = [p for p in self.files if p.endswith(suffix)]
        if len(same) == 1:
            return self.files[same[0]]
        names = "|".join(re.escape(name) for name in FENCE_NAMES[language])
        blocks = re.findall(rf"```(?:{names})?[ \t]*\n(.*?)```", self.text, re.S | re.I)
        return blocks[-1] if blocks else None


class TestOutcome(BaseModel):
    __test__ = False  # not a pytest test class
    name: str
    passed: bool
    message: str | None = None
    seconds: float = 0.0


class CandidateRun(BaseModel):
    """One solution run against the hidden tests in a sandbox."""

    label: str
    started: bool = False  # the harness reported compiling and loading it
    compile_error: str | None = None
    load_error: str | None = None
    tests: list[TestOutcome] = []
    best_s: float | None = None  # fastest full pass over the tests (efficiency)
    kill_reason: str | None = None  # the sandbox killed the run
    wall_s: float = 0.0

    @property
    def passed(self) -> int:
        return sum(t.passed for t in self.tests)

    @property
    def fraction(self) -> float:
        return self.passed / len(self.tests) if self.tests else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.tests) and all(t.passed for t in self.tests)

    def first_failure(self) -> str | None:
        if self.compile_error:
            return f"does not compile: {self.compile_error}"
        if self.load_error:
            return f"fails to load: {self.load_error}"
        for t in self.tests:
            if not t.passed:
                return f"{t.name}: {t.message}"
        return None


MAX_SNAPSHOT_FILE_BYTES = 1 << 20
MAX_SNAPSHOT_TOTAL_BYTES = 16 << 20
MAX_SNAPSHOT_FILES = 2000


def files_from_snapshot(data: bytes) -> dict[str, str]:
    """The text files of a workspace snapshot (gzip'd tar), read in memory: regular files
    only, relative paths that stay inside, at most 1 MiB each and 16 MiB in all; binary
    files are skipped. Nothing is extracted to disk and nothing is run."""
    import io
    import posixpath
    import tarfile

    files: dict[str, str] = {}
    total = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar:
            if len(files) >= MAX_SNAPSHOT_FILES:
                break
            if not member.isreg() or member.size > MAX_SNAPSHOT_FILE_BYTES:
                continue
            path = posixpath.normpath(member.name.lstrip("./") or member.name)
            if path.startswith(("/", "..")) or path in (".", ""):
                continue
            total += member.size
            if total > MAX_SNAPSHOT_TOTAL_BYTES:
                break
            handle = tar.extractfile(member)
            if handle is None:
                continue
            try:
                files[path] = handle.read(member.size).decode("utf-8")
            except UnicodeDecodeError:
                continue
    return files


async def load_submission(raw: dict[str, object], store: object | None = None) -> Submission:
    """A :class:`Submission` from ``RewardRequest.submission`` as the environments send it:
    ``files``/``answer``/``text``, or ``final_text`` and a workspace ``snapshot_key`` whose
    text files are read from the object store (explicit ``files`` win)."""
    data = dict(raw)
    text = data.pop("text", None) or data.get("final_text") or ""
    sub = Submission.model_validate({**data, "text": text})
    key = data.get("snapshot_key")
    if key and store is not None:
        snapshot = await store.get(str(key))  # type: ignore[attr-defined]
        sub.files = {**files_from_snapshot(snapshot), **sub.files}
    return sub
