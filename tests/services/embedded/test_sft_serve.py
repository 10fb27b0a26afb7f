"""An sft job on ``temper serve`` (the whole platform in one process): conversations
uploaded as a task set, the job trains without rollouts and publishes versions like an
RL job, and an RL job whose ``policy.init`` names that job's version is accepted, pinned
to the version, and starts from its weights."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from tests.services.embedded.test_temper_serve import TASKS, printed_key, temper_serve, wait_for

WORDS = ["apple", "river", "stone", "cloud", "ember", "maple"]


def conversations() -> str:
    """OpenAI fine-tuning lines: the first answer shown as context (weight 0), the second trained."""
    lines = []
    for i, word in enumerate(WORDS):
        lines.append(
            {
                "messages": [
                    {"role": "user", "content": f"word {i}?"},
                    {"role": "assistant", "content": "let me think", "weight": 0},
                    {"role": "user", "content": "answer"},
                    {"role": "assistant", "content": word},
                ]
            }
        )
    return "".join(json.dumps(line) + "\n" for line in lines)


def ended(api: httpx.Client, job_id: str) -> dict | None:
    job = api.get(f"/v1/jobs/{job_id}").json()
    return job if job["state"] in ("completed", "failed", "cancelled") else None


def weights(data: Path, prefix: str) -> dict:
    return load_file(str(data / "objects" / prefix / "model.safetensors"))


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_sft_job_publishes_versions_an_rl_job_starts_from(tmp_path):
    data = tmp_path / "serve"
    with temper_serve(data, "temper-serve-sft.log", TEMPER_REDIS__URL="redis://127.0.0.1:1/0") as (
        url,
        text,
        _,
    ):
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {printed_key(text)}"}, timeout=30)
        # a bad conversation is refused at upload, naming its line and message
        bad = json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "q", "weight": 1},
                    {"role": "assistant", "content": "a"},
                ]
            }
        )
        r = api.post("/v1/tasksets", params={"name": "bad"}, content=bad + "\n",
                     headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
        assert r.status_code == 422 and "weight applies to assistant messages only" in r.text, r.text
        r = api.post("/v1/tasksets", params={"name": "words"}, content=conversations(),
                     headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
        assert r.status_code == 201, r.text
        chats = r.json()["id"]

        base = {"name": "sft-words", "handle": "sft-words", "policy": {"model": "temper-policy"},
                "tasks": {"taskset": chats}}  # fmt: skip
        # RL-only fields are refused for an sft job, even at their defaults
        r = api.post("/v1/jobs", json={**base, "algorithm": {"name": "sft", "clip_eps": 0.2}})
        assert r.status_code == 422 and "algorithm.clip_eps" in r.text and "RL jobs only" in r.text, r.text
        spec = {**base, "algorithm": {"name": "sft", "learning_rate": 0.003, "batch_size": 4, "checkpoint_every": 2},
                "schedule": {"iterations": 6}}  # fmt: skip
        r = api.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        sft_id = r.json()["id"]
        job = wait_for(lambda: ended(api, sft_id), 180, "the sft job to end", interval=1.0)
        assert job["state"] == "completed", job
        # 6 conversations in batches of 4: 2 steps an epoch, 12 in 6 epochs; a version every 2
        versions = api.get(f"/v1/jobs/{sft_id}/checkpoints").json()
        assert [(v["version"], v["step"]) for v in versions] == [(n, 2 * n) for n in range(1, 7)]
        first, last = versions[0]["metrics"]["loss"], versions[-1]["metrics"]["loss"]
        assert last < first * 0.7, (first, last)

        # an RL job starting from v6 of that job (by handle): pinned to the version's prefix
        lines = TASKS.read_text().splitlines()[:2]
        r = api.post("/v1/tasksets", params={"name": "offset"}, content="\n".join(lines) + "\n",
                     headers={"Content-Type": "application/x-ndjson"})  # fmt: skip
        assert r.status_code == 201, r.text
        rl = {
            "name": "rl-from-sft",
            "policy": {"model": "temper-policy", "init": "job:sft-words@latest",
                       "sampling": {"temperature": 1.0, "max_tokens": 16}},
            "tasks": {"taskset": r.json()["id"], "group_size": 2},
            "environment": {"kind": "code", "max_turns": 1, "limits": {"wall_s": 10, "memory_mb": 256}},
            "algorithm": {"name": "grpo", "groups_per_step": 1, "skip_zero_variance": False},
            "schedule": {"iterations": 1, "episodes_per_iteration": 2, "max_concurrent_episodes": 2},
        }  # fmt: skip
        for init, message in [
            ("job:nobody@v1", "no job of yours"),
            ("job:sft-words@v99", "has published no version v99"),
            ("tenants/other/jobs/job-x/versions/v1", "another tenant's"),
        ]:
            r = api.post("/v1/jobs", json={**rl, "policy": {**rl["policy"], "init": init}})
            assert r.status_code == 422 and message in r.text, r.text
        r = api.post("/v1/jobs", json={**rl, "policy": {**rl["policy"], "model": "temper-tiny"}})
        assert r.status_code == 422 and "was trained from model 'temper-policy'" in r.text, r.text
        r = api.post("/v1/jobs", json=rl)
        assert r.status_code == 201, r.text
        rl_id = r.json()["id"]
        pinned = api.get(f"/v1/jobs/{rl_id}").json()["spec"]["policy"]["init"]
        assert pinned.endswith(f"/jobs/{sft_id}/versions/v6"), pinned
        job = wait_for(lambda: ended(api, rl_id), 240, "the RL job to end", interval=1.0)
        assert job["state"] == "completed", job
        rl_versions = api.get(f"/v1/jobs/{rl_id}/checkpoints").json()
        assert rl_versions, "the RL job published no version"
        api.close()
    # one RL step from the sft weights: far closer to them than to the sft job's start
    sft_v6 = weights(data, pinned)
    sft_v1 = weights(data, pinned.replace("/v6", "/v1"))
    rl_prefix = pinned.replace(sft_id, rl_id).replace("/v6", f"/v{rl_versions[-1]['version']}")
    rl_v = weights(data, rl_prefix)
    manifest = json.loads((data / "objects" / rl_prefix / "manifest.json").read_text())
    assert manifest["base_model"] == pinned
    dist = lambda a, b: sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5  # noqa: E731
    assert dist(rl_v, sft_v6) < dist(rl_v, sft_v1) / 3, (dist(rl_v, sft_v6), dist(rl_v, sft_v1))
