"""Data parallelism over a sharded model: FSDP2 (``torch.distributed.fsdp.fully_shard``)
under ``torchrun``, on GPUs with NCCL or on CPUs with gloo.

Every rank holds a shard of the weights, gradients and AdamW state. A step: every rank
gets the same optimizer batch, computes the loss weights over all of it
(:meth:`Learner.backward` with ``batch=``), and trains on its own share
(:func:`share`). Because the weights are the whole batch's, the ranks' gradients *sum*
to the single-process gradient (FSDP averages, so the loss is scaled by the world size).
Gradient clipping uses the global norm, and every rank steps its shard of AdamW.

Checkpoints of a sharded learner are ``torch.distributed.checkpoint`` (DCP) directories
(:func:`save_state`, :func:`load_state`): each rank writes its own shard file, rank 0
the metadata, and DCP reshards on load, so a state saved by N ranks loads on M (one
process without a process group included).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

from temper.logs import log_event
from temper.training.batch import Sample
from temper.training.learner import Learner

log = logging.getLogger("temper.training")

DCP_DIR = "dcp"  # a version's sharded trainer state: trainer/dcp/ (.metadata, __<rank>_0.distcp)


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as ``torchrun`` sets them; (0, 1, 0) outside it."""
    env = os.environ
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0"))


def init(device: torch.device, *, timeout_s: float = 600.0) -> torch.device:
    """Join ``torchrun``'s process group (NCCL on CUDA, gloo on CPU); returns this rank's
    device (``cuda:<local rank>`` on GPUs)."""
    _, _, local = world_from_env()
    if device.type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        timeout = timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        log_event(log, "joining the process group", rank=rank, world=world, backend=backend, attempt=attempt)
        # torchrun's store outlives a restart of the ranks, and with it the addresses the
        # dead ranks published: keys of their own per attempt, or a new rank dials a dead one
        store = dist.PrefixStore(f"temper/attempt-{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return device


def shard(learner: Learner) -> None:
    """Shard ``learner``'s model (each decoder layer, then the rest) and rebuild its
    AdamW over the sharded parameters, keeping its state (a learner restored from an
    unsharded checkpoint keeps its moments). Call after ``init_process_group``."""
    if learner.lora:
        raise ValueError("LoRA on a sharded model is not built yet: train LoRA jobs on one rank")
    if learner.config.entropy_coef:
        raise ValueError("the entropy bonus is not available on a sharded model yet")
    model = learner.model
    carried = get_optimizer_state_dict(model, learner.optimizer) if learner.optimizer.state else None
    decoder: Any = getattr(model, "get_decoder", lambda: None)()
    for layer in getattr(decoder, "layers", []):
        fully_shard(layer)
    fully_shard(model)
    # FSDP averages gradients over ranks (a sum with a divide factor would need PREMUL_SUM,
    # which gloo lacks): scaling the loss by the world size makes the average the sum
    learner.loss_scale = float(dist.get_world_size())
    learner.rank, learner.world = dist.get_rank(), dist.get_world_size()
    learner.full_forward = True
    cfg = learner.config
    learner.optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.learning_rate,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
    )
    if carried is not None:
        set_optimizer_state_dict(
            model, learner.optimizer, carried, options=StateDictOptions(full_state_dict=True)
        )


def share(samples: Sequence[Sample], rank: int, world: int) -> list[Sample]:
    """Rank ``rank``'s samples: longest first, each to the rank with the fewest tokens so far."""
    loads = [0] * world
    mine: list[Sample] = []
    for s in sorted(samples, key=lambda s: len(s.ids), reverse=True):
        r = loads.index(min(loads))
        loads[r] += len(s.ids)
        if r == rank:
            mine.append(s)
    return mine


def full_norm(norm: torch.Tensor) -> float:
    """A gradient norm from ``clip_grad_norm_`` over sharded parameters (a DTensor) as a float."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def summed(values: Sequence[float], device: torch.device) -> list[float]:
    """``values`` added over every rank (float64; on ``device``, as NCCL needs)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return [float(v) for v in t.cpu()]


def agree(error: BaseException | None) -> None:
    """Every rank says whether its part went well; if any rank's failed, raise the same
    error on every rank (so that none goes on to a collective the others never reach)."""
    said: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(said, None if error is None else repr(error)[:300])
    failed = [f"rank {r}: {e}" for r, e in enumerate(said) if e]
    if failed:
        raise RuntimeError("; ".join(failed)) from error


def full_weights(learner: Learner) -> dict[str, Any]:
    """The whole model's weights, gathered on rank 0 in CPU memory ({} on the others).
    Every rank must call it."""
    return get_model_state_dict(
        learner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def save_state(learner: Learner, directory: str | Path) -> list[Path]:
    """Write the model and AdamW state with DCP into ``directory`` (this rank's shard file,
    and on rank 0 the metadata); returns the files this process wrote. Every rank calls it,
    each with a directory of its own or one shared by all."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model, optim = get_state_dict(learner.model, learner.optimizer)
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(d))
    return sorted(p for p in d.iterdir() if _mine(p.name, learner.rank))


def _mine(name: str, rank: int) -> bool:
    return name.startswith(f"__{rank}_") or (rank == 0 and name == ".metadata")


def load_state(learner: Learner, directory: str | Path) -> None:
    """Restore the model and AdamW state from a DCP directory holding every rank's files,
    whatever number of ranks wrote it (resharded to this learner's)."""
    model, optim = get_state_dict(learner.model, learner.optimizer)
    dcp.load({"model": model, "optim": optim}, checkpoint_id=str(directory))  # in place
    set_state_dict(learner.model, learner.optimizer, model_state_dict=model, optim_state_dict=optim)
