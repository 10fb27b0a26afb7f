from __future__ import annotations

import pytest
import torch

from temper.policy import create_model, default_tokenizer, encode_chat, load_weights
from temper.storage import LocalStore
from temper.training import Learner, LearnerConfig
from temper.training.learner import optimizer_key
from temper.trajectory import Segment, Trajectory

pytestmark = pytest.mark.timeout(90)

TOK = default_tokenizer()
PROMPT = encode_chat(TOK, [{"role": "user", "content": "Is it?"}])


def answer(learner: Learner, text: str, reward: float, n: int) -> Trajectory:
    """A trajectory with the answer ``text``; behaviour logprobs from the learner's own policy."""
    ids = TOK.encode(text) + [TOK.stop_ids[0]]
    draft = Trajectory(
        job_id="j",
        episode_id=f"e{n}",
        task_id="t",
        group_id="g",
        reward=reward,
        segments=[
            Segment(role="prompt", token_ids=PROMPT),
            Segment(role="model", token_ids=ids, logprobs=[0.0] * len(ids), policy_version=learner.version),
        ],
    )
    lp = learner.logprobs(draft)[len(PROMPT) :]
    draft.segments[1].logprobs = lp
    return draft


def seq_logprob(learner: Learner, text: str) -> float:
    return sum(answer(learner, text, 0.0, 0).segments[1].logprobs or [])


def test_a_few_steps_raise_the_probability_of_the_rewarded_answer():
    learner = Learner(create_model(seed=3), LearnerConfig(learning_rate=3e-3), device="cpu")
    before = {t: seq_logprob(learner, t) for t in ("yes", "no")}
    for step in range(6):
        group = [answer(learner, t, r, i) for i, (t, r) in enumerate([("yes", 1.0), ("no", 0.0)] * 2)]
        stats = learner.step([group])
        assert stats.updated and stats.step == step + 1
        assert stats.clip_fraction == 0.0 and stats.abs_log_ratio < 1e-4, "on-policy: every ratio is 1"
    after = {t: seq_logprob(learner, t) for t in ("yes", "no")}
    assert after["yes"] > before["yes"] + 1.0
    assert after["no"] < before["no"] - 1.0


async def test_checkpoint_round_trip(tmp_path):
    store = LocalStore(tmp_path / "objects")
    cfg = LearnerConfig(learning_rate=1e-3)
    a = Learner(create_model(seed=4), cfg, device="cpu")
    group = [answer(a, t, r, i) for i, (t, r) in enumerate([("yes", 1.0), ("no", 0.0), ("ok", 0.5)])]
    a.step([group])
    a.step([group])
    keys = await a.save_checkpoint(store, "tenants/t/jobs/j/checkpoints/v1.safetensors", version=1)
    assert keys == ["tenants/t/jobs/j/checkpoints/v1.safetensors", optimizer_key(keys[0])]
    assert keys[1] == "tenants/t/jobs/j/checkpoints/v1.optimizer.safetensors"

    b = Learner(create_model(seed=99), cfg, device="cpu")
    await b.load_checkpoint(store, keys[0])
    assert (b.step_count, b.version) == (2, 1)
    v1_embeddings = b.model.model.embed_tokens.weight.detach().clone()
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for idx, state in sa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, sb["state"][idx][name]), (idx, name)

    # Training on from the checkpoint is exactly training on without stopping.
    a.step([group])
    b.step([group])
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-7)

    # The weights file alone is what the inference gateway loads.
    c = create_model(seed=5)
    path = tmp_path / "w.safetensors"
    path.write_bytes(await store.get(keys[0]))
    load_weights(c, path)
    assert torch.equal(c.model.embed_tokens.weight, v1_embeddings)
    assert c.lm_head.weight.data_ptr() == c.model.embed_tokens.weight.data_ptr()


def test_kl_to_the_reference_grows_as_the_policy_moves():
    learner = Learner(create_model(seed=6), LearnerConfig(learning_rate=3e-3, kl_coef=0.1), device="cpu")
    assert learner.reference is not None
    kls = []
    for _ in range(3):
        group = [answer(learner, t, r, i) for i, (t, r) in enumerate([("yes", 1.0), ("no", 0.0)])]
        kls.append(learner.step([group]).kl)
    assert kls[0] == pytest.approx(0.0, abs=1e-7)
    assert kls[-1] > kls[0]


@pytest.mark.gpu
def test_the_same_step_runs_on_cuda_in_bf16():
    learner = Learner(create_model(seed=3), LearnerConfig(learning_rate=3e-3), device="cuda")
    assert learner.autocast_enabled
    group = [answer(learner, t, r, i) for i, (t, r) in enumerate([("yes", 1.0), ("no", 0.0)] * 2)]
    stats = learner.step([group])
    assert stats.updated and stats.tokens_per_s > 0
    assert next(learner.model.parameters()).dtype == torch.float32


def test_completion_logprobs_equal_token_logprobs():
    from temper.policy import pad_batch, token_logprobs
    from temper.training.learner import completion_logprobs

    model = create_model(seed=8)
    seqs = [PROMPT + TOK.encode("hello") + [TOK.stop_ids[0]], PROMPT + TOK.encode("no")]
    ids, attention = pad_batch(seqs, TOK.pad_id)
    completion = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(seqs):
        completion[i, len(PROMPT) : len(s)] = True
    completion[0, 2] = True  # a stray prompt position marked too: both must agree on it
    want = token_logprobs(model, ids, attention, completion)
    got = completion_logprobs(model, ids, attention, completion)
    assert torch.allclose(got, want, atol=1e-5)
    assert (got[~completion] == 0).all()
