"""The digests a job's provenance records (temper.provenance): a model directory's equals the
digest of the registry version published from it (read from its manifest, no download) and of
its files as objects; a task set's follows its content, not its order; the source names this
checkout's commit, and says why not where there is no git."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

import temper
from temper import provenance
from temper.jobspec import JobSpec
from temper.registry import publish_version
from temper.storage import LocalStore

ROOT = Path(__file__).resolve().parents[2]


def model_dir(path: Path, weights: bytes = b"\x00\x01weights") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    (path / "sub").mkdir()
    (path / "sub" / "extra.txt").write_text("x")
    return path


def by_hand(files: dict[str, bytes]) -> str:
    """The documented digest, computed here from scratch."""
    listing = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    return hashlib.sha256(json.dumps(listing, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def spec(**policy: str) -> JobSpec:
    return JobSpec.model_validate({"name": "j", "policy": policy, "tasks": {"taskset": "ts-1"}})


async def test_a_model_directory_and_its_published_version_have_one_digest(tmp_path):
    directory = model_dir(tmp_path / "m")
    files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    store = LocalStore(tmp_path / "objects")

    local = await provenance.model_provenance(spec(model="served-name", init=str(directory)), store)
    assert (local["source"], local["sha256"], local["files"]) == ("directory", by_hand(files), 4)

    key = await publish_version(store, "acme/job-1/versions/v3", directory, job_id="job-1", version=3,
                                kind="full", base_model="m", extra={"trainer/optimizer.pt": b"opt"})  # fmt: skip
    for ref in (key, key.removesuffix("/manifest.json")):
        version = await provenance.model_provenance(spec(model="served-name", init=ref), store)
        assert (version["source"], version["sha256"]) == ("registry version", local["sha256"]), ref

    for name, data in files.items():
        await store.put(f"raw/model/{name}", data)
    prefix = await provenance.model_provenance(spec(model="m", init="raw/model"), store)
    # the objects directly under the prefix: sub/extra.txt is not one of them
    direct = {k: v for k, v in files.items() if "/" not in k}
    assert (prefix["source"], prefix["sha256"]) == ("object prefix", by_hand(direct))

    await store.put("weights/w.safetensors", b"abc")
    one = await provenance.model_provenance(spec(model="m", init="weights/w.safetensors"), store)
    assert one["sha256"] == by_hand({"model.safetensors": b"abc"})

    # policy.model a directory and no init: that directory is the initial weights (as the trainer has it)
    served_dir = await provenance.model_provenance(spec(model=str(directory)), store)
    assert served_dir["init"] == str(directory) and served_dir["sha256"] == local["sha256"]

    changed = model_dir(tmp_path / "m2", weights=b"\x00\x02weights")
    other = await provenance.model_provenance(spec(model="m", init=str(changed)), store)
    assert other["sha256"] != local["sha256"]


async def test_a_model_without_files_here_says_why(tmp_path):
    store = LocalStore(tmp_path / "objects")
    preset = await provenance.model_provenance(spec(model="temper-policy"), store)
    assert (preset["source"], preset["sha256"]) == ("preset", None) and "TEMPER_TRAINER__PRESET" in preset[
        "note"
    ]
    missing = await provenance.model_provenance(spec(model="m", init="nowhere/model"), store)
    assert missing["sha256"] is None and "not readable" in missing["note"]


def test_the_task_digest_follows_content_not_order():
    a = {"id": "a", "kind": "code", "prompt": "p", "spec": {"tests": "t"}, "metadata": {}}
    b = {"id": "b", "kind": "code", "prompt": "q", "spec": {}, "metadata": {"difficulty": 2}}
    assert provenance.tasks_digest([a, b]) == provenance.tasks_digest([b, a])
    assert provenance.tasks_digest([a, b]) != provenance.tasks_digest([a, {**b, "prompt": "Q"}])
    assert provenance.tasks_digest([a]) != provenance.tasks_digest([a, b])
    lines = b"\n".join(json.dumps(t, sort_keys=True, separators=(",", ":")).encode() for t in (a, b))
    assert provenance.tasks_digest([b, a]) == hashlib.sha256(lines).hexdigest()


def test_the_source_is_this_checkouts_commit(monkeypatch, tmp_path):
    provenance.source.cache_clear()
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.returncode != 0:
            pytest.fail("the tests run from a git checkout")
        found = provenance.source()
        assert found["version"] == temper.__version__ and found["commit"] == head.stdout.strip()
        assert isinstance(found["dirty"], bool)

        provenance.source.cache_clear()
        fake = tmp_path / "site-packages" / "libs" / "temper" / "__init__.py"
        monkeypatch.setattr(temper, "__file__", str(fake))
        away = provenance.source()
        assert away["commit"] is None and away["dirty"] is None
        assert "not a git checkout" in away["commit_unknown"]
    finally:
        provenance.source.cache_clear()
