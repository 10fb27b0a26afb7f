"""Building a job's learner: its initial policy (a local model directory, an object-store
key, or the ``TEMPER_TRAINER__PRESET`` preset), the latest published version restored on
top, sharded over torchrun's ranks when there are several, and LoRA jobs' adapters put on
one shared copy of their base model. Rank 0 (:mod:`services.trainer.training`) and the
other ranks (:mod:`services.trainer.follower`) build learners with the same calls, so
their collectives meet."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from services.trainer.ranks import Ranks
from temper import registry
from temper.jobspec import JobSpec
from temper.policy import (
    ChatTokenizer,
    create_model,
    is_model_dir,
    load_causal_lm,
    load_weights,
)
from temper.settings.trainer import TrainerSettings
from temper.storage import ObjectStore
from temper.training import Learner, LearnerConfig, reward_model
from temper.training.distributed import DCP_DIR, agree, shard
from temper.training.lora import SharedBase

ModelFactory = Callable[[JobSpec], torch.nn.Module]


def publish_tokenizer(spec: JobSpec) -> ChatTokenizer:
    """The tokenizer a full version is published with: the initial model directory's (local,
    or an object-store one the trainer fetched), else the byte tokenizer of the CPU presets."""
    from temper.policy.tokenizer import policy_tokenizer

    # an object-store model directory's tokenizer once fetched (fetch_policy_tokenizer)
    return policy_tokenizer(spec.policy.init or spec.policy.model)


def _load_local(init: str) -> torch.nn.Module | None:
    """A local model directory, if ``init`` names one."""
    if not Path(init).is_dir():
        return None
    return load_causal_lm(init)


def _load_files(files: dict[str, bytes], preset: str, seed: int) -> torch.nn.Module:
    with tempfile.TemporaryDirectory() as d:
        for name, data in files.items():
            (Path(d) / name).write_bytes(data)
        if "config.json" in files:
            return load_causal_lm(d)
        model = create_model(preset, seed=seed)
        load_weights(model, Path(d) / "model.safetensors")
        return model


async def initial_model(
    spec: JobSpec, settings: TrainerSettings, store: ObjectStore, model_factory: ModelFactory | None = None
) -> torch.nn.Module:
    """A job's initial policy: ``model_factory``'s, else ``policy.init`` (a local model
    directory or an object-store key), else ``policy.model`` when it is a model
    directory, else the ``TEMPER_TRAINER__PRESET`` preset."""
    if model_factory is not None:
        return await asyncio.to_thread(model_factory, spec)
    # no initial weights named: the model the gateway serves, when policy.model is a directory
    init = spec.policy.init or (spec.policy.model if is_model_dir(spec.policy.model) else None)
    if not init:
        return await asyncio.to_thread(create_model, settings.preset, seed=settings.seed)
    local = await asyncio.to_thread(_load_local, init)
    if local is not None:
        return local
    # an object-store key: a model directory prefix (config.json + model.safetensors)
    # or a .safetensors file of the configured preset
    files: dict[str, bytes] = {}
    if init.endswith(".safetensors"):
        files["model.safetensors"] = await store.get(init)
    else:
        base = init.rstrip("/") + "/"
        for key in await store.list(base):
            if "/" not in key[len(base) :]:
                files[key[len(base) :]] = await store.get(key)
    return await asyncio.to_thread(_load_files, files, settings.preset, settings.seed)


def base_key(spec: JobSpec, config: LearnerConfig) -> str:
    """What makes two LoRA jobs' base models the same one in memory: the initial weights'
    name (as :func:`initial_model` resolves it) and gradient checkpointing, a switch on
    the model itself. The weights are float32 in every learner (bf16 is autocast)."""
    name = spec.policy.init or spec.policy.model
    return f"{name} (gradient checkpointing)" if config.gradient_checkpointing else name


async def build_learner(
    spec: JobSpec,
    settings: TrainerSettings,
    store: ObjectStore,
    device: torch.device,
    checkpoint: tuple[str, int, int] | None,
    *,
    ranks: Ranks | None = None,
    model_factory: ModelFactory | None = None,
    bases: dict[str, SharedBase] | None = None,
) -> Learner:
    """A job's learner: the initial policy (which stays the KL reference, also after a
    restart), with the latest version ``(checkpoint key, step, version)`` restored on top.
    With several ``ranks`` the model is sharded over them (every rank calls this, in step):
    a version with sharded state is loaded after sharding, whatever number of ranks wrote
    it; an older one (full weights, one process's) before. With ``bases`` (one process),
    a LoRA job's adapter goes on the shared base model of its :func:`base_key`, loaded
    the first time and added to ``bases``."""
    sharded = ranks is not None and ranks.sharded
    key = checkpoint[0] if checkpoint else None
    error: Exception | None = None
    try:
        config = LearnerConfig.from_spec(spec.algorithm, settings)
        if bases is not None and config.lora is not None and not sharded:
            name = base_key(spec, config)
            shared = bases.get(name)
            if shared is None:
                shared = SharedBase(await initial_model(spec, settings, store, model_factory), key=name)
            learner = await asyncio.to_thread(Learner, shared, config, device=device)
            bases[name] = shared  # once it holds an adapter
        else:
            model = await initial_model(spec, settings, store, model_factory)
            if config.reward_model:  # the initial policy's body under a score head
                model = await asyncio.to_thread(reward_model.from_causal_lm, model)
            learner = await asyncio.to_thread(Learner, model, config, device=device)
        has_state = (
            sharded and key is not None and registry.is_manifest_key(key) and await _has_state(store, key)
        )
    except Exception as exc:
        if not sharded:
            raise
        error = exc
    if sharded:
        # the ranks go on to sharding (collectives) together, or all fail here
        await asyncio.to_thread(agree, error)
    if sharded and has_state:
        await asyncio.to_thread(shard, learner)
    if key is not None:
        try:
            if registry.is_manifest_key(key):
                await learner.load_version(store, key)
            else:  # a checkpoint written before the registry: two safetensors files
                await learner.load_checkpoint(store, key)
        except Exception:
            release(learner, bases)
            raise
    if sharded and not has_state:
        await asyncio.to_thread(shard, learner)
    if checkpoint is not None:
        learner.step_count, learner.version = checkpoint[1], checkpoint[2]
    return learner


def release(learner: Learner, bases: dict[str, SharedBase] | None) -> None:
    """Take back the adapter of a job that failed to load or was closed (and the base, if
    it was the only job on it)."""
    shared = learner.shared
    if shared is None or bases is None:
        return
    if shared.adapters == [learner.adapter]:
        bases.pop(shared.key, None)
    else:
        shared.remove(learner.adapter)


async def _has_state(store: ObjectStore, key: str) -> bool:
    manifest = await registry.read_manifest(store, key)
    return any(n.startswith(f"{registry.TRAINER_DIR}/{DCP_DIR}/") for n in manifest.files)
