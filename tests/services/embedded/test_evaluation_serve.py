"""Evaluation on ``temper serve`` (the real gateway with CPU engines, the real trainer, real
sandboxes and scorer): a LoRA job and a full-weight job, each with an ``evaluation`` of every
second version on the held-out part of their task set, and ``temper eval`` of a stored version.

Every evaluation episode is checked by content: each of its model tokens' logprobs is the
forward pass of the version it evaluates (downloaded, loaded in ``transformers``/``peft``),
and not of the version next to it; its trajectory tags every turn with that version. Held-out
tasks appear only in evaluation episodes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from temper.policy import create_model, default_tokenizer, save_checkpoint, token_logprobs
from temper.trajectory import Trajectory
from tests.services.embedded.test_temper_serve import TASKS, printed_key, temper_serve, wait_for

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.timeout(600)]

ENDED = ("completed", "failed", "cancelled")


def spec(name: str, taskset: str, model: str, *, lora: bool) -> dict:
    algorithm = {
        "name": "grpo",
        "groups_per_step": 1,
        "checkpoint_every": 1,
        "skip_zero_variance": False,  # every group trains: two versions an iteration
        "learning_rate": 0.05,  # large steps: neighbouring versions sample apart
        # random policies score alike (zero advantages): the entropy bonus moves every step
        "entropy_coef": 1.0,
    }
    if lora:
        algorithm["lora"] = {"rank": 4, "alpha": 8}
    return {
        "name": name,
        "policy": {"model": model, "sampling": {"temperature": 1.0, "max_tokens": 10}},
        "tasks": {"taskset": taskset, "group_size": 2},
        "environment": {"kind": "code", "max_turns": 1, "limits": {"wall_s": 10, "memory_mb": 256}},
        "rewards": {"tests_passed": 1.0},
        "algorithm": algorithm,
        "schedule": {"iterations": 2, "episodes_per_iteration": 4, "max_concurrent_episodes": 4},
        "evaluation": {"every_versions": 2, "samples": 2, "pass_at": [1, 2]},
    }


def trajectories(api: httpx.Client, job_id: str) -> list[Trajectory]:
    r = api.get(f"/v1/jobs/{job_id}/trajectories")
    assert r.status_code == 200, r.text
    fields = set(Trajectory.model_fields)
    return [
        Trajectory.model_validate({k: v for k, v in json.loads(line).items() if k in fields})
        for line in r.text.splitlines()
    ]


def gap(model: torch.nn.Module, found: list[Trajectory]) -> float:
    """The largest gap between the episodes' logprobs and ``model``'s forward pass."""
    worst = 0.0
    for t in found:
        ids, mask, behaviour = t.flat()
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([ids]))[0].tolist()
        gaps = [abs(a - b) for a, b, own in zip(lp, behaviour, mask, strict=True) if own]
        assert gaps, "an episode without model tokens"
        worst = max(worst, *gaps)
    return worst


class Versions:
    """A job's versions as models, downloaded once each (``base``: the model directory the
    jobs start from, the base of a LoRA version)."""

    def __init__(self, api: httpx.Client, key: str, base: Path, tmp: Path) -> None:
        from temper.client import TemperClient

        self.client = TemperClient(str(api.base_url).rstrip("/"), key)
        self.base, self.tmp = base, tmp
        self.cache: dict[tuple[str, int], torch.nn.Module] = {}

    def model(self, job: str, version: int) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if (job, version) in self.cache:
            return self.cache[(job, version)]
        if version == 0:
            model = AutoModelForCausalLM.from_pretrained(self.base)
        else:
            dest = self.tmp / f"{job}-v{version}"
            got = self.client.download_version(job, version, dest)
            if got["kind"] == "lora":
                from peft import PeftModel

                from temper.training.lora import peft_quiet

                with peft_quiet():
                    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(self.base), dest)
            else:
                model = AutoModelForCausalLM.from_pretrained(dest)
        model = model.float().eval()
        self.cache[(job, version)] = model
        return model


def check_evaluations(api: httpx.Client, versions: Versions, job: dict, held: set[str]) -> list[dict]:
    """Each evaluation of ``job``: completed, its episodes on held-out tasks only, each sampled
    by exactly the version it evaluates; returns the evaluations."""
    found = api.get(f"/v1/jobs/{job['id']}/evaluations", params={"tasks": "true"}).json()
    published = job["policy_version"]
    assert [e["version"] for e in found if e["periodic"]] == list(range(0, published + 1, 2)), found
    for ev in found:
        assert ev["state"] == "completed", ev
        assert {t["task_id"] for t in ev["tasks"]} <= held and ev["summary"]["failed_episodes"] == 0
        assert set(ev["pass_at"]) == {"1", "2"} and ev["summary"]["episodes"] == 2 * len(held)
        episodes = trajectories(api, ev["evaluation_job_id"])
        assert len(episodes) == 2 * len(held) and {t.task_id for t in episodes} == held
        v = ev["version"]
        for t in episodes:
            assert t.behaviour_version == v and {
                s.policy_version for s in t.segments if s.role == "model"
            } == {v}
        own = gap(versions.model(job["id"], v), episodes)
        assert own < 1e-3, f"v{v} of {job['name']}: its evaluation episodes were not sampled by it ({own})"
        neighbour = v + 1 if v < published else v - 1
        other = gap(versions.model(job["id"], neighbour), episodes)
        assert other > 1e-2, f"v{neighbour} samples like v{v} ({other}): the check could not tell them apart"
    return found


def test_each_evaluation_is_sampled_by_the_version_it_evaluates_lora_and_full(tmp_path: Path) -> None:
    base_dir = save_checkpoint(create_model(seed=3), tmp_path / "base-model", tokenizer=default_tokenizer())
    # three engines: the LoRA jobs share one base; the full-weight job and its evaluations one each
    engines = json.dumps([{"name": f"local-{i}", "kind": "local"} for i in range(3)])
    with temper_serve(
        tmp_path / "serve", "temper-serve-evaluation.log", TEMPER_INFERENCE__BACKENDS=engines
    ) as (
        url,
        text,
        _proc,
    ):
        key = printed_key(text)
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        r = api.post(
            "/v1/tasksets",
            params={"name": "offset", "validate": "false", "held_out_fraction": 0.34, "held_out_seed": 1},
            content=TASKS.read_text(),
            headers={"Content-Type": "application/x-ndjson"},
        )
        assert r.status_code == 201, r.text
        taskset = r.json()
        assert taskset["held_out"]["held_out"] == 3, taskset
        tasks = api.get(f"/v1/tasksets/{taskset['id']}").json()["tasks"]
        held = {t["id"] for t in tasks if t["split"] == "held_out"}

        ids = {}
        for name, lora in (("lora-job", True), ("full-job", False)):
            r = api.post("/v1/jobs", json=spec(name, taskset["id"], str(base_dir), lora=lora))
            assert r.status_code == 201, r.text
            ids[name] = r.json()["id"]

        def settled() -> bool:
            """Both jobs ended, and each evaluation of every second version they published too."""
            for job_id in ids.values():
                job = api.get(f"/v1/jobs/{job_id}").json()
                if job["state"] not in ENDED:
                    return False
                found = api.get(f"/v1/jobs/{job_id}/evaluations").json()
                due = set(range(0, job["policy_version"] + 1, 2))
                if {e["version"] for e in found} != due or any(e["state"] not in ENDED for e in found):
                    return False
            return True

        wait_for(settled, 420, "the jobs and their evaluations to end", interval=2.0)
        versions = Versions(api, key, base_dir, tmp_path / "versions")
        for name, job_id in ids.items():
            job = api.get(f"/v1/jobs/{job_id}").json()
            assert job["state"] == "completed" and job["policy_version"] >= 3, job
            # training never saw a held-out task
            trained = trajectories(api, job_id)
            assert trained and not {t.task_id for t in trained} & held, name
            check_evaluations(api, versions, job, held)

        # temper eval of a stored version, on every task of the set, as a job of its own
        full = ids["full-job"]
        r = api.post(f"/v1/jobs/{full}/evaluations", json={"version": 1, "split": "all", "samples": 1})
        assert r.status_code == 201, r.text
        made = r.json()["evaluation_job_id"]
        wait_for(
            lambda: api.get(f"/v1/jobs/{made}").json()["state"] in ENDED,
            240,
            "the evaluation of v1",
            interval=1.0,
        )
        (ev,) = api.get(f"/v1/jobs/{made}/evaluations", params={"tasks": "true"}).json()
        assert ev["state"] == "completed" and ev["version"] == 1 and len(ev["tasks"]) == 9, ev
        episodes = trajectories(api, made)
        assert len(episodes) == 9 and all(t.behaviour_version == 1 for t in episodes)
        assert gap(versions.model(full, 1), episodes) < 1e-3
        assert gap(versions.model(full, 2), episodes) > 1e-2
        # a model directory (the jobs' initial model), with the full-weight job's environment and rewards
        r = api.post(
            f"/v1/jobs/{full}/evaluations", json={"model": str(base_dir), "samples": 1, "label": "base"}
        )
        assert r.status_code == 201, r.text
        of_model = r.json()["evaluation_job_id"]
        wait_for(
            lambda: api.get(f"/v1/jobs/{of_model}").json()["state"] in ENDED,
            240,
            "the model's evaluation",
            interval=1.0,
        )
        (ev,) = api.get(f"/v1/jobs/{of_model}/evaluations").json()
        assert ev["state"] == "completed" and ev["version"] is None and ev["model"] == str(base_dir), ev
        episodes = trajectories(api, of_model)
        assert len(episodes) == len(held) and all(t.behaviour_version == 0 for t in episodes)
        assert gap(versions.model(full, 0), episodes) < 1e-3  # the directory's own weights
        metrics = api.get(f"/v1/jobs/{full}/metrics").json()
        evaluated = [
            (p["version"], p["periodic"]) for p in metrics["evaluations"] if p["version"] is not None
        ]
        assert sorted(evaluated) == sorted(
            [(v, True) for v in range(0, api.get(f"/v1/jobs/{full}").json()["policy_version"] + 1, 2)]
            + [(1, False)]
        )
        versions.client.close()
        api.close()
