"""VLLMBackend against recorded vLLM response shapes (fixtures/, versions named in each file)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.inference_gateway.backends import BackendError, ErrorKind, GenerateRequest, VLLMBackend
from temper.events import SamplingParams
from temper.policy.config import BackendKind, BackendSpec, VLLMReloadMode

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


async def test_lora_reload_names_an_adapter_per_version_and_requests_use_it(tmp_path) -> None:
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
        await b.load_weights(version=v, path=tmp_path / f"v{v}")
    res = await b.complete(GenerateRequest([1, 2]))
    assert res.policy_version == 3
    loads = [body for path, body in calls if path == "/v1/load_lora_adapter"]
    assert [x["lora_name"] for x in loads] == ["temper-policy-v1", "temper-policy-v2", "temper-policy-v3"]
    assert loads[0]["lora_path"] == str(tmp_path / "v1")
    assert ("/v1/unload_lora_adapter", {"lora_name": "temper-policy-v1"}) in calls
    assert calls[-1][0] == "/v1/completions" and calls[-1][1]["model"] == "temper-policy-v3"
    await b.aclose()


async def test_full_reload_uses_collective_rpc(tmp_path) -> None:
    calls: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"results": [None]})

    b = vllm_backend(handler, VLLMReloadMode.full)
    await b.load_weights(version=4, path=tmp_path)
    assert calls == [("/collective_rpc", {"method": "reload_weights"})] and b.version == 4
    await b.aclose()


def test_models_fixture_is_what_the_gateway_serves_too() -> None:
    from services.inference_gateway.cpu_server.app import CompletionBody

    fx = load("vllm_models.json")["response"]
    assert {"id", "object", "owned_by", "root", "parent", "permission"} <= set(fx["data"][0])
    CompletionBody.model_validate(load("vllm_0.10.2_completion_token_ids.json")["request"])
