"""A step that runs each group's prompt once must learn exactly what the plain step learns."""

from __future__ import annotations

import random

import pytest
import torch

from temper.policy import create_model, default_tokenizer
from temper.training import Learner, LearnerConfig
from temper.training.batch import Sample, collate
from temper.training.learner import completion_logprobs
from temper.training.prompts import prompt_length, prompt_micro_batches, shared_prompt_logprobs

pytestmark = pytest.mark.timeout(120)

TOK = default_tokenizer()


def sample(prompt: list[int], own: list[tuple[list[int], bool]], advantage: float, **kw) -> Sample:
    """``prompt`` then pieces of (ids, the model's?): a multi-turn sample has several."""
    ids, mask = list(prompt), [False] * len(prompt)
    for piece, model in own:
        ids += piece
        mask += [model] * len(piece)
    return Sample(ids, mask, [-1.0 if m else 0.0 for m in mask], advantage, 0.0, **kw)


def batch_of_groups(seed: int) -> list[Sample]:
    """Groups of different prompt lengths and sizes, one-turn and multi-turn samples, a
    sample that is all prompt and an overlong one under ``filter``."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(0, 250) for _ in range(n)]

    out: list[Sample] = []
    for n_prompt, size in ((37, 4), (12, 3), (50, 1), (25, 5)):
        prompt = words(n_prompt)
        for _ in range(size):
            if rng.random() < 0.3:  # an agent's turns: model, observation, model
                own = [
                    (words(rng.randrange(3, 9)), True),
                    (words(6), False),
                    (words(rng.randrange(2, 7)), True),
                ]
            else:
                own = [(words(rng.randrange(1, 20)), True)]
            out.append(sample(prompt, own, rng.uniform(-1, 1)))
    out.append(sample(words(9), [], 0.5))  # nothing of the model's: nothing scored
    out.append(sample(words(9), [(words(5), True)], 0.7, filtered=True))
    return out


def test_the_shared_forward_gives_the_plain_forwards_logprobs_and_entropy():
    model = create_model(seed=5)
    samples = batch_of_groups(1)
    b = collate(samples, TOK.pad_id)
    want_entropy: list[torch.Tensor] = []
    got_entropy: list[torch.Tensor] = []
    want = completion_logprobs(model, b.input_ids, b.attention_mask, b.completion_mask, want_entropy)
    got = shared_prompt_logprobs(model, samples, b, TOK.pad_id, got_entropy)
    assert got.shape == want.shape
    assert (got[~b.completion_mask] == 0).all()
    assert int((got != 0).sum()) == int(b.completion_mask[:, 1:].sum()) > 40
    assert torch.allclose(got, want, atol=2e-5), float((got - want).abs().max())
    assert torch.allclose(got_entropy[0], want_entropy[0], atol=2e-5)


@pytest.mark.parametrize("budget", [8192, 96])
def test_a_step_that_shares_prompts_makes_the_plain_steps_gradient(budget):
    samples = batch_of_groups(2)
    grads = {}
    for share in (False, True):
        learner = Learner(
            create_model(seed=6),
            LearnerConfig(learning_rate=1e-3, share_prompts=share, micro_batch_tokens=budget),
            device="cpu",
        )
        assert learner._shares_prompts() is share
        copies = [
            Sample(s.ids, s.mask, s.behaviour_logprobs, s.advantage, 0.0, filtered=s.filtered)
            for s in samples
        ]
        acc = learner.backward(copies)
        grads[share] = ([p.grad.clone() for p in learner.model.parameters()], acc)
    (plain, a), (shared, b) = grads[False], grads[True]
    assert a.tokens > 0 and b.tokens > 0
    assert abs(a.loss - b.loss) < 1e-5 * max(1.0, abs(a.loss))
    assert abs(a.entropy - b.entropy) < 1e-3 * max(1.0, abs(a.entropy))
    for x, y in zip(plain, shared, strict=True):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-4), float((x - y).abs().max())
    assert any(float(x.abs().max()) > 1e-4 for x in plain), "the gradient is not all zeros"


def test_micro_batches_keep_a_groups_prompt_together_and_respect_the_budget():
    samples = batch_of_groups(3)
    for budget in (8192, 200, 60, 8):
        batches = prompt_micro_batches(samples, budget)
        assert sorted(id(s) for mb in batches for s in mb) == sorted(id(s) for s in samples)
        for mb in batches:
            prompts = {tuple(s.ids[: prompt_length(s)]) for s in mb}
            width = max(prompt_length(s) for s in mb)
            rest = max(len(s.ids) - prompt_length(s) for s in mb)
            cost = len(prompts) * width + len(mb) * rest
            assert cost <= budget or len(mb) == 1
    # with room for all, every group is one prompt run: 6 prompts, one micro-batch
    (only,) = prompt_micro_batches(samples, 8192)
    assert len({tuple(s.ids[: prompt_length(s)]) for s in only}) == 6
