"""Which version of which job a backend serves, checked by content: two jobs training full
weights on one gateway never get each other's weights, nor each other's version tag."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.inference_gateway.cpu_server.runner import ModelRunner
from services.inference_gateway.inference import Inference
from services.inference_gateway.local import LocalBackend
from services.inference_gateway.weights import Waiting
from temper import registry
from temper.events import InferenceRequest, PolicyUpdate
from temper.events import SamplingParams as Sampling
from temper.policy import create_model, default_tokenizer, encode_chat, save_checkpoint, token_logprobs
from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings
from temper.storage import LocalStore

pytestmark = pytest.mark.timeout(120)

TOK = default_tokenizer()
PROMPT = encode_chat(TOK, [{"role": "user", "content": "Say something."}])


async def publish_full(store: LocalStore, tmp: Path, job: str, version: int, seed: int) -> tuple[str, object]:
    """A full-weights version of ``job`` (a model with the weights of ``seed``) in the registry."""
    model = create_model(seed=seed)
    directory = save_checkpoint(model, tmp / f"{job}-v{version}", tokenizer=TOK)
    key = await registry.publish_version(
        store,
        registry.version_prefix("t", job, version),
        directory,
        job_id=job,
        version=version,
        kind="full",
        base_model="tiny",
    )
    return key, model


def own_logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        return token_logprobs(model, torch.tensor([PROMPT + tokens]))[0, len(PROMPT) :].tolist()


def request(job: str) -> InferenceRequest:
    return InferenceRequest(
        job_id=job,
        episode_id=f"{job}-e",
        turn=0,
        attempt=1,
        model="tiny",
        prompt_ids=PROMPT,
        sampling=Sampling(max_tokens=6, seed=11),
    )


def inference(tmp: Path, store: LocalStore, backends: int) -> Inference:
    cfg = InferenceSettings(
        backends=[],
        checkpoint_cache_dir=str(tmp / "cache"),
        request_timeout_s=1.0,
        max_retries=0,
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


async def embedded_runtime(tmp: Path):  # noqa: ANN201 - a started temper.runtime.Runtime
    """A gateway's runtime on a migrated SQLite database, the in-process bus and a local store."""
    from temper.db.migrate import upgrade
    from temper.runtime import Runtime
    from temper.settings import BusKind, BusSettings, DatabaseSettings, Settings, StorageKind, StorageSettings

    url = f"sqlite+aiosqlite:///{tmp}/temper.db"
    await asyncio.to_thread(upgrade, url)
    rt = Runtime(
        Settings(
            bus=BusSettings(kind=BusKind.inprocess),
            storage=StorageSettings(kind=StorageKind.local, root=tmp / "objects"),
            db=DatabaseSettings(url=url),
            data_dir=tmp,
        ),
        service="inference-gateway",
    )
    await rt.start()
    return rt


async def test_the_issues_case_a_second_full_weight_job_never_gets_the_first_ones_weights(tmp_path):
    """Job A reloads its full weights at version 5, then job B publishes its version 1, on a
    gateway with one backend: B's requests are not answered with A's weights nor tagged
    with A's version; B's version 1 is loaded once A's job ended, and then serves B."""
    store = LocalStore(tmp_path / "objects")
    svc = inference(tmp_path, store, backends=1)
    await svc.start()
    try:
        key_a, model_a = await publish_full(store, tmp_path, "job-a", 5, seed=5)
        key_b, model_b = await publish_full(store, tmp_path, "job-b", 1, seed=21)
        b1 = PolicyUpdate(job_id="job-b", version=1, checkpoint_key=key_b, step=1)
        await svc.apply_update(PolicyUpdate(job_id="job-a", version=5, checkpoint_key=key_a, step=5))
        with pytest.raises(Waiting, match="job-a"):  # the only backend holds job A's weights
            await svc.apply_update(b1)
        a = await svc.handle(request("job-a"))
        assert (a.error, a.policy_version) == (None, 5)
        assert a.logprobs == pytest.approx(own_logprobs(model_a, a.token_ids), abs=1e-4)
        b = await svc.handle(request("job-b"))
        assert b.error is not None and b.policy_version != 5, (
            f"job B was answered while job A holds the only backend: tagged v{b.policy_version}"
        )
        assert b.token_ids == [] and "job-a" in b.error
        assert await svc.end_job("job-a") == ["local-0"]
        assert svc.table.holders_of("job-a") == [] and svc.table.free("default") == ["local-0"]
        base = await svc.handle(request("job-b"))  # job B before its update: the base weights, v0
        assert (base.error, base.policy_version) == (None, 0)
        assert base.logprobs == pytest.approx(own_logprobs(create_model(seed=0), base.token_ids), abs=1e-4)
        assert await svc.apply_update(b1)
        b = await svc.handle(request("job-b"))
        assert (b.error, b.policy_version) == (None, 1)
        assert b.logprobs == pytest.approx(own_logprobs(model_b, b.token_ids), abs=1e-4)
    finally:
        await svc.stop()


