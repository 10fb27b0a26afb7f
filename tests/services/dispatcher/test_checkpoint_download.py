"""Policy versions out of Temper as directories other tools load: ``temper checkpoints JOB
--download V -o DIR`` (REST streams a tar) gives a Hugging Face model directory for a
full-weight version, which ``transformers`` loads with the trained weights, and a PEFT
adapter directory for a LoRA version, which ``peft`` loads on its base; ``--with-base`` adds
the base; ``temper export-model --merge`` folds the adapter into the base. Versions are
published by the trainer's own code (``Learner.publish_version``) from a model built here."""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

from temper import registry
from temper.db import Database, Job, PolicyVersion
from temper.jobspec import LoraSpec
from temper.policy import load_causal_lm, token_logprobs
from temper.policy.build import build_model_dir, train_tokenizer
from temper.storage import LocalStore
from temper.training import Learner, LearnerConfig
from temper.training.lora import peft_quiet
from temper.trajectory import Segment, Trajectory
from tests.services.dispatcher.conftest import SPEC
from tests.services.dispatcher.test_dispatcher_cli import run_cli, server  # noqa: F401

pytestmark = pytest.mark.timeout(120)

LORA = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
PROBE = [5, 9, 13, 2, 7, 11]


def group(tok_ids: list[int]) -> list[Trajectory]:
    """Two samples of one prompt with different rewards: a step that moves the weights."""
    out = []
    for i, reward in enumerate((1.0, 0.0)):
        completion = [(t + i) % 40 + 3 for t in tok_ids]
        out.append(
            Trajectory(
                job_id="j",
                episode_id=f"e{i}",
                task_id="t",
                group_id="g",
                reward=reward,
                segments=[
                    Segment(role="prompt", token_ids=tok_ids),
                    Segment(role="model", token_ids=completion, logprobs=[-1.0] * len(completion)),
                ],
            )  # fmt: skip
        )
    return out


def logprobs(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return token_logprobs(model, torch.tensor([PROBE]))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    tok = train_tokenizer(["def add(a, b): return a + b", "the sum of two numbers"] * 20, vocab_size=300)
    d = tmp_path_factory.mktemp("base") / "model"
    return build_model_dir(d, "qwen2", tok, seed=3)


async def publish(env, base_dir: Path, job_id: str, lora: bool) -> Learner:
    """A job on ``base_dir`` with version 1 trained one step and published as the trainer does."""
    settings, _ = env
    cfg = LearnerConfig(learning_rate=5e-2, lora=LORA if lora else None)
    learner = Learner(load_causal_lm(base_dir), cfg, device="cpu")
    learner.step([group([4, 8, 15, 16])])
    store = LocalStore(settings.storage.root)
    from temper.policy import ChatTokenizer

    key = await learner.publish_version(
        store, registry.version_prefix("acme", job_id, 1), job_id=job_id, version=1,
        base_model=str(base_dir), tokenizer=ChatTokenizer.load(base_dir),
    )  # fmt: skip
    spec = {**SPEC, "policy": {**SPEC["policy"], "model": str(base_dir)}}
    db = Database(settings.db)
    try:
        async with db.session() as s:
            s.add(
                Job(id=job_id, tenant_id="acme", name=job_id, spec=spec, state="completed", policy_version=1)
            )
            await s.flush()
            s.add(PolicyVersion(job_id=job_id, version=1, checkpoint_key=key, step=1, metrics={}))
    finally:
        await db.dispose()
    return learner


def test_a_full_version_loads_in_transformers(server, env, base_dir, tmp_path, capsys):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, seeded = server
    learner = asyncio.run(publish(env, base_dir, "job-full", lora=False))
    out = tmp_path / "v1"
    code, _, err = run_cli(["--url", url, "--key", seeded.key, "checkpoints", "job-full", "--download", "1",
                            "-o", str(out)], capsys)  # fmt: skip
    assert code == 0 and "a Hugging Face model directory" in err, err
    assert {"config.json", "model.safetensors", "tokenizer.json", "manifest.json"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.allclose(logprobs(model), logprobs(learner.model), atol=1e-5)
    assert not torch.allclose(logprobs(model), logprobs(load_causal_lm(base_dir)), atol=1e-3), "it is trained"
    assert AutoTokenizer.from_pretrained(out).chat_template, "the chat template comes along"
    # a full version is a complete model: with_base is refused, not ignored
    code, _, err = run_cli(["--url", url, "--key", seeded.key, "checkpoints", "job-full", "--download", "1",
                            "-o", str(tmp_path / "again"), "--with-base"], capsys)  # fmt: skip
    assert code == 1 and "with_base applies to LoRA versions" in err


def test_a_lora_version_loads_in_peft_and_merges(server, env, base_dir, tmp_path, capsys):  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    url, seeded = server
    learner = asyncio.run(publish(env, base_dir, "job-lora", lora=True))
    trained = logprobs(learner.model)
    cli = ["--url", url, "--key", seeded.key]
    adapter = tmp_path / "adapter"
    code, _, err = run_cli([*cli, "checkpoints", "job-lora", "--download", "1", "-o", str(adapter)], capsys)
    assert code == 0 and f"a PEFT adapter directory for base model {base_dir}" in err, err
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert not (adapter / "base").exists()
    with peft_quiet():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter)
    assert torch.allclose(logprobs(peft_model), trained, atol=1e-5)

    both = tmp_path / "with-base"
    code, _, err = run_cli([*cli, "checkpoints", "job-lora", "--download", "1", "-o", str(both), "--with-base"],
                           capsys)  # fmt: skip
    assert code == 0 and "its base in base/" in err
    with peft_quiet():
        on_its_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(both / "base"), both)
    assert torch.allclose(logprobs(on_its_base), trained, atol=1e-5)

    merged = tmp_path / "merged"
    code, _, err = run_cli([*cli, "export-model", "job-lora", "1", str(merged), "--merge"], capsys)
    assert code == 0 and "merged into its base" in err, err
    assert not list(merged.glob("adapter_*")), "one plain model directory"
    assert torch.allclose(logprobs(AutoModelForCausalLM.from_pretrained(merged)), trained, atol=1e-4)


