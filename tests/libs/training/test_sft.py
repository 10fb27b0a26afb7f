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
