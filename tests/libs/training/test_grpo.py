"""The GRPO loss against a plain reference written here with Python floats and numpy
(loops over tokens, one unpadded sequence at a time), on a fixed batch."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from temper.policy import create_model, default_tokenizer, encode_chat
from temper.training import Learner, LearnerConfig, group_advantages, grpo_token_loss, samples_from_groups
from temper.training.batch import collate, micro_batches
from temper.trajectory import Segment, Trajectory

pytestmark = pytest.mark.timeout(60)

CLIP = 0.2
BETA = 0.05
EPS = 1e-4


def plain_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1, from one unpadded forward and a numpy log-softmax."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    out = [0.0]
    for t in range(1, len(ids)):
        row = logits[t - 1]
        m = row.max()
        lse = m + math.log(np.exp(row - m).sum())
        out.append(float(row[ids[t]] - lse))
    return out


def make_batch(policy, seed: int = 7) -> list[list[Trajectory]]:
    """Two groups of three, multi-turn, different lengths; behaviour logprobs are the
    policy's own plus noise, so ratios land on both sides of the clip range."""
    rng = random.Random(seed)
    tok = default_tokenizer()
    groups = []
    for g, rewards in enumerate([[1.0, 0.0, 0.5], [0.2, 0.9, 0.9]]):
        group = []
        for i, r in enumerate(rewards):
            prompt = encode_chat(tok, [{"role": "user", "content": f"task {g}: " + "x" * rng.randint(1, 6)}])
            a1 = [rng.randrange(32, 127) for _ in range(rng.randint(2, 7))] + [tok.stop_ids[0]]
            obs = tok.encode(" obs " * rng.randint(1, 2)) + [tok.hf.convert_tokens_to_ids("<|assistant|>")]
            a2 = [rng.randrange(32, 127) for _ in range(rng.randint(1, 5))]
            ids = prompt + a1 + obs + a2
            lp = plain_logprobs(policy, ids)
            noisy = [x + rng.uniform(-0.6, 0.6) for x in lp]
            n1, n2 = len(prompt), len(prompt) + len(a1) + len(obs)
            segments = [
                Segment(role="prompt", token_ids=prompt),
                Segment(role="model", token_ids=a1, logprobs=noisy[n1 : n1 + len(a1)], policy_version=0),
                Segment(role="observation", token_ids=obs),
                Segment(role="model", token_ids=a2, logprobs=noisy[n2:], policy_version=0),
            ]
            group.append(
                Trajectory(
                    job_id="j",
                    episode_id=f"e{g}{i}",
                    task_id=f"t{g}",
                    group_id=f"g{g}",
                    segments=segments,
                    reward=r,
                )
            )
        groups.append(group)
    return groups


def reference(policy, ref_model, groups) -> dict[str, float]:
    """The objective of docs/training.md, term by term, on Python floats."""
    total = pg_total = kl_total = 0.0
    n = clipped = 0
    for group in groups:
        rewards = np.array([t.reward for t in group], dtype=np.float64)
        adv = (rewards - rewards.mean()) / (rewards.std() + EPS)  # numpy std is the population std
        for traj, a in zip(group, adv, strict=True):
            ids, own, old = traj.flat()
            cur = plain_logprobs(policy, ids)
            ref = plain_logprobs(ref_model, ids)
            for t in range(1, len(ids)):
                if not own[t]:
                    continue
                ratio = math.exp(cur[t] - old[t])
                clipped_ratio = min(max(ratio, 1 - CLIP), 1 + CLIP)
                pg = -min(ratio * a, clipped_ratio * a)
                d = ref[t] - cur[t]
                kl = math.exp(d) - d - 1
                total += pg + BETA * kl
                pg_total += pg
                kl_total += kl
                clipped += (a > 0 and ratio > 1 + CLIP) or (a < 0 and ratio < 1 - CLIP)
                n += 1
    return {
        "loss": total / n,
        "pg": pg_total / n,
        "kl": kl_total / n,
        "clip_fraction": clipped / n,
        "tokens": n,
    }


def test_advantages_match_numpy():
    for rewards in ([1.0, 0.0, 0.5], [0.2, 0.9, 0.9, 0.1], [3.0, -1.0]):
        r = np.array(rewards)
        expected = (r - r.mean()) / (r.std() + EPS)
        assert np.allclose(group_advantages(rewards, EPS), expected, atol=1e-12)
    assert group_advantages([0.5, 0.5, 0.5], EPS) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("micro_batch_tokens", [64, 100_000])
