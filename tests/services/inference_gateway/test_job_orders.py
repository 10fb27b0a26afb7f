"""Full-weight and LoRA jobs on one gateway in every order, one after another and all at
once, on the CPU runner: every answer is checked by its logprobs against the weights its
tag names (the base for v0, the job's own full weights or adapter after), so no job ever
samples another job's weights or carries another job's version."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.inference_gateway.cpu_server.runner import ModelRunner
from services.inference_gateway.inference import Inference
from services.inference_gateway.local import LocalBackend
from services.inference_gateway.weights import Waiting
from temper import registry
from temper.events import InferenceRequest, InferenceResult, PolicyUpdate
from temper.events import SamplingParams as Sampling
from temper.jobspec import LoraSpec
from temper.policy import create_model, default_tokenizer, encode_chat, save_checkpoint, token_logprobs
from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings
from temper.storage import LocalStore
from temper.training import Learner, LearnerConfig

pytestmark = pytest.mark.timeout(300)

TOK = default_tokenizer()
PROMPT = encode_chat(TOK, [{"role": "user", "content": "Which weights are you?"}])
JOBS = ("full-a", "full-b", "lora-c", "lora-d")
VERSIONS = (1, 2)


@dataclass
class Published:
    store: LocalStore
    keys: dict[tuple[str, int], str]  # (job, version) -> manifest key
    models: dict[tuple[str, int], torch.nn.Module]  # (job, version) -> what must have answered


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    """Two versions of each job in one registry: full weights of their own seed, or an
    adapter on the seed-0 base moved far from zero."""
    import asyncio

    tmp = tmp_path_factory.mktemp("registry")
    store = LocalStore(tmp / "objects")
    keys: dict[tuple[str, int], str] = {}
    models: dict[tuple[str, int], torch.nn.Module] = {}
    base = create_model(seed=0)

    async def publish() -> None:
        for i, job in enumerate(JOBS):
            models[(job, 0)] = base
            for v in VERSIONS:
                prefix = registry.version_prefix("t", job, v)
                if job.startswith("full"):
                    model = create_model(seed=100 + 10 * i + v)
                    d = save_checkpoint(model, tmp / f"{job}-v{v}", tokenizer=TOK)
                    keys[(job, v)] = await registry.publish_version(
                        store, prefix, d, job_id=job, version=v, kind="full", base_model="tiny"
                    )
                else:
                    lora = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
                    learner = Learner(create_model(seed=0), LearnerConfig(lora=lora), device="cpu")
                    g = torch.Generator().manual_seed(100 + 10 * i + v)
                    with torch.no_grad():
                        for name, p in learner.model.named_parameters():
                            if "lora_B" in name:
                                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
                    learner.model.eval()
                    model = learner.model
                    keys[(job, v)] = await learner.publish_version(
                        store, prefix, job_id=job, version=v, base_model="tiny"
                    )
                models[(job, v)] = model

    asyncio.run(publish())
    return Published(store, keys, models)


def gateway(tmp: Path, store: LocalStore, backends: int) -> Inference:
    cfg = InferenceSettings(
        backends=[],
        checkpoint_cache_dir=str(tmp / "cache"),
        request_timeout_s=0.3,
        max_retries=1,
        retry_backoff_s=0.001,
    )
    local = [
        LocalBackend(
            BackendSpec(name=f"local-{i}", kind=BackendKind.local),
            model_name="temper-policy",
            runner=ModelRunner(create_model(seed=0), TOK),
        )
        for i in range(backends)
    ]
    return Inference(cfg, store=store, backends=local, tokenizer=TOK)


def request(job: str, n: int) -> InferenceRequest:
    return InferenceRequest(
        job_id=job,
        episode_id=f"{job}-e{n}",
        turn=0,
        attempt=1,
        model="tiny",
        prompt_ids=PROMPT,
        sampling=Sampling(max_tokens=5, seed=n),
    )


def check(res: InferenceResult, published: Published) -> None:
    """An answer ran on the weights its tag names for its job; a failure carries nothing."""
    if res.error is not None:
        assert res.token_ids == [] and "no backend serves job" in res.error, res.error
        return
    job = res.job_id
    assert job is not None and (job, res.policy_version) in published.models, (
        f"{job} tagged v{res.policy_version}"
    )
    model = published.models[(job, res.policy_version)]
    with torch.no_grad():
        own = token_logprobs(model, torch.tensor([PROMPT + res.token_ids]))[0, len(PROMPT) :].tolist()
    assert res.logprobs == pytest.approx(own, abs=1e-4), f"{job} v{res.policy_version} ran on other weights"


async def ask(svc: Inference, published: Published, job: str, n: int) -> InferenceResult:
    res = await svc.handle(request(job, n))
    check(res, published)
    return res


@pytest.mark.parametrize("order", list(itertools.permutations(JOBS)), ids="-".join)
async def test_jobs_one_after_another_on_one_backend_each_start_from_their_own_weights(
    order: tuple[str, ...], published: Published, tmp_path: Path
) -> None:
    svc = gateway(tmp_path, published.store, backends=1)
    await svc.start()
    try:
        for n, job in enumerate(order):
            first = await ask(svc, published, job, n)
            assert (first.error, first.policy_version) == (None, 0), (
                "a job after another starts from the base"
            )
            for v in VERSIONS:
                await svc.apply_update(
                    PolicyUpdate(job_id=job, version=v, checkpoint_key=published.keys[(job, v)], step=v)
                )
                res = await ask(svc, published, job, n)
                assert (res.error, res.policy_version) == (None, v)
            assert await svc.end_job(job) == ["local-0"]
        assert svc.table.jobs() == set() and svc.table.holdings["local-0"].at_origin
    finally:
        await svc.stop()


async def load_all(svc: Inference, wanted: dict[str, PolicyUpdate]) -> dict[str, str]:
    """Load every wanted version that can be loaded now; the rest wait (the gateway's loop)."""
    waiting = {}
    for job, update in wanted.items():
        try:
            await svc.apply_update(update)
        except Waiting as exc:
            waiting[job] = str(exc)
    return waiting


@pytest.mark.parametrize("backends", [1, 2, 3])
@pytest.mark.parametrize("order", list(itertools.permutations(JOBS)), ids="-".join)
async def test_jobs_all_at_once_in_every_order_never_mix(
    order: tuple[str, ...], backends: int, published: Published, tmp_path: Path
) -> None:
    """All four jobs live together, their versions arriving in ``order``; the jobs then end
    in that order too. A backend holds one job's full weights at most; a job with no backend
    waits (its version, its requests) and gets one once a job ends; every answer checks out."""
    svc = gateway(tmp_path, published.store, backends=backends)
    await svc.start()
    try:
        for n, job in enumerate(order):  # each job's first requests, at v0 (the base)
            await ask(svc, published, job, n)
        live = list(order)
        for v in VERSIONS:
            wanted = {
                job: PolicyUpdate(job_id=job, version=v, checkpoint_key=published.keys[(job, v)], step=v)
                for job in live
            }
            waiting = await load_all(svc, wanted)
            owners = [h.owner for h in svc.table.holdings.values() if h.owner is not None]
            assert len(owners) == len(set(owners)) and all(o.startswith("full") for o in owners)
            served = {job: (await ask(svc, published, job, 10 + v)) for job in live}
            for job in live:
                if job not in waiting:
                    assert svc.confirmed(job) == v and served[job].policy_version == v
        while live:
            ended = live.pop(0)
            await svc.end_job(ended)
            assert svc.table.holders_of(ended) == []
            wanted = {
                j: PolicyUpdate(job_id=j, version=2, checkpoint_key=published.keys[(j, 2)], step=2)
                for j in live
            }
            waiting = await load_all(svc, wanted)
            for job in live:
                res = await ask(svc, published, job, 20 + len(live))
                if job not in waiting:
                    assert (res.error, res.policy_version) == (None, 2)
        # with every job gone, each backend is back on the weights it started with
        assert all(h.at_origin and not h.adapters for h in svc.table.holdings.values())
        for name in svc.table.holdings:
            runner = svc.weights.backend(name).runner  # type: ignore[attr-defined]
            assert runner.holding().owner is None
    finally:
        await svc.stop()
