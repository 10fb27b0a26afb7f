"""Which backends can serve a job, and whether one is free for it now (temper.policy.placement)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from temper.policy.placement import (
    Need,
    backend_info,
    deployment_backends,
    missing_model_files,
    serve_error,
    wait_reason,
)
from temper.settings.inference import BackendKind, BackendSpec, InferenceSettings, VLLMReloadMode

CFG = InferenceSettings()


def local(name: str, pool: str = "default") -> BackendSpec:
    return BackendSpec(name=name, kind=BackendKind.local, pool=pool)


def full(job: str, base: str = "tiny", pool: str = "default") -> Need:
    return Need(job, base, pool, full=True)


def lora(job: str, base: str = "tiny", pool: str = "default") -> Need:
    return Need(job, base, pool, full=False)


def infos(*specs: BackendSpec, settings: InferenceSettings = CFG) -> list:
    return [backend_info(s, settings) for s in specs]


def test_embedded_mode_without_backends_is_one_local_runner() -> None:
    (spec,) = deployment_backends(CFG, embedded=True)
    assert (spec.name, spec.kind, spec.pool) == ("local-0", BackendKind.local, "default")
    assert deployment_backends(CFG, embedded=False) == []
    (b,) = infos(spec)
    assert b.models == {"temper-policy", "tiny"} and b.loads_models and b.weights == {"lora", "full"}


def test_what_a_backend_serves() -> None:
    (cpu,) = infos(local("l0"))
    vllm_lora, vllm_full = (
        backend_info(
            BackendSpec(name="v", url="http://v", kind=BackendKind.vllm, model_dir="/m/qwen"),
            InferenceSettings(vllm_reload_mode=mode),
        )
        for mode in (VLLMReloadMode.lora, VLLMReloadMode.full)
    )
    assert cpu.serves(full("j")) and cpu.serves(lora("j", base="/data/my-model"))
    assert cpu.serves(full("j", base="tenants/t/models/m")), "an object-store prefix the runner fetches"
    assert not cpu.serves(full("j", base="qwen-7b")), "a name nobody serves"
    assert not cpu.serves(full("j", pool="gpu")), "another pool"
    assert vllm_lora.models == {"temper-policy", "/m/qwen"}, "no preset: vLLM serves its own model"
    assert vllm_lora.serves(lora("j", base="/m/qwen")) and not vllm_lora.serves(full("j", base="/m/qwen"))
    assert vllm_full.serves(full("j", base="/m/qwen")) and not vllm_full.serves(lora("j", base="/m/qwen"))
    assert not vllm_lora.serves(lora("j", base="/data/other")), "vLLM cannot change its base"


def test_a_job_no_backend_can_ever_serve_is_told_what_the_deployment_serves() -> None:
    backends = infos(local("l0")) + [
        backend_info(
            BackendSpec(name="v0", url="http://v", kind=BackendKind.vllm, model_dir="/m/qwen", pool="gpu"),
            CFG,
        )
    ]
    assert serve_error(full("j"), backends) is None
    error = serve_error(full("j", base="/m/qwen", pool="gpu"), backends)
    assert error is not None and "pool 'gpu'" in error and "full weights" in error
    assert "v0 (vllm): /m/qwen, temper-policy, lora" in error
    assert "no backend pool 'tpu'" in (serve_error(full("j", pool="tpu"), backends) or "")


def test_full_weight_jobs_each_need_a_backend_lora_jobs_on_one_base_share_one() -> None:
    one, two = infos(local("l0")), infos(local("l0"), local("l1"))
    assert wait_reason(full("b"), [], one) is None
    reason = wait_reason(full("b"), [full("a")], one)
    assert reason is not None and "job 'a''s full weights" in reason and "l0" in reason
    assert wait_reason(full("b"), [full("a")], two) is None
    assert wait_reason(lora("b"), [lora("a"), lora("c")], one) is None, "adapters share the base"
    assert wait_reason(lora("b", base="/other"), [lora("a")], one) is not None, (
        "another base needs its backend"
    )
    assert wait_reason(full("b"), [lora("a")], one) is not None
    assert wait_reason(lora("b"), [full("a")], one) is not None
    assert wait_reason(full("c"), [lora("a"), full("b")], two) is not None
    assert wait_reason(lora("c"), [lora("a"), full("b")], two) is None
    # a dedicated pool is its own room
    pools = infos(local("l0"), local("g0", pool="full"))
    assert wait_reason(full("b", pool="full"), [full("a")], pools) is None
    assert wait_reason(full("c", pool="full"), [full("a"), full("b", pool="full")], pools) is not None


@pytest.mark.parametrize("order", list(itertools.permutations(["full-a", "full-b", "lora-c", "lora-d"])))
def test_every_order_of_jobs_started_one_by_one_is_admitted_exactly_as_far_as_backends_go(order) -> None:
    """Two backends: two full-weight jobs, or one and the LoRA jobs, never all three kinds."""
    backends = infos(local("l0"), local("l1"))
    running: list[Need] = []
    for name in order:
        need = full(name) if name.startswith("full") else lora(name)
        if wait_reason(need, running, backends) is None:
            running.append(need)
    fulls = [n for n in running if n.full]
    loras = [n for n in running if not n.full]
    assert len(fulls) + (1 if loras else 0) <= 2, "never more holders than backends"
    assert len(fulls) == 2 or len(fulls) + (1 if loras else 0) == 2, f"a backend left idle: {running}"


def test_an_incomplete_model_directory_names_what_it_lacks(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    assert missing_model_files(d) == ["config.json", "tokenizer.json", "model.safetensors"]
    (d / "config.json").write_text("{}")
    (d / "tokenizer.json").write_text("{}")
    assert missing_model_files(d) == ["model.safetensors"]
    (d / "model.safetensors").write_bytes(b"")
    assert missing_model_files(d) == []
