"""A byte-level tokenizer that Temper owns: nothing to download, exact round trips.

Ids 0..255 are the bytes themselves; the special tokens follow. The tokenizer is a
``tokenizers`` BPE model with no merges over the byte-level alphabet, so the same
``tokenizer.json`` is readable by ``transformers``/vLLM (``PreTrainedTokenizerFast``).

Chat formatting is token-wise: each message is ``<|role|> content-bytes <|end|>`` and
an assistant turn is opened with ``<|assistant|>``. Because every message is rendered
on its own, a conversation is extended across turns by appending ids, never by
re-tokenising earlier text (see :func:`encode_chat` and :func:`extend_chat`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"

PAD = "<|pad|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
END = "<|end|>"
ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, END, *(f"<|{role}|>" for role in ROLES))


def _byte_alphabet() -> list[str]:
    """The printable stand-in character for each byte, in byte order (the GPT-2 byte-level scheme)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


def build_tokenizer() -> Tokenizer:
    """A fresh byte-level ``tokenizers.Tokenizer``: byte ``b`` has id ``b``; specials from 256."""
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


class ByteTokenizer:
    """``encode(text) -> ids`` and ``decode(ids) -> text`` over a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tok = tokenizer or build_tokenizer()
        self.pad_id = self.token_id(PAD)
        self.bos_id = self.token_id(BOS)
        self.eos_id = self.token_id(EOS)
        self.end_id = self.token_id(END)
        self.role_ids = {role: self.token_id(f"<|{role}|>") for role in ROLES}
        self.special_ids = frozenset(self.token_id(t) for t in SPECIAL_TOKENS)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        tid = self.tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return tid

    def encode(self, text: str) -> list[int]:
        """Plain text to ids. Special-token spellings inside ``text`` stay plain bytes."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Ids to text; bytes that are not valid UTF-8 become U+FFFD."""
        out = bytearray()
        parts: list[str] = []
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special:
                parts.append(out.decode("utf-8", errors="replace"))
                out.clear()
                parts.append(self.tok.id_to_token(i) or "")
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_str(self, i: int) -> str:
        """A readable form of one token (for logprob listings)."""
        if i < 256:
            return bytes([i]).decode("utf-8", errors="replace")
        return self.tok.id_to_token(i) or ""

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(path))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "model_max_length": 4096,
        }
        (path.parent / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> ByteTokenizer:
        path = Path(directory)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        return cls(Tokenizer.from_file(str(path)))


@lru_cache(maxsize=1)
def default_tokenizer() -> ByteTokenizer:
    """The process-wide byte tokenizer (identical to every saved copy)."""
    return ByteTokenizer()


Message = Mapping[str, str]


def encode_message(tok: ByteTokenizer, message: Message) -> list[int]:
    """One message: ``<|role|>`` + content bytes + ``<|end|>``."""
    role = message["role"]
    if role not in tok.role_ids:
        raise ValueError(f"unknown chat role {role!r}; expected one of {ROLES}")
    return [tok.role_ids[role], *tok.encode(message.get("content") or ""), tok.end_id]


def generation_prompt(tok: ByteTokenizer) -> list[int]:
    """The ids that open an assistant turn."""
    return [tok.role_ids["assistant"]]


def encode_chat(
    tok: ByteTokenizer, messages: Sequence[Message], *, add_generation_prompt: bool = True, bos: bool = True
) -> list[int]:
    """A whole conversation as ids: ``<|bos|>`` then each message, then (optionally) ``<|assistant|>``."""
    ids = [tok.bos_id] if bos else []
    for message in messages:
        ids += encode_message(tok, message)
    if add_generation_prompt:
        ids += generation_prompt(tok)
    return ids


def extend_chat(
    tok: ByteTokenizer,
    history_ids: Sequence[int],
    new_messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Extend a conversation token-wise.

    ``history_ids`` is what the model saw and produced so far (the last prompt plus the
    sampled ids). If the last assistant turn did not end with ``<|end|>`` (it stopped on
    length or a stop string), ``<|end|>`` is appended to close it. Earlier ids are never
    re-tokenised.
    """
    ids = list(history_ids)
    if ids and ids[-1] != tok.end_id and ids[-1] in (tok.eos_id,):
        ids[-1] = tok.end_id
    elif ids and ids[-1] != tok.end_id:
        ids.append(tok.end_id)
    for message in new_messages:
        ids += encode_message(tok, message)
    if add_generation_prompt:
        ids += generation_prompt(tok)
    return ids


def assistant_stop_ids(tok: ByteTokenizer) -> list[int]:
    """The ids that end an assistant turn."""
    return [tok.end_id, tok.eos_id]