async def test_the_archive_is_checked_and_refuses_what_it_cannot_give(client, env, base_dir, tmp_path):
    settings, _ = env
    await publish(env, base_dir, "job-lora", lora=True)
    r = await client.get("/v1/jobs/job-lora/checkpoints/1")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    assert r.headers["x-temper-version-kind"] == "lora"
    names = tarfile.open(fileobj=io.BytesIO(r.content)).getnames()
    assert names[0] == "manifest.json" and "adapter_model.safetensors" in names
    assert not any(n.startswith("trainer/") for n in names), "the optimizer state stays the trainer's"
    manifest = json.loads(tarfile.open(fileobj=io.BytesIO(r.content)).extractfile("manifest.json").read())
    assert manifest["kind"] == "lora" and manifest["base_model"] == str(base_dir)

    # an archive whose file does not match the manifest is refused when it is unpacked
    broken = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(r.content)) as src, tarfile.open(fileobj=broken, mode="w") as dst:
        for member in src:
            data = src.extractfile(member).read()
            if member.name == "adapter_model.safetensors":
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            dst.addfile(member, io.BytesIO(data))
    (tmp_path / "broken.tar").write_bytes(broken.getvalue())
    with pytest.raises(
        registry.CorruptVersion, match="adapter_model.safetensors does not match its checksum"
    ):
        registry.extract_archive(tmp_path / "broken.tar", tmp_path / "out")
    # a member that leaves the directory is refused before anything is written outside it
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as dst:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        dst.addfile(info, io.BytesIO(b"hi"))
    (tmp_path / "evil.tar").write_bytes(evil.getvalue())
    with pytest.raises(registry.CorruptVersion, match="not a file inside the version"):
        registry.extract_archive(tmp_path / "evil.tar", tmp_path / "out2")
    assert not (tmp_path / "escaped.txt").exists()

    # a stored file that was altered ends the stream short: the reader's check catches it
    store = LocalStore(settings.storage.root)
    key = registry.version_prefix("acme", "job-lora", 1) + "/adapter_model.safetensors"
    blob = bytearray(await store.get(key))
    blob[-1] ^= 0xFF
    await store.put(key, bytes(blob))
    with pytest.raises(registry.CorruptVersion, match="does not match its checksum"):
        async for _ in registry.version_archive(
            store, registry.version_prefix("acme", "job-lora", 1) + "/manifest.json"
        ):
            pass
    assert (await client.get("/v1/jobs/job-lora/checkpoints/2")).status_code == 404
