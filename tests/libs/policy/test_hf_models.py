"""Real architectures from Hugging Face model directories: small random configs of Qwen2,
Qwen3, Llama, Mistral and Phi-3 with BPE tokenizers trained here, saved sharded, loaded
with ``AutoModelForCausalLM``/``AutoTokenizer``, generating with the CPU engine."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from services.inference_gateway.cpu_server.runner import GenRequest, ModelRunner, SamplingParams
from temper.policy import ChatTokenizer, load_model, token_logprobs
from temper.policy.build import ARCHITECTURES, build_model_dir, train_tokenizer

pytestmark = pytest.mark.timeout(120)

CORPUS = [
    "Compute 17 * 23 with python and give the answer.",
    'print(17 * 23) {"name": "python", "arguments": {"code": "print(2 + 2)"}}',
    "The answer is \\boxed{391}. def add(a, b):\n    return a + b\n",
] * 30


@pytest.fixture(scope="module")
def chatml() -> ChatTokenizer:
    return train_tokenizer(CORPUS, template="chatml", vocab_size=400)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_architecture_round_trips_through_a_sharded_model_directory(arch, chatml, tmp_path):
    d = build_model_dir(tmp_path / arch, arch, chatml, seed=1, max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "the weights are sharded"
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == chatml.stop_ids

    model, tok = load_model(d)
    assert type(model).__name__.lower().startswith(arch)
    # the loaded tokenizer is the trained one, whatever tokenizer class the model type suggests
    for text in CORPUS[:3]:
        assert tok.encode(text) == chatml.encode(text)
    assert model.config.model_type == ARCHITECTURES[arch]["model_type"]
    assert tok.stop_ids == chatml.stop_ids and tok.vocab_size == chatml.vocab_size
    # every tensor in the shards is the loaded model's
    state = model.state_dict()
    for shard in set(index["weight_map"].values()):
        for name, tensor in load_file(str(d / shard)).items():
            assert torch.equal(state[name], tensor), name

    # the engine samples with the model's own stop ids, and reports the logprobs the trainer recomputes
    prompt = tok.render([{"role": "user", "content": "Compute 17 * 23."}])
    engine = ModelRunner(model, tok)
    [out] = engine.generate([GenRequest(prompt, SamplingParams(max_tokens=6, seed=3))])
    assert len(out.token_ids) == len(out.logprobs) >= 1
    ids = torch.tensor([prompt + out.token_ids])
    mask = torch.zeros_like(ids)
    mask[0, len(prompt) :] = 1
    recomputed = token_logprobs(model, ids, None, mask)[0, len(prompt) :]
    assert recomputed.tolist() == pytest.approx(out.logprobs, abs=1e-4)


def test_the_engine_stops_on_the_generation_configs_end_of_turn(chatml, tmp_path):
    d = build_model_dir(tmp_path / "m", "qwen2", chatml)
    model, tok = load_model(d)
    im_end = int(tok.hf.convert_tokens_to_ids("<|im_end|>"))
    prompt = tok.render([{"role": "user", "content": "hi"}])
    with torch.no_grad():  # make <|im_end|> the only likely first token: its row is the last hidden state
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        model.lm_head.weight.zero_()
        model.lm_head.weight[im_end] = 50.0 * hidden / hidden.norm()
    [out] = ModelRunner(model, tok).generate(
        [GenRequest(prompt, SamplingParams(max_tokens=5, temperature=0))]
    )
    assert out.token_ids == [im_end] and out.finish_reason == "stop"


def test_a_directory_without_a_chat_template_is_refused_by_name(chatml, tmp_path):
    d = build_model_dir(tmp_path / "m", "llama", chatml)
    (d / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no chat template"):
        load_model(d)


async def test_a_model_directory_in_object_storage_gives_its_tokenizer(chatml, tmp_path):
    from temper.policy.tokenizer import byte_tokenizer, fetch_policy_tokenizer, policy_tokenizer
    from temper.storage import LocalStore

    d = build_model_dir(tmp_path / "m", "qwen3", chatml)
    store = LocalStore(tmp_path / "objects")
    for f in d.iterdir():
        await store.put(f"models/qwen3-tiny/{f.name}", f.read_bytes())
    assert policy_tokenizer("models/qwen3-tiny") is byte_tokenizer()  # not fetched yet: a plain name
    await fetch_policy_tokenizer(store, "models/qwen3-tiny", None, tmp_path / "cache")
    tok = policy_tokenizer("models/qwen3-tiny")
    msgs = [{"role": "user", "content": "Compute 17 * 23."}]
    assert tok.render(msgs) == chatml.render(msgs) and tok.stop_ids == chatml.stop_ids
    assert policy_tokenizer(str(d)).render(msgs) == chatml.render(msgs)  # a local directory
