"""VLLMBackend against recorded vLLM response shapes (fixtures/, versions named in each file)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.inference_gateway.backends import BackendError, ErrorKind, GenerateRequest, VLLMBackend
from temper import registry
from temper.events import SamplingParams
from temper.policy.config import BackendKind, BackendSpec, VLLMReloadMode
from temper.storage import LocalStore

pytestmark = pytest.mark.timeout(20)

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def vllm_backend(handler, mode: VLLMReloadMode = VLLMReloadMode.lora) -> VLLMBackend:  # noqa: ANN001
    b = VLLMBackend(
        BackendSpec(name="v0", url="http://vllm", kind=BackendKind.vllm),
        model_name="temper-policy",
        reload_mode=mode,
    )
    b.client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://vllm")
    return b


@pytest.mark.parametrize(
    "fixture", ["vllm_0.10.2_completion_token_ids.json", "vllm_0.8_completion_token_id_strings.json"]
)
async def test_completion_shapes_parse_to_the_same_fields(fixture: str) -> None:
    fx = load(fixture)
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=fx["response"])

    b = vllm_backend(handler)
    prompt = fx["request"]["prompt"]
    res = await b.complete(GenerateRequest(prompt, SamplingParams(max_tokens=4, seed=7, stop=["\n"])))
    choice = fx["response"]["choices"][0]
    want_ids = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    assert res.token_ids == want_ids
    assert res.logprobs == choice["logprobs"]["token_logprobs"]
    assert res.prompt_ids == prompt
    assert (res.text, res.finish_reason, res.stop_reason) == (
        choice["text"],
        choice["finish_reason"],
        choice["stop_reason"],
    )
    assert res.policy_version == 0 and res.backend == "v0"
    body = seen[0]
    assert body["prompt"] == prompt and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert (
        body["logprobs"] == 0
        and body["seed"] == 7
        and body["stop"] == ["\n"]
        and body["model"] == "temper-policy"
    )
    await b.aclose()


async def test_error_statuses_map_to_retryable_or_not() -> None:
    fx = load("vllm_error_400.json")
    status = {"code": 400}

    def handler(request: httpx.Request) -> httpx.Response:
        if status["code"] == 400:
            return httpx.Response(400, json=fx["response"])
        return httpx.Response(status["code"], text="boom")

    b = vllm_backend(handler)
    with pytest.raises(BackendError) as e400:
        await b.complete(GenerateRequest([1, 2, 3]))
    assert (
        e400.value.kind is ErrorKind.client
        and not e400.value.retryable
        and "maximum context" in str(e400.value)
    )
    for code in (500, 503, 429):
        status["code"] = code
        with pytest.raises(BackendError) as e5:
            await b.complete(GenerateRequest([1, 2, 3]))
        assert e5.value.retryable
    await b.aclose()


async def test_a_response_without_token_ids_is_a_protocol_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, json={"choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}]}
        )

    b = vllm_backend(handler)
    with pytest.raises(BackendError) as e:
        await b.complete(GenerateRequest([1]))
    assert e.value.kind is ErrorKind.protocol
    await b.aclose()


async def version_dir(tmp_path: Path, job: str, version: int, kind: str = "lora") -> Path:
    """A registry version (fake weights, real manifest) fetched to where vLLM would read it."""
    src = tmp_path / f"src-{job}-{version}"
    src.mkdir()
    if kind == "lora":
        (src / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
        (src / "adapter_model.safetensors").write_bytes(b"adapter-%d" % version)
    else:
        (src / "config.json").write_text("{}")
        (src / "model.safetensors").write_bytes(b"weights-%d" % version)
    store = LocalStore(tmp_path / "objects")
    prefix = registry.version_prefix("t", job, version)
    key = await registry.publish_version(
        store, prefix, src, job_id=job, version=version, kind=kind, base_model="base"
    )
    dest = tmp_path / "shared" / job / f"v{version}"
    await registry.fetch_version(store, key, dest)
    return dest


async def test_lora_reload_names_an_adapter_per_job_and_version_and_requests_use_it(tmp_path) -> None:
    calls: list[tuple[str, dict]] = []
    completion = load("vllm_0.10.2_completion_token_ids.json")["response"]

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.path, body))
        if request.url.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            return httpx.Response(200, text="Success: LoRA adapter loaded successfully.")
        return httpx.Response(200, json=completion)

    b = vllm_backend(handler)
    for v in (1, 2, 3):
        await b.load_weights(version=v, path=await version_dir(tmp_path, "job-a", v))
    await b.load_weights(version=1, path=await version_dir(tmp_path, "job-b", 1))
    res = await b.complete(GenerateRequest([1, 2], job_id="job-a"))
    assert res.policy_version == 3
    assert calls[-1][0] == "/v1/completions" and calls[-1][1]["model"] == "job-a-v3"
    res = await b.complete(GenerateRequest([1, 2], job_id="job-b"))
    assert res.policy_version == 1 and calls[-1][1]["model"] == "job-b-v1"
    res = await b.complete(GenerateRequest([1, 2], job_id="job-c"))  # no adapter: the base model
    assert res.policy_version == 0 and calls[-1][1]["model"] == "temper-policy"
    loads = [body for path, body in calls if path == "/v1/load_lora_adapter"]
    assert [x["lora_name"] for x in loads] == ["job-a-v1", "job-a-v2", "job-a-v3", "job-b-v1"]
    assert loads[0]["lora_path"] == str(tmp_path / "shared" / "job-a" / "v1")
    assert ("/v1/unload_lora_adapter", {"lora_name": "job-a-v1"}) in calls
    await b.aclose()


async def test_a_version_vllm_refuses_is_never_served(tmp_path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/load_lora_adapter":
            return httpx.Response(400, json=load("vllm_error_400.json")["response"])
        return httpx.Response(200, json=load("vllm_0.10.2_completion_token_ids.json")["response"])

    b = vllm_backend(handler)
    with pytest.raises(BackendError):
        await b.load_weights(version=1, path=await version_dir(tmp_path, "job-a", 1))
    assert (await b.complete(GenerateRequest([1], job_id="job-a"))).policy_version == 0
    with pytest.raises(BackendError, match="not one"):  # a bare weights file is not an adapter
        await b.load_weights(version=2, path=tmp_path)
    d = await version_dir(tmp_path, "job-a", 3)
    (d / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(BackendError, match="checksum"):
        await b.load_weights(version=3, path=d)
    await b.aclose()


async def test_full_reload_writes_the_weights_where_vllm_reads_them_then_reloads(tmp_path) -> None:
    calls: list[tuple[str, dict]] = []
    served = tmp_path / "vllm-model"

    def handler(request: httpx.Request) -> httpx.Response:
        # by the time vLLM is asked to reload, the new weights are in its model directory
        assert (served / "model.safetensors").read_bytes() == b"weights-4"
        calls.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"results": [None]})

    b = VLLMBackend(
        BackendSpec(name="v0", url="http://vllm", kind=BackendKind.vllm, model_dir=str(served)),
        model_name="temper-policy",
        reload_mode=VLLMReloadMode.full,
    )
    b.client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://vllm")
    await b.load_weights(version=4, path=await version_dir(tmp_path, "job-a", 4, kind="full"))
    assert calls == [("/collective_rpc", {"method": "reload_weights"})] and b.version == 4
    no_dir = vllm_backend(handler, VLLMReloadMode.full)
    with pytest.raises(BackendError, match="model_dir"):
        await no_dir.load_weights(version=5, path=await version_dir(tmp_path, "job-a", 5, kind="full"))
    await b.aclose()
    await no_dir.aclose()


def test_models_fixture_is_what_the_gateway_serves_too() -> None:
    from services.inference_gateway.cpu_server.schemas import CompletionBody

    fx = load("vllm_models.json")["response"]
    assert {"id", "object", "owned_by", "root", "parent", "permission"} <= set(fx["data"][0])
    CompletionBody.model_validate(load("vllm_0.10.2_completion_token_ids.json")["request"])