def test_loss_matches_the_reference_on_a_fixed_batch(micro_batch_tokens):
    policy, ref_model = create_model(seed=1), create_model(seed=2)
    groups = make_batch(policy)
    want = reference(policy, ref_model, groups)

    learner = Learner(
        policy,
        LearnerConfig(clip_eps=CLIP, kl_coef=BETA, adv_eps=EPS, micro_batch_tokens=micro_batch_tokens),
        device="cpu",
        reference=ref_model,
    )
    samples, skipped = samples_from_groups(groups, eps=EPS)
    assert skipped == 0
    acc = learner.backward(samples)
    normalizer = sum(sum(s.mask[1:]) for s in samples)
    assert normalizer == want["tokens"]
    if micro_batch_tokens == 64:
        assert acc.micro_batches > 1, "the small budget must split the batch"
    assert (acc.pg + BETA * acc.kl) / normalizer == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
    assert acc.pg / normalizer == pytest.approx(want["pg"], rel=1e-4, abs=1e-6)
    assert acc.kl / normalizer == pytest.approx(want["kl"], rel=1e-4, abs=1e-6)
    assert acc.clipped / normalizer == pytest.approx(want["clip_fraction"])
    assert 0 < want["clip_fraction"] < 1, "the fixed batch exercises both clipped and unclipped tokens"

    # The step's statistics report the same numbers.
    stats = Learner(create_model(seed=1), learner.config, device="cpu", reference=ref_model).step(groups)
    assert stats.updated and stats.step == 1
    assert stats.loss == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
    assert stats.clip_fraction == pytest.approx(want["clip_fraction"])
    assert stats.model_tokens == want["tokens"]


def test_gradient_matches_a_per_sequence_reference():
    """Padding and micro-batching do not change the gradient: compare with autograd on
    the reference objective computed one unpadded sequence and one token at a time."""
    policy = create_model(seed=1)
    groups = make_batch(policy, seed=11)
    learner = Learner(policy, LearnerConfig(clip_eps=CLIP, adv_eps=EPS, micro_batch_tokens=64), device="cpu")
    samples, _ = samples_from_groups(groups, eps=EPS)
    learner.optimizer.zero_grad()
    learner.backward(samples)
    got = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    plain = create_model(seed=1)
    n = sum(sum(s.mask[1:]) for s in samples)
    terms = []
    for s in samples:
        logp = torch.log_softmax(plain(input_ids=torch.tensor([s.ids])).logits[0].float(), -1)
        for t in range(1, len(s.ids)):
            if s.mask[t]:
                ratio = torch.exp(logp[t - 1, s.ids[t]] - s.behaviour_logprobs[t])
                terms.append(
                    -torch.minimum(ratio * s.advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * s.advantage)
                )
    (torch.stack(terms).sum() / n).backward()
    for name, p in plain.named_parameters():
        if p.grad is None:
            continue
        assert torch.allclose(got[name], p.grad, rtol=1e-4, atol=1e-6), name


def test_masked_tokens_get_no_gradient_and_do_not_matter():
    torch.manual_seed(0)
    b, t = 3, 9
    mask = torch.rand(b, t) > 0.4
    logprobs = (-torch.rand(b, t) * 3).requires_grad_()
    old = -torch.rand(b, t) * 3
    adv = torch.tensor([1.0, -0.5, 2.0])
    parts = grpo_token_loss(
        logprobs,
        old,
        adv,
        mask,
        clip_eps=0.2,
        normalizer=float(mask.sum()),
        ref_logprobs=-torch.rand(b, t),
        kl_coef=0.1,
    )
    parts.loss.backward()
    assert torch.all(logprobs.grad[~mask] == 0)
    assert torch.any(logprobs.grad[mask] != 0)

    # Garbage where the mask is off (observation tokens carry no behaviour logprob) changes nothing.
    garbage = old.clone()
    garbage[~mask] = 1e9
    logprobs2 = logprobs.detach().clone()
    logprobs2[~mask] = -1e9
    logprobs2.requires_grad_()
    again = grpo_token_loss(logprobs2, garbage, adv, mask, clip_eps=0.2, normalizer=float(mask.sum()))
    first = grpo_token_loss(logprobs.detach(), old, adv, mask, clip_eps=0.2, normalizer=float(mask.sum()))
    assert torch.isfinite(again.loss)
    assert again.loss.item() == pytest.approx(first.loss.item())
    again.loss.backward()
    assert torch.all(logprobs2.grad[~mask] == 0)


def test_observation_tokens_are_masked_in_the_batch():
    policy = create_model(seed=1)
    groups = make_batch(policy)
    samples, _ = samples_from_groups(groups)
    batch = collate(samples, pad_id=default_tokenizer().pad_id)
    for i, traj in enumerate(groups[0] + groups[1]):
        ids, own, _ = traj.flat()
        assert batch.input_ids[i, : len(ids)].tolist() == ids
        assert batch.completion_mask[i, : len(ids)].tolist() == own
        assert not batch.completion_mask[i, len(ids) :].any(), "padding is never trained on"
        assert batch.attention_mask[i].sum() == len(ids)
    chunks = micro_batches(samples, 64)
    assert sorted(id(s) for c in chunks for s in c) == sorted(id(s) for s in samples)
    assert all(len(c) * max(len(s.ids) for s in c) <= 64 or len(c) == 1 for c in chunks)


def test_zero_variance_groups_are_dropped():
    policy = create_model(seed=1)
    groups = make_batch(policy)
    for t in groups[1]:
        t.reward = 0.25
    samples, skipped = samples_from_groups(groups)
    assert skipped == 1 and len(samples) == 3
    stats = Learner(policy, LearnerConfig(), device="cpu").step([groups[1]])
    assert not stats.updated and stats.skipped_groups == 1 and stats.step == 0
