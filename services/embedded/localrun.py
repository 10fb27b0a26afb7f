"""What ``temper run`` reads beside the job spec: the ``local:`` block of the YAML file.

A job spec submitted over REST names a task set already uploaded; a local run names a
task-set file, and may ask for a supervised warm start of a freshly created policy::

    local:
      taskset_file: tasksets/offset.jsonl            # relative to the spec file
      preset: tiny                                   # policy created from this config
      # or, instead of preset: a real architecture with a BPE tokenizer trained now
      # build: {architecture: qwen2, template: chatml, vocab_size: 512, hidden_size: 64, layers: 2}
      warm_start:
        generator: tasksets/make_offset_tasks.py:warm_start_examples
        examples: 16000
        steps: 1000
      held_out: {fraction: 0.25, seed: 0}            # tasks never trained on, for the job's evaluation
      before: [judge-sft.yaml]                       # jobs run first, to completion, in this run
      # environment.kind agent: the agent's files, and the sandbox image it runs on
      agent_dir: agent/                              # its files become environment.agent.files
      image: ~/.cache/temper/images/agent-bookworm.tar.gz   # published in the run's own store
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from temper.jobspec import JobSpec, SpecError, parse_spec
from temper.tasks.splits import HeldOut


class WarmStart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    generator: str = Field(
        description="FILE.py:FUNCTION(n, seed=) returning (task, reply) pairs; a task is a mapping with prompt and files"
    )
    examples: int = Field(16000, ge=1)
    steps: int = Field(1000, ge=1)
    batch_size: int = Field(16, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="AdamW's betas; 0.99 as the second helps a copy hidden among easy tokens"
    )
    seed: int = 0

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        return betas


class Build(BaseModel):
    """A model made in the run: a BPE tokenizer trained on the task prompts and the
    warm-start conversations, and a small random config of a real architecture."""

    model_config = ConfigDict(extra="forbid")
    architecture: str = Field("qwen2", description="qwen2 | qwen3 | llama | mistral | phi3")
    template: str = Field("chatml", description="chatml | llama3")
    vocab_size: int = Field(512, ge=300, le=65536)
    hidden_size: int = Field(64, ge=16)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1)


class LocalRun(BaseModel):
    model_config = ConfigDict(extra="forbid")
    taskset_file: Path
    preset: str = "tiny"
    build: Build | None = None
    seed: int = 0
    warm_start: WarmStart | None = None
    held_out: HeldOut | None = Field(
        None, description="split the task set at upload: {fraction, seed} or {field, values}"
    )
    before: list[Path] = Field(
        default_factory=list,
        description="spec files (each with its own local: block) of jobs run first, in this run, each to "
        "completion: e.g. an sft job that trains a judge, which this spec then names as job:<handle>@latest",
    )
    agent_dir: Path | None = Field(
        None, description="kind agent: a directory whose files become environment.agent.files"
    )
    image: Path | None = Field(
        None,
        description="a sandbox image file (temper images build-debian --output), published in the run's "
        "store as environment.limits.image",
    )
    engine: Literal["in_process", "process"] = Field(
        "in_process",
        description="where the policy's CPU engine runs: in the run's process, or in a child process "
        "(the CPU model server over the loopback), whose decoding then does not wait on the services "
        "for the interpreter's lock (services/embedded/engine_process.py)",
    )


def load(path: Path) -> tuple[JobSpec, LocalRun]:
    """The job spec and the local-run block of ``path``; errors name the field."""
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError([("(document)", f"not valid YAML: {exc}")]) from None
    if not isinstance(doc, dict):
        raise SpecError([("(document)", "the spec must be a mapping")])
    local_raw = doc.pop("local", None)
    if local_raw is None:
        raise SpecError(
            [("local", "temper run needs a local: block naming the task-set file (see docs/job-spec.md)")]
        )
    try:
        local = LocalRun.model_validate(local_raw)
    except ValidationError as exc:
        raise SpecError(
            [("local." + ".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()]
        ) from None
    local.taskset_file = (path.parent / local.taskset_file).resolve()
    local.before = [(path.parent / p).resolve() for p in local.before]
    if local.agent_dir is not None:
        local.agent_dir = (path.parent / local.agent_dir).resolve()
    if local.image is not None:
        local.image = (path.parent / local.image.expanduser()).resolve()
    model = (doc.get("policy") or {}).get("model")
    if isinstance(model, str) and (path.parent / model / "config.json").is_file():
        doc["policy"]["model"] = str((path.parent / model).resolve())  # a model directory beside the spec
    if local.warm_start:
        file, _, func = local.warm_start.generator.partition(":")
        local.warm_start.generator = f"{(path.parent / file).resolve()}:{func}"
    doc.setdefault("tasks", {}).setdefault("taskset", "local")  # replaced by the uploaded set's id
    init = (doc.get("policy") or {}).get("init")
    if isinstance(init, str) and init.startswith("job:"):
        raise SpecError(
            [("policy.init", "temper run holds no other job to start from; submit the job to temper serve")]
        )
    evaluation = doc.get("evaluation")
    if isinstance(evaluation, dict) and evaluation.get("taskset") is not None:
        raise SpecError(
            [
                (
                    "evaluation.taskset",
                    "temper run holds one task set (local.taskset_file): evaluate a split of it",
                )
            ]
        )
    return parse_spec(doc), local


def generator(spec: str) -> Callable[..., list[tuple[dict[str, Any], str]]]:
    """Import ``FILE.py:FUNCTION``."""
    file, _, name = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    if module_spec is None or module_spec.loader is None or not name:
        raise SpecError([("local.warm_start.generator", f"cannot import {spec!r}; use FILE.py:FUNCTION")])
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn: Any = getattr(module, name, None)
    if not callable(fn):
        raise SpecError([("local.warm_start.generator", f"{file} has no function {name!r}")])
    return fn  # type: ignore[no-any-return]
