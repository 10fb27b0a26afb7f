from __future__ import annotations

import pytest
import torch

from temper.policy import create_model, default_tokenizer, pad_batch, token_logprobs
from temper.training.sft import encode_pair, warm_start


def completion_nll(model, tok, messages, completion) -> float:
    ids, begin = encode_pair(tok, messages, completion)
    x, attn = pad_batch([ids], tok.pad_id)
    mask = torch.zeros_like(x)
    mask[0, begin:] = 1
    with torch.no_grad():
        return float(-token_logprobs(model, x, attn, mask).sum() / mask.sum())


@pytest.mark.timeout(120)
def test_warm_start_teaches_the_completion_and_only_the_completion():
    torch.manual_seed(0)
    tok = default_tokenizer()
    model = create_model("tiny", seed=1)
    messages = [{"role": "user", "content": "Write f(x) that returns x plus 2."}]
    answer = "```python solution.py\ndef f(x):\n    return x + 2\n```"
    before = completion_nll(model, tok, messages, answer)
    losses: list[float] = []
    stats = warm_start(
        model, tok, [(messages, answer)], steps=40, batch_size=4, on_step=lambda s, loss: losses.append(loss)
    )
    after = completion_nll(model, tok, messages, answer)
    assert stats.steps == 40 and len(losses) == 40
    assert after < before / 4, (before, after)
    # the prompt is context, not a target: its tokens are not learned
    ids, begin = encode_pair(tok, messages, answer)
    assert stats.tokens == 40 * 4 * (len(ids) - begin)


def test_warm_start_refuses_no_data():
    with pytest.raises(ValueError, match="at least one"):
        warm_start(create_model("tiny"), default_tokenizer(), [], steps=1)


def test_a_reply_shown_as_context_is_in_the_ids_and_out_of_the_loss():
    from temper.training.sft import encode_conversation

    tok = default_tokenizer()
    messages = [{"role": "user", "content": "Which word?"}]
    call, shown, answer = "run secret.py", "stdout: apple", "apple"
    trained_ids, trained_mask = encode_conversation(tok, messages, [call, shown, answer])
    ids, mask = encode_conversation(tok, messages, [{"content": call, "train": False}, shown, answer])
    assert ids == trained_ids  # the same conversation, token for token
    answer_tokens = len(tok.encode(answer)) + 1  # and the end-of-turn token
    assert sum(mask) == answer_tokens and mask[-answer_tokens:] == [True] * answer_tokens
    assert sum(trained_mask) == answer_tokens + len(tok.encode(call)) + 1
    with pytest.raises(ValueError, match="at least one reply the loss covers"):
        encode_conversation(tok, messages, {"content": answer, "train": False})
    with pytest.raises(ValueError, match="'train' must be true or false"):
        encode_conversation(tok, messages, {"content": answer, "train": "no"})


def test_warm_start_uses_the_betas_it_is_given():
    messages = [{"role": "user", "content": "Say hi."}]
    weights = []
    for betas in ((0.9, 0.999), (0.9, 0.99)):
        model = create_model("tiny", seed=1)
        warm_start(model, default_tokenizer(), [(messages, "hi")], steps=5, batch_size=2, betas=betas)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not torch.allclose(weights[0], weights[1]), "the second beta changed nothing"
