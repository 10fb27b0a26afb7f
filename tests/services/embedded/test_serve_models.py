"""``temper serve`` serves each job with the model it names and its own weights, checked by
content: a job naming a model directory samples from that model (the episodes' logprobs
are its forward pass, not the gateway's preset's), and a full-weight job submitted beside
it waits in ``pending`` with the reason, then starts from its own weights (the preset's
base, not the first job's trained ones)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from temper.policy import create_model, default_tokenizer, save_checkpoint, token_logprobs
from temper.trajectory import Trajectory
from tests.services.embedded.test_temper_serve import TASKS, printed_key, temper_serve, wait_for

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.timeout(420)]


def spec(name: str, taskset: str, model: str) -> dict:
    return {
        "name": name,
        "policy": {"model": model, "sampling": {"temperature": 1.0, "max_tokens": 12}},
        "tasks": {"taskset": taskset, "group_size": 2},
        "environment": {"kind": "code", "max_turns": 1, "limits": {"wall_s": 10, "memory_mb": 256}},
        "rewards": {"tests_passed": 1.0},
        # every group trained (random policies score alike), so that each iteration publishes a version
        "algorithm": {
            "name": "grpo",
            "groups_per_step": 1,
            "checkpoint_every": 1,
            "skip_zero_variance": False,
        },
        # an iteration after the first starts once the gateway serves the version before, so
        # the job that runs first held the backend with its trained weights before the other
        "schedule": {"iterations": 3, "episodes_per_iteration": 4, "max_concurrent_episodes": 4},
    }


def first_iteration(api: httpx.Client, job_id: str) -> list[Trajectory]:
    r = api.get(f"/v1/jobs/{job_id}/trajectories")
    assert r.status_code == 200, r.text
    fields = set(Trajectory.model_fields)
    out = []
    for line in r.text.splitlines():
        record = json.loads(line)
        if record["iteration"] == 0:
            assert record["behaviour_version"] == 0, record["behaviour_version"]
            out.append(Trajectory.model_validate({k: v for k, v in record.items() if k in fields}))
    assert out, "no trajectory of the first iteration"
    return out


def sampled_from(model: torch.nn.Module, trajectories: list[Trajectory]) -> float:
    """The largest gap between the episodes' logprobs and ``model``'s forward pass."""
    worst = 0.0
    for t in trajectories:
        ids, mask, behaviour = t.flat()
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids]))[0].tolist()
        # token_logprobs gives position i the logprob of token i (0 for the first)
        gaps = [abs(a - b) for a, b, own in zip(lp, behaviour, mask, strict=True) if own]
        assert gaps, "an episode without model tokens"
        worst = max(worst, *gaps)
    return worst


def test_each_job_is_served_by_the_model_it_names_and_starts_from_its_own_weights(tmp_path: Path) -> None:
    named = create_model(seed=7)
    model_dir = save_checkpoint(named, tmp_path / "named-model", tokenizer=default_tokenizer())
    base = create_model(seed=0)  # the gateway's local-0 preset and the trainer's default
    with temper_serve(tmp_path / "serve", "temper-serve-models.log") as (url, text, _proc):
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {printed_key(text)}"}, timeout=30)
        lines = TASKS.read_text().splitlines()[:2]
        r = api.post(
            "/v1/tasksets",
            params={"name": "offset"},
            content="\n".join(lines) + "\n",
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert r.status_code == 201, r.text
        taskset = r.json()["id"]
        wait_for(
            lambda: api.get(f"/v1/tasksets/{taskset}").json()["progress"]["current"] == 2, 120, "validation"
        )

        # an incomplete directory is refused at the door, naming what it lacks
        (tmp_path / "half").mkdir()
        (tmp_path / "half" / "config.json").write_text("{}")
        r = api.post("/v1/jobs", json=spec("half", taskset, str(tmp_path / "half")))
        assert r.status_code == 422 and "no tokenizer.json, model.safetensors" in r.text, r.text

        first = api.post("/v1/jobs", json=spec("named-model", taskset, str(model_dir)))
        assert first.status_code == 201, first.text
        second = api.post("/v1/jobs", json=spec("after-it", taskset, "temper-policy"))
        assert second.status_code == 201, second.text
        a, b = first.json()["id"], second.json()["id"]

        # the scheduler starts one of the two (which one is its choice); the other waits
        def one_waits() -> tuple[dict, dict] | None:
            jobs = [api.get(f"/v1/jobs/{j}").json() for j in (a, b)]
            waits = [
                j
                for j in jobs
                if j["state"] == "pending" and "waiting for a backend" in (j["state_reason"] or "")
            ]
            runs = [j for j in jobs if j["state"] == "running"]
            return (waits[0], runs[0]) if waits and runs else None

        waiting, running = wait_for(one_waits, 60, "one job to wait for the other's backend", interval=0.05)
        assert f"job '{running['id']}''s full weights" in waiting["state_reason"], waiting["state_reason"]

        def ended(job_id: str) -> dict | None:
            j = api.get(f"/v1/jobs/{job_id}").json()
            return j if j["state"] in ("completed", "failed", "cancelled") else None

        for job_id in (a, b):
            job = wait_for(lambda job_id=job_id: ended(job_id), 300, f"job {job_id} to end", interval=1.0)
            assert job["state"] == "completed", job

        # whichever ran second started from its own weights, not the other's trained ones
        mine = first_iteration(api, a)
        assert sampled_from(named, mine) < 1e-3, "the job naming a directory samples from that model"
        assert sampled_from(base, mine) > 1e-1, "not from the gateway's preset"
        theirs = first_iteration(api, b)
        assert sampled_from(base, theirs) < 1e-3, "the other job starts from the preset's weights"
        assert sampled_from(named, theirs) > 1e-1
        api.close()
