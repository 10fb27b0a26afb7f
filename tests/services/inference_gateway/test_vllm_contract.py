"""VLLMBackend held to vLLM 0.33.0's own pydantic models (vendored from the wheel, see
vllm_protocol/README.md): every request Temper sends validates against vLLM's request
model and uses only fields vLLM declares; responses built with vLLM's response models parse."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from services.inference_gateway.backends import BackendError, ErrorKind, GenerateRequest
from services.inference_gateway.vllm_backend import VLLMBackend
from temper.events import SamplingParams
from temper.settings.inference import BackendKind, BackendSpec, VLLMReloadMode
from tests.services.inference_gateway.test_backends_contract import model_list, version_dir

pytestmark = pytest.mark.timeout(30)

VLLM_VERSION = "0.33.0"
sys.path.insert(0, str(Path(__file__).parent / "vllm_protocol"))
try:
    from vllm.entrypoints.openai.completion.protocol import (  # type: ignore[import-not-found]
        CompletionLogProbs,
        CompletionRequest,
        CompletionResponse,
        CompletionResponseChoice,
    )
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo  # type: ignore[import-not-found]
    from vllm.entrypoints.serve.lora.protocol import (  # type: ignore[import-not-found]
        LoadLoRAAdapterRequest,
        UnloadLoRAAdapterRequest,
    )
finally:
    sys.path.pop(0)


def declared(model: type) -> set[str]:
    return set(model.model_fields)


def vllm_server(calls: list[tuple[str, dict]], *, token_ids_field: bool = True):  # noqa: ANN201
    """A handler that validates each request with vLLM's models and answers with vLLM's
    response models, as vLLM 0.33.0's server would."""

    loaded: dict[str, str] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/models":
            return httpx.Response(200, json=model_list("base", loaded))
        body = json.loads(request.content)
        calls.append((request.url.path, body))
        if request.url.path == "/v1/load_lora_adapter":
            LoadLoRAAdapterRequest.model_validate(body)
            assert set(body) <= declared(LoadLoRAAdapterRequest), set(body) - declared(LoadLoRAAdapterRequest)
            loaded[body["lora_name"]] = body["lora_path"]
            return httpx.Response(
                200, text=f"Success: LoRA adapter '{body['lora_name']}' added successfully."
            )
        if request.url.path == "/v1/unload_lora_adapter":
            UnloadLoRAAdapterRequest.model_validate(body)
            assert set(body) <= declared(UnloadLoRAAdapterRequest)
            loaded.pop(body["lora_name"])
            return httpx.Response(200, text="Success")
        assert request.url.path == "/v1/completions"
        req = CompletionRequest.model_validate(body)
        unknown = set(body) - declared(CompletionRequest)
        assert not unknown, f"vLLM would silently ignore {unknown}"
        n = req.max_tokens or 1
        ids = [7 + i for i in range(n)]
        lp = CompletionLogProbs(
            tokens=[f"token_id:{t}" for t in ids]
            if req.return_tokens_as_token_ids
            else [f"t{t}" for t in ids],
            token_logprobs=[-0.5 - i for i in range(n)],
            text_offset=list(range(n)),
            top_logprobs=[None] * n,
        )
        choice = CompletionResponseChoice(
            index=0,
            text="".join(f"t{t}" for t in ids),
            logprobs=lp,
            finish_reason="length",
            stop_reason=None,
            token_ids=ids if (req.return_token_ids and token_ids_field) else None,
            prompt_token_ids=list(req.prompt) if req.return_token_ids and token_ids_field else None,
        )
        resp = CompletionResponse(
            model=req.model or "base",
            choices=[choice],
            usage=UsageInfo(
                prompt_tokens=len(req.prompt), completion_tokens=n, total_tokens=len(req.prompt) + n
            ),
        )
        return httpx.Response(200, json=resp.model_dump(mode="json"))

    return handler


def backend(handler, mode: VLLMReloadMode = VLLMReloadMode.lora) -> VLLMBackend:  # noqa: ANN001
    b = VLLMBackend(
        BackendSpec(name="v0", url="http://vllm", kind=BackendKind.vllm), model_name="base", reload_mode=mode
    )
    b.client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://vllm")
    return b


@pytest.mark.parametrize(
    "sampling,ignore_eos",
    [
        (SamplingParams(max_tokens=4), False),
        (SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, seed=2**62, stop=["\n", "</s>"]), False),
        (SamplingParams(max_tokens=2, temperature=0.0, stop_token_ids=[5, 6]), True),
    ],
)
async def test_completion_requests_validate_and_responses_parse(sampling, ignore_eos) -> None:  # noqa: ANN001
    calls: list[tuple[str, dict]] = []
    b = backend(vllm_server(calls))
    prompt = [11, 12, 13]
    res = await b.complete(GenerateRequest(prompt, sampling, ignore_eos=ignore_eos))
    n = sampling.max_tokens
    assert res.token_ids == [7 + i for i in range(n)]
    assert res.logprobs == [-0.5 - i for i in range(n)]
    assert res.prompt_ids == prompt and res.finish_reason == "length"
    # raw requests (with ``raw=True`` the client path differs) go through the server's check too
    assert calls[-1][1]["prompt"] == prompt
    await b.aclose()


async def test_token_ids_spelled_in_logprobs_tokens_parse_too() -> None:
    calls: list[tuple[str, dict]] = []
    b = backend(vllm_server(calls, token_ids_field=False))
    res = await b.complete(GenerateRequest([1, 2], SamplingParams(max_tokens=3)))
    assert res.token_ids == [7, 8, 9] and res.prompt_ids == [1, 2]
    await b.aclose()


async def test_adapter_loads_validate_and_requests_name_the_jobs_adapter(tmp_path) -> None:
    calls: list[tuple[str, dict]] = []
    b = backend(vllm_server(calls))
    for v in (1, 2, 3):
        await b.load_weights(version=v, path=await version_dir(tmp_path, "job-a", v))
    served = await b.served()
    assert served is not None and served.adapters == {"job-a": 3}
    res = await b.complete(
        GenerateRequest([1, 2], SamplingParams(max_tokens=2), job_id="job-a", version=3, adapter="job-a-v3")
    )
    assert res.policy_version == 3
    assert CompletionRequest.model_validate(calls[-1][1]).model == "job-a-v3"
    assert ("/v1/unload_lora_adapter", {"lora_name": "job-a-v1"}) in calls
    await b.aclose()


async def test_vllm_error_response_is_a_client_error() -> None:
    err = ErrorResponse(
        error=ErrorInfo(message="max_tokens must be at least 1", type="BadRequestError", code=400)
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json=err.model_dump(mode="json"))

    b = backend(handler)
    with pytest.raises(BackendError) as e:
        await b.complete(GenerateRequest([1], SamplingParams(max_tokens=1)))
    assert e.value.kind is ErrorKind.client and "max_tokens" in e.value.detail
    await b.aclose()


def test_more_stop_strings_than_vllm_allows_are_refused_by_vllm() -> None:
    """vLLM 0.33.0 refuses more than VLLM_MAX_STOP_STRINGS (4) stop strings: a job that sets
    more fails every request on vLLM (the CPU engine accepts them)."""
    body = backend(lambda r: httpx.Response(200)).completion_body(
        GenerateRequest([1], SamplingParams(stop=["a", "b", "c", "d", "e"])), model="m"
    )
    with pytest.raises(ValueError, match="at most 4"):
        CompletionRequest.model_validate(body)
