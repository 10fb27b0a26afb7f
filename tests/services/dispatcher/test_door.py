"""Validation at the door: each bad input answers its 4xx with the one error shape
(``{"detail", "errors": [{"field", "message"}]}``), quickly, and nothing is stored."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.services.dispatcher.conftest import SPEC

pytestmark = pytest.mark.timeout(60)


def spec(**changes):
    data = yaml.safe_load(yaml.safe_dump(SPEC))
    for path, value in changes.items():
        node = data
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


async def nothing_stored(client) -> bool:
    return (await client.get("/v1/jobs", params={"state": "pending"})).json()["total"] == 0


def one_shape(body: dict) -> None:
    assert set(body) == {"detail", "errors"}, body
    assert isinstance(body["detail"], str)
    assert all(set(e) == {"field", "message"} for e in body["errors"]), body


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        (
            {"environment__kind": "browser"},
            "environment.kind",
            "installed: agent (temper), code (temper), math (temper), shell (temper)",
        ),
        ({"environment__kind": "cod"}, "environment.kind", "did you mean 'code'?"),
        ({"rewards": {"test_passed": 1.0}}, "rewards.test_passed", "did you mean 'tests_passed'?"),
        ({"policy__model": "gpt-17"}, "policy.model", "unknown model 'gpt-17'"),
        ({"policy__backend_pool": "gpu-9"}, "policy.backend_pool", "allowed: default"),
        ({"tasks__taskset": "ts-acm"}, "tasks.taskset", "did you mean 'ts-acme'?"),
        ({"tasks__taskset": "adder"}, "tasks.taskset", "did you mean 'adders'?"),  # by name too
        ({"tasks__taskset": "theirs"}, "tasks.taskset", "unknown task set 'theirs'"),  # another tenant's name
        ({"algorithm__name": "ppo"}, "algorithm.name", "ppo"),  # not built (dpo is a job now)
        ({"schedule__iterations": "5"}, "schedule.iterations", "valid integer"),
        ({"algorithm__skip_zero_variance": "yes"}, "algorithm.skip_zero_variance", "valid boolean"),
        ({"policy__sampling__temperature": "0.7"}, "policy.sampling.temperature", "valid number"),
        ({"tracking__mlflow__uri": "ftp://mlflow:5000"}, "tracking.mlflow.uri", "http:// or https://"),
        ({"tracking__mlflow__uri": "http://"}, "tracking.mlflow.uri", "with a host"),
        ({"tracking__mlflow__uri": "http://me:pw@mlflow:5000"}, "tracking.mlflow.uri", "credentials"),
        ({"tracking__mlflow__uri": "http://mlflow:99999"}, "tracking.mlflow.uri", "invalid port"),
        (
            {"tracking__wandb__project": "p", "tracking__wandb__mode": "online"},
            "tracking.wandb.mode",
            "only 'offline'",
        ),  # fmt: skip
        (
            {"tracking__wandb__project": "p", "tracking__wandb__mode": "shared"},
            "tracking.wandb.mode",
            "only 'offline' is supported (got 'shared')",
        ),  # fmt: skip
        ({"tracking__wandb__project": "has space"}, "tracking.wandb.project", "pattern"),
        ({"tracking__wandb__mode": "offline"}, "tracking.wandb.project", "required"),
    ],
)
async def test_each_bad_name_or_type_is_a_422_naming_the_field(client, changes, field, says):
    r = await client.post("/v1/jobs", json=spec(**changes))
    assert r.status_code == 422, r.text
    one_shape(r.json())
    messages = {e["field"]: e["message"] for e in r.json()["errors"]}
    assert field in messages, r.json()
    assert says in messages[field], messages[field]
    assert await nothing_stored(client)


async def test_a_wandb_tracked_job_is_accepted_and_stored_resolved(client):
    r = await client.post("/v1/jobs", json=spec(tracking__wandb__project="code-agents"))
    assert r.status_code == 201, r.text
    stored = (await client.get(f"/v1/jobs/{r.json()['id']}")).json()["spec"]["tracking"]
    assert stored == {"mlflow": None, "wandb": {"project": "code-agents", "mode": "offline"}}


async def test_every_bad_name_is_named_at_once(client):
    r = await client.post(
        "/v1/jobs", json=spec(environment__kind="browser", rewards={"test_passed": 1}, policy__model="nope")
    )
    assert r.status_code == 422
    assert {e["field"] for e in r.json()["errors"]} == {
        "environment.kind",
        "rewards.test_passed",
        "policy.model",
    }


async def test_a_model_directory_here_is_a_known_model(client, tmp_path):
    (tmp_path / "m").mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / "m" / name).write_text("{}")
    r = await client.post("/v1/jobs", json=spec(policy__model=str(tmp_path / "m")))
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    "files,missing",
    [
        (["config.json"], "no tokenizer.json, model.safetensors"),
        (["config.json", "tokenizer.json"], "no model.safetensors"),
        (["tokenizer.json", "model.safetensors"], "no config.json"),
    ],
)
async def test_an_incomplete_model_directory_is_refused_naming_what_it_lacks(
    client, tmp_path, files, missing
):
    for field in ("policy__model", "policy__init"):
        d = tmp_path / field
        d.mkdir()
        for name in files:
            (d / name).write_text("{}")
        r = await client.post("/v1/jobs", json=spec(**{field: str(d)}))
        assert r.status_code == 422, r.text
        (error,) = r.json()["errors"]
        assert error["field"] == field.replace("__", ".") and error["message"].endswith(missing), error
    assert await nothing_stored(client)


async def test_a_sharded_model_directory_needs_every_shard_its_index_names(client, tmp_path):
    d = tmp_path / "sharded"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors"):
        (d / name).write_text("{}")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    r = await client.post("/v1/jobs", json=spec(policy__model=str(d)))
    assert r.status_code == 422 and "no model-00002-of-00002.safetensors" in r.text, r.text


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "", "image/png"])
async def test_bodies_that_are_not_json_or_yaml_are_415(client, ctype):
    r = await client.post("/v1/jobs", content=json.dumps(spec()).encode(), headers={"content-type": ctype})
    assert r.status_code == 415, r.text
    one_shape(r.json())
    assert await nothing_stored(client)


async def test_a_yaml_alias_bomb_is_refused_quickly(client):
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 9):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    bomb = ("\n".join(lines) + "\nname: *i\n").encode()
    assert len(bomb) < 600  # 9**9 strings once expanded
    start = time.monotonic()
    r = await client.post("/v1/jobs", content=bomb, headers={"content-type": "application/yaml"})
    assert time.monotonic() - start < 2.0
    assert r.status_code == 422 and "aliases" in r.json()["detail"], r.text
    assert await nothing_stored(client)


async def test_plain_yaml_anchors_without_aliases_still_work(client):
    text = yaml.safe_dump(spec(name="anchored")).replace("name: anchored", "name: &n anchored")
    r = await client.post("/v1/jobs", content=text, headers={"content-type": "application/yaml"})
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("ctype", ["application/json", "application/yaml"])
async def test_json_nested_500_or_more_levels_is_a_422(client, ctype):
    for depth in (500, 100_000):
        body = spec()
        body["environment"]["limits"] = json.loads("[" * 500 + "]" * 500) if depth == 500 else None
        text = json.dumps(body) if depth == 500 else '{"name": ' + "[" * depth + "]" * depth + "}"
        r = await client.post("/v1/jobs", content=text, headers={"content-type": ctype})
        assert r.status_code == 422, r.text[:300]
        assert "nested deeper" in r.json()["detail"], r.text[:300]


async def test_integers_past_64_bits_in_the_body_are_a_422(client):
    for value in (2**63, -(2**63) - 1, 10**30):
        r = await client.post("/v1/jobs", json=spec(tasks__seed=value))
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["field"] == "tasks.seed"
    r = await client.post("/v1/jobs", json=spec(tasks__seed=2**63 - 1))
    assert r.status_code == 201, r.text


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/v1/jobs", {"offset": str(2**64)}),
        ("/v1/jobs", {"limit": str(10**30)}),
        ("/v1/jobs/job-finished/episodes", {"iteration": str(2**63)}),
        ("/v1/jobs/job-finished/episodes", {"offset": "99999999999999999999999"}),
        ("/v1/jobs/job-finished/metrics", {"pass_threshold": "1e400"}),
        ("/v1/jobs/job-finished/episodes", {"min_reward": "nan"}),
    ],
)
async def test_integers_past_64_bits_in_query_parameters_are_a_422(client, path, params):
    r = await client.get(path, params=params)
    assert r.status_code == 422, r.text
    one_shape(r.json())
    assert r.json()["errors"][0]["field"].startswith("query.")


async def test_a_key_id_past_64_bits_is_a_422(client):
    r = await client.delete(f"/v1/keys/{2**70}")
    assert r.status_code == 422, r.text
    one_shape(r.json())


async def test_a_huge_input_is_not_echoed_back(client):
    huge = "x" * 500_000  # under the 1 MiB spec limit: refused for what it says, not its size
    for body in (spec(environment__kind=huge), spec(schedule__iterations=huge), spec(rewards={huge: 1.0})):
        r = await client.post("/v1/jobs", json=body)
        assert r.status_code == 422
        assert len(r.content) < 10_000, len(r.content)
    r = await client.post("/v1/tenants", json={"name": huge})
    assert r.status_code in (403, 422) and len(r.content) < 10_000
    r = await client.get("/v1/jobs", params={"state": "y" * 50_000})
    assert r.status_code == 422 and len(r.content) < 10_000, len(r.content)


async def test_an_oversized_spec_is_a_413_in_every_form(client):
    body = spec()
    body["environment"]["system_prompt"] = "y" * (2 << 20)
    big = json.dumps(body).encode()
    r = await client.post("/v1/jobs", json=body)
    assert (
        r.status_code == 413
        and "the job spec is larger than its limit of 1048576 bytes" in r.json()["detail"]
    )
    r = await client.post(
        "/v1/jobs", content=yaml.safe_dump(body), headers={"content-type": "application/yaml"}
    )
    assert r.status_code == 413
    r = await client.post("/v1/jobs", files={"spec": ("spec.json", big, "application/json")})
    assert r.status_code == 413
    sent = []

    async def chunks():  # no Content-Length: refused by the bytes received, before the end
        for i in range(64):
            sent.append(i)
            yield b" " * (64 << 10)

    r = await client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and len(sent) < 64, len(sent)
    assert await nothing_stored(client)


async def test_task_set_uploads_have_their_limit_and_a_prompt_has_one(client):
    r = await client.post(
        "/v1/tasksets", params={"name": "huge", "validate": "false"}, content=b"x" * ((64 << 20) + 1),
        headers={"content-type": "application/x-ndjson"},
    )  # fmt: skip
    assert r.status_code == 413 and "the task set is larger than its limit" in r.json()["detail"]
    task = {"id": "t1", "kind": "math", "prompt": "y" * ((1 << 20) + 1), "answer": "1"}
    r = await client.post(
        "/v1/tasksets", params={"name": "long-prompt", "validate": "false"}, content=json.dumps(task).encode(),
        headers={"content-type": "application/x-ndjson"},
    )  # fmt: skip
    assert r.status_code == 422, r.text
    assert "prompt" in r.text and "1048576" in r.text, r.text


async def test_request_validation_errors_have_the_same_shape(client, seeded):
    r = await client.get("/v1/jobs", params={"limit": "many"})
    assert r.status_code == 422
    one_shape(r.json())
    assert r.json()["errors"][0]["field"] == "query.limit"
    r = await client.get("/v1/jobs/nope")
    assert r.status_code == 404 and set(r.json()) == {"detail", "errors"}


def aware(value: str) -> bool:
    from datetime import datetime

    return datetime.fromisoformat(value.replace("Z", "+00:00")).utcoffset() is not None


async def test_every_timestamp_is_aware_utc_on_sqlite(client, seeded):
    posted = (await client.post("/v1/jobs", json=spec(name="stamped"))).json()
    got = (await client.get(f"/v1/jobs/{posted['id']}")).json()
    assert posted["created_at"] == got["created_at"] and got["created_at"].endswith("Z"), got
    bodies = [
        got,
        (await client.get("/v1/jobs/job-finished")).json(),
        *(await client.get("/v1/jobs")).json()["items"],
        *(await client.get("/v1/jobs/job-finished/episodes")).json()["items"],
        (await client.get("/v1/tenant")).json(),
        *(await client.get("/v1/keys")).json(),
    ]
    stamps = [v for b in bodies for k, v in b.items() if k.endswith("_at") and v is not None]
    assert len(stamps) > 10 and all(aware(v) for v in stamps), [v for v in stamps if not aware(v)]


def test_the_dispatcher_does_not_import_torch():
    """Checking model names must not load torch into the API process (about 900 MB)."""
    import subprocess
    import sys

    code = "import sys, services.dispatcher.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


async def test_unknown_query_parameters_are_a_422(client):
    r = await client.get("/v1/jobs", params={"stat": "failed"})
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == [{"field": "query.stat", "message": "unknown query parameter"}]
    assert (await client.get("/v1/jobs", params={"state": "failed"})).status_code == 200
    r = await client.get("/v1/jobs", params=[("cursor", "a"), ("cursor", "")])
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "query.cursor", r.text


async def test_a_body_that_is_not_json_is_refused_in_the_same_shape(client):
    r = await client.post("/v1/keys", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    one_shape(r.json())
    deep = b"[" * 100_000 + b"]" * 100_000
    r = await client.post("/v1/keys", content=deep, headers={"content-type": "application/json"})
    assert r.status_code in (400, 422), r.text[:300]
    one_shape(r.json())


def test_the_schema_declares_one_error_shape_and_text_metrics(app):
    schema = app.openapi()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, item in schema["paths"].items():
        for method, op in item.items():
            for status, response in op["responses"].items():
                if status.startswith(("4", "5")) and path != "/health":
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref == "#/components/schemas/Problem", (method, path, status)
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "503" in schema["paths"]["/health"]["get"]["responses"]
    assert "415" in schema["paths"]["/v1/jobs"]["post"]["responses"]


async def test_a_malformed_multipart_form_is_a_422(client):
    boundary = "9cc651cd2c8d168349f50fede4c361ac"
    body = f"--{boundary}\r\nFalse--{boundary}--\r\n".encode()
    r = await client.post(
        "/v1/jobs", content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}"}
    )
    assert r.status_code == 422, r.text
    one_shape(r.json())
    assert await nothing_stored(client)


async def test_yaml_exponent_floats_are_numbers_and_quoted_ones_are_not(client):
    text = yaml.safe_dump(spec(name="lr")) + "algorithm: {learning_rate: 1e-5}\n"
    r = await client.post("/v1/jobs", content=text, headers={"content-type": "application/yaml"})
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["algorithm"]["learning_rate"] == 1e-5
    text = yaml.safe_dump(spec(name="lr")) + "algorithm: {learning_rate: '1e-5'}\n"
    r = await client.post("/v1/jobs", content=text, headers={"content-type": "application/yaml"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "algorithm.learning_rate", r.text


async def test_nan_and_infinity_are_refused(client):
    body = json.dumps(spec()).replace('"tests_passed": 1.0', '"tests_passed": NaN')
    r = await client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "rewards.tests_passed", r.text
    text = yaml.safe_dump(spec()).replace("tests_passed: 1.0", "tests_passed: .inf")
    r = await client.post("/v1/jobs", content=text, headers={"content-type": "application/yaml"})
    assert r.status_code == 422 and "finite" in r.json()["detail"], r.text


def _hub_model(directory, name: str) -> str:
    """A model directory with a real-shaped tokenizer and chat template (the weights'
    files present but not read: the door loads only the tokenizer)."""
    from tests.libs.policy.real_templates import save_as_on_a_hub, tokenizer

    save_as_on_a_hub(tokenizer(name, vocab_size=400), directory)
    for f in ("config.json", "model.safetensors"):
        (directory / f).write_text("{}")
    return str(directory)


GEMMA_SYSTEM = (
    "Fix the code. Tools: bash(command), python(code), write_file(path, content), read_file(path), "
    "submit(). Call one in a ```tool_code block."
)


async def test_a_template_that_cannot_render_a_tool_turn_is_refused_with_its_own_error(client, tmp_path):
    """Gemma 3's template has no tool role: results as tool messages are refused at the
    door with the template's words, under the model's field; as user turns the job goes in."""
    model = _hub_model(tmp_path / "gemma", "gemma3")
    env = {"kind": "code", "max_turns": 3, "action_format": "tool_code", "system_prompt": GEMMA_SYSTEM}
    started = time.perf_counter()
    r = await client.post("/v1/jobs", json=spec(policy__model=model, environment=env))
    assert r.status_code == 422, r.text
    one_shape(r.json())
    (error,) = r.json()["errors"]
    assert error["field"] == "policy.model", error
    assert "its chat template cannot render this job's episodes" in error["message"]
    assert "Conversation roles must alternate user/assistant/user/assistant/..." in error["message"]
    assert time.perf_counter() - started < 10
    assert await nothing_stored(client)
    r = await client.post(
        "/v1/jobs", json=spec(policy__model=model, environment={**env, "tool_role": "user"})
    )
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["environment"]["tool_role"] == "user"


async def test_a_template_that_drops_the_tools_is_refused_unless_the_prompt_names_them(client, tmp_path):
    model = _hub_model(tmp_path / "gemma", "gemma3")
    env = {"kind": "code", "max_turns": 3, "action_format": "tool_code", "tool_role": "user"}
    r = await client.post("/v1/jobs", json=spec(policy__model=model, environment=env))
    assert r.status_code == 422, r.text
    (error,) = r.json()["errors"]
    assert error["field"] == "policy.model" and "the chat template ignores tools" in error["message"], error
    assert "describe the tools in environment.system_prompt" in error["message"]


@pytest.mark.parametrize(
    ("name", "parser"), [("mistral-v0.3", "mistral"), ("llama3.1", "llama3_json"), ("qwen2.5", "hermes")]
)
async def test_templates_with_tools_pass_the_door(client, tmp_path, name, parser):
    model = _hub_model(tmp_path / name, name)
    env = {"kind": "code", "max_turns": 3, "action_format": parser}
    r = await client.post("/v1/jobs", json=spec(policy__model=model, environment=env))
    assert r.status_code == 201, r.text
    # policy.init gives the tokenizer when policy.model is a served name: its field is named
    r = await client.post(
        "/v1/jobs",
        json=spec(
            policy__init=_hub_model(tmp_path / "g", "gemma3"),
            environment={**env, "action_format": "tool_code"},
        ),
    )
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "policy.init", r.text