async def test_two_full_weight_jobs_on_two_backends_each_get_their_own_weights_and_tag(tmp_path):
    store = LocalStore(tmp_path / "objects")
    svc = inference(tmp_path, store, backends=2)
    await svc.start()
    try:
        key_a, model_a = await publish_full(store, tmp_path, "job-a", 5, seed=5)
        key_b, model_b = await publish_full(store, tmp_path, "job-b", 1, seed=21)
        await svc.apply_update(PolicyUpdate(job_id="job-a", version=5, checkpoint_key=key_a, step=5))
        await svc.apply_update(PolicyUpdate(job_id="job-b", version=1, checkpoint_key=key_b, step=1))
        for _ in range(3):  # whichever backend a request lands on
            a, b = await svc.handle(request("job-a")), await svc.handle(request("job-b"))
            assert (a.error, a.policy_version, b.error, b.policy_version) == (None, 5, None, 1)
            assert a.backend != b.backend
            assert a.logprobs == pytest.approx(own_logprobs(model_a, a.token_ids), abs=1e-4)
            assert b.logprobs == pytest.approx(own_logprobs(model_b, b.token_ids), abs=1e-4)
    finally:
        await svc.stop()


async def test_a_job_naming_a_model_directory_is_served_by_it_and_the_next_job_by_its_own(tmp_path):
    """The runner takes the model a job names (its version 0), and gives it back for a job
    that names the runner's own model."""
    store = LocalStore(tmp_path / "objects")
    named = create_model(seed=7)
    directory = save_checkpoint(named, tmp_path / "named-model", tokenizer=TOK)
    svc = inference(tmp_path, store, backends=1)
    await svc.start()
    try:
        mine = await svc.handle(request("job-x").model_copy(update={"model": str(directory)}))
        assert (mine.error, mine.policy_version) == (None, 0)
        assert mine.logprobs == pytest.approx(own_logprobs(named, mine.token_ids), abs=1e-4)
        assert svc.table.holdings["local-0"].names == {str(directory)}
        # another job on the gateway's own model while job x still runs on its: it waits, then fails
        blocked = await svc.handle(request("job-y"))
        assert blocked.error is not None and str(directory) in blocked.error
        await svc.end_job("job-x")
        after = await svc.handle(request("job-y"))
        assert (after.error, after.policy_version) == (None, 0)
        assert after.logprobs == pytest.approx(own_logprobs(create_model(seed=0), after.token_ids), abs=1e-4)
        assert svc.table.holdings["local-0"].at_origin
    finally:
        await svc.stop()


