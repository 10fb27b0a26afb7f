from __future__ import annotations

import pytest
import torch

from temper.policy import (
    create_model,
    default_tokenizer,
    load_model,
    load_weights,
    pad_batch,
    read_metadata,
    save_checkpoint,
    token_logprobs,
)

pytestmark = pytest.mark.timeout(60)


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = create_model(seed=1), create_model(seed=1), create_model(seed=2)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)
    assert a.config.vocab_size == default_tokenizer().vocab_size


def test_checkpoint_round_trip(tmp_path) -> None:
    model = create_model(seed=3)
    save_checkpoint(model, tmp_path / "ckpt", metadata={"version": 7})
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    }
    loaded, tok = load_model(tmp_path / "ckpt")
    ids = torch.tensor([tok.encode("checkpoint")])
    assert torch.allclose(token_logprobs(model, ids), token_logprobs(loaded, ids))
    assert read_metadata(tmp_path / "ckpt")["version"] == 7
    other = create_model(seed=4)
    load_weights(other, tmp_path / "ckpt" / "model.safetensors")
    assert torch.allclose(token_logprobs(other, ids), token_logprobs(model, ids))
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()  # still tied


def test_logprobs_agree_across_padding_sides_and_masks() -> None:
    model = create_model(seed=0)
    tok = default_tokenizer()
    seqs = [tok.encode("a longer sequence"), tok.encode("short")]
    right_ids, right_mask = pad_batch(seqs, tok.pad_id)
    left_ids, left_mask = pad_batch(seqs, tok.pad_id, left=True)
    with torch.no_grad():
        right = token_logprobs(model, right_ids, right_mask)
        left = token_logprobs(model, left_ids, left_mask)
        alone = token_logprobs(model, torch.tensor([seqs[1]]))
    n = len(seqs[1])
    assert torch.allclose(right[1, :n], alone[0], atol=1e-5)
    assert torch.allclose(left[1, -n:], alone[0], atol=1e-5)
    assert right[1, n:].abs().sum() == 0 and left[1, :-n].abs().sum() == 0
    assert alone[0, 0] == 0 and (alone[0, 1:] < 0).all()
    completion = torch.zeros_like(right_mask)
    completion[:, 3:] = 1
    masked = token_logprobs(model, right_ids, right_mask, completion)
    assert masked[:, :3].abs().sum() == 0


def test_gradients_flow_for_training() -> None:
    model = create_model(seed=0).train()
    ids = torch.tensor([default_tokenizer().encode("learn this")])
    loss = -token_logprobs(model, ids).sum()
    loss.backward()
    assert model.model.embed_tokens.weight.grad is not None
