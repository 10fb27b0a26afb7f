from __future__ import annotations

import pytest

from temper.policy import ByteTokenizer, default_tokenizer, encode_chat, extend_chat

pytestmark = pytest.mark.timeout(30)

TEXTS = ["", "hello", "héllo wörld ✓ 漢字 🙂", "def f(x):\n\treturn x + 1\n", "<|end|> is just text here"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text: str) -> None:
    tok = default_tokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_ids_match_the_tokenizers_library_and_survive_save_load(tmp_path) -> None:
    tok = default_tokenizer()
    text = "héllo <world> ✓"
    assert tok.tok.encode(text, add_special_tokens=False).ids == tok.encode(text)
    tok.save(tmp_path)
    again = ByteTokenizer.load(tmp_path)
    assert again.encode(text) == tok.encode(text)
    assert again.vocab_size == tok.vocab_size == 256 + 8
    assert (again.pad_id, again.bos_id, again.eos_id, again.end_id) == (
        tok.pad_id,
        tok.bos_id,
        tok.eos_id,
        tok.end_id,
    )
    assert again.tok.decode(tok.encode(text)) == text  # the tokenizers decoder agrees


def test_special_tokens_are_skipped_when_decoding() -> None:
    tok = default_tokenizer()
    ids = [tok.bos_id, *tok.encode("hi"), tok.end_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "<|bos|>hi<|end|>"


def test_chat_is_extended_token_wise() -> None:
    tok = default_tokenizer()
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    prompt = encode_chat(tok, first)
    assert prompt[0] == tok.bos_id and prompt[-1] == tok.role_ids["assistant"]
    reply = [*tok.encode("4"), tok.end_id]
    turn2 = extend_chat(tok, prompt + reply, [{"role": "user", "content": "and 3+3?"}])
    whole = encode_chat(
        tok, [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    )
    assert turn2 == whole
    assert turn2[: len(prompt) + len(reply)] == prompt + reply  # earlier ids untouched
    # a reply cut by max_tokens gets its turn closed with <|end|>
    cut = extend_chat(tok, prompt + tok.encode("4"), [{"role": "user", "content": "and 3+3?"}])
    assert cut == whole


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError):
        encode_chat(default_tokenizer(), [{"role": "narrator", "content": "x"}])
