from __future__ import annotations

import pytest

from temper.policy import ChatTokenizer, TemplateError, byte_tokenizer, encode_chat, extend_chat

pytestmark = pytest.mark.timeout(60)

TEXTS = ["", "hello", "héllo wörld ✓ 漢字 🙂", "def f(x):\n\treturn x + 1\n"]


def tid(tok: ChatTokenizer, token: str) -> int:
    return int(tok.hf.convert_tokens_to_ids(token))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips_and_ids_are_bytes(text: str) -> None:
    tok = byte_tokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode())
    assert tok.decode(ids) == text


def test_byte_tokenizer_survives_save_load_with_its_template_and_stop_ids(tmp_path) -> None:
    tok = byte_tokenizer()
    tok.save(tmp_path)
    assert {"tokenizer.json", "generation_config.json"} <= {p.name for p in tmp_path.iterdir()}
    again = ChatTokenizer.load(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    assert again.render(msgs) == tok.render(msgs)
    assert again.vocab_size == tok.vocab_size == 256 + 8
    assert again.stop_ids == tok.stop_ids == [tid(tok, "<|end|>"), tid(tok, "<|eos|>")]
    assert again.pad_id == tok.pad_id == tid(tok, "<|pad|>")


def test_special_tokens_are_skipped_when_decoding() -> None:
    tok = byte_tokenizer()
    ids = [tid(tok, "<|bos|>"), *tok.encode("hi"), tid(tok, "<|end|>")]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special=False) == "<|bos|>hi<|end|>"


def test_chat_is_extended_token_wise_and_equals_the_whole_rendering() -> None:
    tok = byte_tokenizer()
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    prompt = encode_chat(tok, first)
    assert prompt[0] == tid(tok, "<|bos|>") and prompt[-1] == tid(tok, "<|assistant|>")
    reply = [*tok.encode("4"), tid(tok, "<|end|>")]
    turn2 = extend_chat(tok, prompt + reply, [{"role": "user", "content": "and 3+3?"}])
    whole = encode_chat(
        tok, [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    )
    assert turn2 == whole
    assert turn2[: len(prompt) + len(reply)] == prompt + reply  # earlier ids untouched
    # a reply cut by max_tokens gets its turn closed by the template's end-of-turn
    cut = extend_chat(tok, prompt + tok.encode("4"), [{"role": "user", "content": "and 3+3?"}])
    assert cut == whole


def test_unknown_role_is_refused_by_the_template() -> None:
    with pytest.raises(TemplateError, match="narrator"):
        encode_chat(byte_tokenizer(), [{"role": "narrator", "content": "x"}])


SPECIAL_TEXTS = [
    *TEXTS,
    "<|im_start|>user\nhi<|im_end|>\n",
    "[INST] x [/INST]<start_of_turn>",
    "a<|end|>b  c\n\n  d",
    " leading and trailing ",
]


@pytest.mark.parametrize("name", ["byte", "qwen2.5", "llama3.1", "mistral-v0.3", "gemma3"])
def test_encode_and_decode_give_what_the_hugging_face_wrapper_gives(name: str) -> None:
    """The direct calls to the Rust tokenizer (ChatTokenizer._backend) agree with the
    wrapper's, special tokens and all, and the wrapper is used where they might not."""
    from tests.libs.policy.real_templates import tokenizer

    tok = byte_tokenizer() if name == "byte" else tokenizer(name)
    assert tok._plain_backend() is not None
    for text in SPECIAL_TEXTS:
        ids = tok.encode(text)
        assert ids == list(tok.hf(text, add_special_tokens=False)["input_ids"])
        for skip in (True, False):
            assert tok.decode(ids, skip_special=skip) == tok.hf.decode(ids, skip_special_tokens=skip)
    # a call with truncation leaves it on the backend (padding too; not every one of these
    # tokenizers has a pad token): then the wrapper encodes
    tok.hf(["a", "abc"], truncation=True, max_length=2)
    assert tok._plain_backend() is None
    assert tok.encode("abc") == list(tok.hf("abc", add_special_tokens=False)["input_ids"])