async def publish_lora(store: LocalStore, job: str, version: int, seed: int) -> tuple[str, torch.nn.Module]:
    """A LoRA version of ``job`` on the seed-0 base, its adapter moved far from zero."""
    from temper.jobspec import LoraSpec
    from temper.training import Learner, LearnerConfig

    lora = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    learner = Learner(create_model(seed=0), LearnerConfig(lora=lora), device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    learner.model.eval()
    key = await learner.publish_version(
        store,
        registry.version_prefix("t", job, version),
        job_id=job,
        version=version,
        base_model="models/base",
    )
    return key, learner.model


async def test_a_lora_version_with_no_backend_for_its_base_waits_and_loads_nowhere(tmp_path):
    """Job A's full weights hold the only backend: job L's LoRA version has no backend
    serving its base and none free to take it, so it waits (it was reported loaded, with
    no backend serving it, and L's requests failed with no backend)."""
    from services.inference_gateway.versions import JobModel

    store = LocalStore(tmp_path / "objects")
    svc = inference(tmp_path, store, backends=1)
    await svc.start()
    try:
        key_a, _ = await publish_full(store, tmp_path, "job-a", 5, seed=5)
        await svc.apply_update(PolicyUpdate(job_id="job-a", version=5, checkpoint_key=key_a, step=5))
        key_l, _ = await publish_lora(store, "job-l", 1, seed=3)
        svc.jobs["job-l"] = JobModel(base="tiny")
        with pytest.raises(Waiting, match="job-l"):
            await svc.apply_update(PolicyUpdate(job_id="job-l", version=1, checkpoint_key=key_l, step=1))
        assert svc.table.holders_of("job-l") == [] and svc.confirmed("job-l") is None
    finally:
        await svc.stop()


async def test_a_lora_version_read_before_its_job_goes_only_where_the_jobs_base_is(tmp_path):
    """A restarted gateway's policy group redelivers a LoRA version before the job's requests
    (or the start-up read) said which model the job starts from. The model is read from the
    database first, so the adapter goes on one backend, given the job's base from the store,
    and answers with the adapter's weights; it went on both backends at their own base."""
    from services.inference_gateway.updates import PolicyUpdates
    from temper.db import Job, Tenant

    rt = await embedded_runtime(tmp_path)
    assert rt.db is not None and isinstance(rt.store, LocalStore)
    store = rt.store
    base = save_checkpoint(create_model(seed=0), tmp_path / "base", tokenizer=TOK)
    for path in base.iterdir():
        await store.put(f"models/base/{path.name}", path.read_bytes())
    async with rt.db.session() as s:
        s.add(Tenant(id="t", name="T"))
    async with rt.db.session() as s:
        spec = {"policy": {"model": "tiny", "init": "models/base"}}
        s.add(Job(id="job-l", tenant_id="t", name="l", spec=spec, state="running", policy_version=1))
    svc = inference(tmp_path, store, backends=2)
    await svc.start()
    updates = PolicyUpdates(rt, svc)
    try:
        key, adapted = await publish_lora(store, "job-l", 1, seed=3)
        await updates._apply_one(PolicyUpdate(job_id="job-l", version=1, checkpoint_key=key, step=1))
        [holder] = svc.table.holders_of("job-l")
        assert "models/base" in svc.table.holdings[holder].names
        answer = await svc.handle(request("job-l").model_copy(update={"init": "models/base"}))
        assert (answer.error, answer.policy_version, answer.backend) == (None, 1, holder)
        assert answer.logprobs == pytest.approx(own_logprobs(adapted, answer.token_ids), abs=1e-4)
    finally:
        await svc.stop()
        await rt.stop()


async def test_a_served_version_whose_row_write_failed_is_written_by_the_watch(tmp_path):
    """The gateway confirms a loaded version once. When the write of ``served_at`` fails (the
    database restarting), the dispatcher's gate waits on that row; it waited forever because
    nothing wrote it again (a reduced-chaos job stopped after its first iteration). The
    watch's next pass writes it."""
    from sqlalchemy import select

    from services.inference_gateway.updates import PolicyUpdates
    from temper.db import Job, PolicyVersion, Tenant

    rt = await embedded_runtime(tmp_path)
    assert rt.db is not None and isinstance(rt.store, LocalStore)
    db = rt.db
    key, _ = await publish_full(rt.store, tmp_path, "job-w", 1, seed=5)
    async with db.session() as s:
        s.add(Tenant(id="t", name="T"))
    async with db.session() as s:
        s.add(Job(id="job-w", tenant_id="t", name="w", spec={"policy": {"model": "tiny"}}, state="running"))
    async with db.session() as s:
        s.add(PolicyVersion(job_id="job-w", version=1, checkpoint_key=key, step=1))

    async def served() -> tuple[object, object]:
        async with db.session() as s:
            row = (await s.execute(select(PolicyVersion.served_at, PolicyVersion.served_by))).one()
        return row.served_at, row.served_by

    svc = inference(tmp_path, rt.store, backends=1)
    await svc.start()
    updates = PolicyUpdates(rt, svc)
    real_session = db.session
    # a scheduler in this process is woken once the row says the version is served, not before
    wakes: list[int] = []
    rt.version_served.append(lambda: wakes.append(1))
    try:

        def refused():
            raise ConnectionRefusedError("the database is restarting")

        await updates.know_job("job-w")  # read before the database goes: only the write fails
        db.session = refused  # type: ignore[method-assign]
        await updates._apply_one(PolicyUpdate(job_id="job-w", version=1, checkpoint_key=key, step=1))
        db.session = real_session  # type: ignore[method-assign]
        assert svc.confirmed("job-w") == 1
        assert await served() == (None, None)
        assert updates.unrecorded == {"job-w": (1, ["local-0"])}
        assert wakes == []

        await updates.record_unrecorded()  # what the watch does each pass
        served_at, served_by = await served()
        assert served_at is not None and served_by == ["local-0"]
        assert updates.unrecorded == {}
        assert wakes == [1]
    finally:
        db.session = real_session  # type: ignore[method-assign]
        await svc.stop()
        await rt.stop()
