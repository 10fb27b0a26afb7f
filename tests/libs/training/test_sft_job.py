"""The sft job's loss: masked to the trained turns, cut into micro-batches like an RL
step, and learning a small dataset."""

from __future__ import annotations

import copy

import pytest
import torch

from temper.jobspec import AlgorithmSpec
from temper.policy import create_model, default_tokenizer
from temper.training import Learner, LearnerConfig
from temper.training.sft import encode_chat

TOK = default_tokenizer()


def conversation(question: str, answer: str, *, shown: str | None = None) -> tuple[list[dict], list[bool]]:
    messages = [{"role": "system", "content": "answer in one word"}, {"role": "user", "content": question}]
    trained = [False, False]
    if shown is not None:  # an earlier assistant turn that stays context (weight 0)
        messages += [{"role": "assistant", "content": shown}, {"role": "user", "content": "again"}]
        trained += [False, False]
    messages.append({"role": "assistant", "content": answer})
    trained.append(True)
    return messages, trained


def sft_learner(model: torch.nn.Module, **overrides) -> Learner:
    config = LearnerConfig.from_spec(AlgorithmSpec(name="sft", learning_rate=3e-3, **overrides))
    config.bf16 = False
    return Learner(model, config, device="cpu", pad_id=TOK.pad_id)


def reference_nll(model: torch.nn.Module, encoded: list[tuple[list[int], list[bool]]]) -> torch.Tensor:
    """The mean negative log-likelihood of the masked tokens, one sequence at a time, from
    the model's own logits (no Temper code on the way)."""
    total, count = torch.zeros(()), 0
    for ids, mask in encoded:
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, x[0, 1:, None])[:, 0]
        m = torch.tensor(mask[1:], dtype=torch.float32)
        total = total - (logp * m).sum()
        count += int(m.sum())
    return total / count


def test_the_loss_covers_the_trained_turns_only_and_matches_a_reference(monkeypatch):
    model = create_model("tiny", seed=3)
    data = [
        encode_chat(TOK, *conversation("colour of the sky?", "blue", shown="green")),
        encode_chat(TOK, *conversation("capital of France?", "Paris")),
        encode_chat(TOK, *conversation("two plus two?", "four", shown="five")),
    ]
    # the shown turn ("green") is in the ids but not the mask
    ids, mask = data[0]
    assert TOK.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special=False) == "blue<|end|>"
    assert "green" in TOK.decode(ids)
    reference_model = copy.deepcopy(model)
    expected_loss = reference_nll(reference_model, data)
    expected_loss.backward()
    expected = float(expected_loss.detach())
    # micro-batches of one row each: the step's loss and gradient must not depend on the cut
    learner = sft_learner(model, max_tokens_per_microbatch=64)
    learner.optimizer.step = lambda *a, **k: None  # keep the weights: compare the gradient
    grads: dict[str, torch.Tensor] = {}

    def keep(*_a, **_k):
        for name, p in learner.model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.detach().clone()
        return torch.tensor(0.0)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", keep)
    stats = learner.step_conversations(data)
    assert stats.micro_batches == 3
    assert stats.model_tokens == sum(sum(m[1:]) for _, m in data)
    assert stats.loss == pytest.approx(expected, rel=1e-5)
    assert stats.pg_loss == pytest.approx(expected, rel=1e-5)
    for name, p in reference_model.named_parameters():
        if p.grad is not None and p.grad.abs().sum() > 0:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


def test_an_untrained_turn_changes_nothing_of_the_loss():
    model = create_model("tiny", seed=3)
    learner = sft_learner(model)
    with_turn = encode_chat(TOK, *conversation("colour?", "blue", shown="a very different earlier reply"))
    only = encode_chat(TOK, *conversation("colour?", "blue", shown="x"))
    # the same trained tokens; the loss differs only through the context, never counts it
    assert sum(with_turn[1]) == sum(only[1])
    stats = learner.step_conversations([with_turn])
    assert stats.model_tokens == sum(with_turn[1][1:])


@pytest.mark.timeout(120)
def test_the_sft_loss_falls_on_a_learnable_dataset():
    torch.manual_seed(0)
    pairs = [("colour of the sky?", "blue"), ("capital of France?", "Paris"), ("two plus two?", "four")]
    data = [encode_chat(TOK, *conversation(q, a)) for q, a in pairs]
    learner = sft_learner(create_model("tiny", seed=1))
    losses = [learner.step_conversations(data).loss for _ in range(30)]
    assert losses[-1] < losses[0] / 4, losses
    assert learner.step_count == 30


def test_an_rl_learner_refuses_the_sft_step():
    learner = Learner(create_model("tiny"), LearnerConfig(), device="cpu")
    with pytest.raises(ValueError, match="sft step"):
        learner.step_conversations([encode_chat(TOK, *conversation("q", "a"))])


def test_a_conversation_is_encoded_as_the_warm_start_and_an_episode_grow_it():
    from temper.training.sft import encode_conversation

    messages = [
        {"role": "user", "content": "Which word?"},
        {"role": "assistant", "content": "run secret.py"},
        {"role": "tool", "content": "stdout: apple"},
        {"role": "assistant", "content": "apple"},
    ]
    chat = encode_chat(TOK, messages, [False, False, False, True])
    warm = encode_conversation(
        TOK, messages[:1], [{"content": "run secret.py", "train": False}, "stdout: apple", "apple"]
    )
    assert chat == warm


def test_tool_calls_are_trained_as_the_template_writes_them():
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "5"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "ok"},
    ]
    ids, mask = encode_chat(TOK, messages, [False, True, False, False, True])
    trained = TOK.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special=False)
    assert trained == '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><|end|>ok<|end|>'
    assert TOK.decode(ids, skip_special=False) == (
        '<|bos|><|user|>add<|end|><|assistant|><tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        "<|end|><|tool|>5<|end|><|user|>thanks<|end|><|assistant|>ok<|end|>"
    )
