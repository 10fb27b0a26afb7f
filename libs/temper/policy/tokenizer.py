"""The policy's tokenizer: a Hugging Face fast tokenizer with its chat template.

:class:`ChatTokenizer` wraps whatever ``AutoTokenizer`` loads from a model directory
(``tokenizer.json``, ``tokenizer_config.json``, the chat template) plus the
``generation_config.json`` beside it. Prompts come from the template
(:meth:`ChatTokenizer.render`); stop ids from the tokenizer and generation config.

Multi-turn is token-in/token-out: a conversation grows by appending ids, never by
re-tokenising earlier text. :meth:`ChatTokenizer.continuation` gives the ids that
follow what the model sampled: the rest of the template's end-of-turn, the new
messages as the template renders them, and the opening of the next assistant turn.
The new messages' text is found by diffing two renderings of the template (a
conversation ending with a marker assistant message, without and with the new
messages), the technique RL frameworks use for templates that render whole
conversations.

The CPU presets use :func:`byte_tokenizer`: the same interface over a byte-level
tokenizer (id ``b`` is byte ``b``) with a small chat template of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# The byte tokenizer's special tokens and chat template (CPU presets only; nothing reads
# these names outside this module).
_BYTE_SPECIALS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|end|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
)
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>You can call these tools:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role ' + m['role']) }}{%- endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{%- for c in m.get('tool_calls') or [] %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)

# A marker assistant message: where it ends in a rendering is where new messages begin.
_MARK = "TEMPERMARK7"
_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]

Message = Mapping[str, Any]


def token_id(hf: Any, token: str) -> int:
    """The id of one token of a Hugging Face tokenizer."""
    value: Any = hf.convert_tokens_to_ids(token)
    return int(value)


class TemplateError(ValueError):
    """The chat template cannot render what was asked (or renders it unstably)."""


class ChatTokenizer:
    """A fast tokenizer, its chat template and its stop ids."""

    def __init__(self, hf: Any, *, eos_token_ids: Sequence[int] = ()) -> None:
        if getattr(hf, "chat_template", None) is None:
            raise TemplateError(
                "the tokenizer has no chat template (tokenizer_config.json or chat_template.jinja)"
            )
        self.hf = hf
        self.vocab_size = len(hf)
        eos = hf.eos_token_id
        self.pad_id = int(hf.pad_token_id if hf.pad_token_id is not None else (eos if eos is not None else 0))
        self.bos_id: int | None = hf.bos_token_id
        ids = [*eos_token_ids, *([eos] if eos is not None else [])]
        eot = self.end_of_turn_ids[:1]
        if eot and eot[0] in hf.added_tokens_decoder:  # a special end-of-turn token (<|im_end|>, <|eot_id|>)
            ids += eot
        self.stop_ids: list[int] = list(dict.fromkeys(int(i) for i in ids))

    # --- loading and saving -------------------------------------------------------------------
    @classmethod
    def load(cls, directory: str | Path) -> ChatTokenizer:
        """From a local model directory; never contacts a model hub."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        d = Path(directory)
        if (d / TOKENIZER_FILE).is_file():
            # tokenizer.json exactly as written: AutoTokenizer (transformers 5) picks a class
            # from config.json's model_type and may rebuild the pre-tokenizer (Qwen2's splits
            # digits one by one), so a tokenizer trained otherwise would encode differently
            hf = PreTrainedTokenizerFast.from_pretrained(str(d), local_files_only=True)
        else:
            hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        eos: list[int] = []
        gen = d / GENERATION_CONFIG_FILE
        if gen.exists():
            value = json.loads(gen.read_text()).get("eos_token_id")
            eos = [value] if isinstance(value, int) else list(value or [])
        return cls(hf, eos_token_ids=eos)

    def save(self, directory: str | Path) -> Path:
        """Tokenizer files (with the chat template) into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(d))
        gen = d / GENERATION_CONFIG_FILE
        if not gen.exists():  # a model's save_pretrained writes its own; stop ids must survive either way
            gen.write_text(json.dumps({"eos_token_id": self.stop_ids}, indent=2) + "\n")
        return d / TOKENIZER_FILE

    # --- text ----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Text to ids, without adding special tokens (templates write their own)."""
        backend = self._plain_backend()
        if backend is not None:
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        backend = self._plain_backend()
        if backend is not None:
            return backend.decode(list(ids), skip_special_tokens=skip_special)
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special))

    @cached_property
    def _backend(self) -> Tokenizer | None:
        """The Rust tokenizer under a fast Hugging Face tokenizer whose wrapper only passes
        encode and decode on to it (no special tokens split, no clean-up of decoded spaces);
        else None. Called directly it gives the same ids and text without the wrapper's work
        per call (about 60 µs an encode, 30 µs a decode; the dispatcher makes several a turn)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            return None
        if getattr(self.hf, "split_special_tokens", False) or getattr(
            self.hf, "clean_up_tokenization_spaces", False
        ):
            return None
        return backend

    def _plain_backend(self) -> Tokenizer | None:
        """:attr:`_backend` while it has no padding or truncation set (a batch call of the
        wrapper may leave them on it) and does not split special tokens."""
        backend = self._backend
        if backend is None or backend.padding is not None or backend.truncation is not None:
            return None
        if backend.encode_special_tokens:
            return None
        return backend

    def parse_text(self, ids: Sequence[int], text: str | None = None) -> str:
        """What tool-call parsers read of a sampled reply: its ids decoded with their special
        tokens (Mistral's ``[TOOL_CALLS]`` is one), the stop token that ended it left out.
        ``text`` is the engine's own text; where it is not those ids' text without special
        tokens (a stop string cut it), it is what the parsers read."""
        ids = list(ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        plain = self.decode(ids)
        if text is not None and text != plain:
            return text
        return self.decode(ids, skip_special=False)

    def token_str(self, i: int) -> str:
        """A readable form of one token (for logprob listings)."""
        return str(self.hf.decode([i], skip_special_tokens=False))

    # --- the chat template ---------------------------------------------------------------------
    def render_text(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if self.arguments_as_text:
            messages = _text_arguments(messages)
        return self._apply(messages, tools, add_generation_prompt)

    def _apply(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        try:
            text = self.hf.apply_chat_template(
                [dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja raises its own types; the message is what matters
            raise TemplateError(f"the chat template failed: {exc}") from exc
        return str(text)

    @cached_property
    def arguments_as_text(self) -> bool:
        """Whether the template wants a tool call's arguments as their JSON text, not as an
        object. Most render an object with ``| tojson`` (Qwen's, Llama's); Mistral's own
        templates (mistral-common's) put the text in as it is and, given an object, join
        ``arguments|tojson|safe`` to plain text, which HTML-escapes that text's quotes
        (``{&#34;name&#34;: ...``). Found by rendering a probe call both ways."""
        call = {"id": "Ab3dE6gH9", "type": "function", "function": {"name": "probe", "arguments": {"k": "v"}}}
        probe: list[Mapping[str, Any]] = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        try:
            if not _escaped(self._apply(probe, None, False)):
                return False
            return not _escaped(self._apply(_text_arguments(probe), None, False))
        except TemplateError:
            return False

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """A whole conversation as ids, as the template renders it."""
        return self.encode(
            self.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        )

    @cached_property
    def end_of_turn_text(self) -> str:
        """What the template writes after an assistant message's content (``<|im_end|>\\n``)."""
        text = self.render_text(_PROBE, add_generation_prompt=False)
        at = text.rfind(_MARK)
        if at < 0:
            raise TemplateError("the chat template drops assistant content; cannot find where a turn ends")
        return text[at + len(_MARK) :]

    @cached_property
    def end_of_turn_ids(self) -> list[int]:
        return self.encode(self.end_of_turn_text)

    def close_turn(self, sampled: Sequence[int]) -> list[int]:
        """Ids that close an assistant turn after the ``sampled`` ids (which stay as they are):
        the rest of the end-of-turn when the model stopped on its first token, the whole of it
        otherwise (stopped on length, a stop string, or another stop id)."""
        eot = self.end_of_turn_ids
        if sampled and eot and sampled[-1] == eot[0]:
            return eot[1:]
        return list(eot)

    def messages_ids(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``messages`` as the template renders them after a closed assistant turn (then the
        next assistant header): the text after the marker turn's end in a rendering of
        ``[user, assistant(marker), *messages]``. Templates that re-render earlier turns
        differently once later ones follow (Qwen3 drops earlier reasoning) still work:
        only the marker's own end-of-turn must stay where it was."""
        full = self.render_text(
            [*_PROBE, *messages], tools=tools, add_generation_prompt=add_generation_prompt
        )
        at = full.rfind(_MARK)
        end = at + len(_MARK)
        eot = self.end_of_turn_text
        if at < 0 or full[end : end + len(eot)] != eot:
            raise TemplateError(
                "the chat template renders an assistant turn differently when messages follow it; "
                "Temper cannot extend such a conversation token-wise"
            )
        return self.encode(full[end + len(eot) :])

    def continuation(
        self,
        sampled: Sequence[int],
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """What follows the sampled ids: the end of the turn, ``messages``, the next assistant header."""
        return [*self.close_turn(sampled), *self.messages_ids(messages, tools=tools)]


def _escaped(text: str) -> bool:
    return "&#34;" in text or "&quot;" in text


def _text_arguments(messages: Sequence[Message]) -> list[Message]:
    """``messages`` with each tool call's object arguments as their JSON text."""
    out: list[Message] = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            texts = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if not isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.dumps(fn.get("arguments") or {})
                texts.append({**c, "function": fn})
            m = {**m, "tool_calls": texts}
        out.append(m)
    return out


# --- the CPU presets' byte tokenizer ---------------------------------------------------------------


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


def build_byte_tokenizer() -> Tokenizer:
    """A byte-level ``tokenizers.Tokenizer``: byte ``b`` has id ``b``; special tokens from 256."""
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _BYTE_SPECIALS])
    return tok


@lru_cache(maxsize=1)
def byte_tokenizer() -> ChatTokenizer:
    """The CPU presets' tokenizer (identical to every saved copy)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=build_byte_tokenizer(),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=4096,
    )
    hf.chat_template = BYTE_CHAT_TEMPLATE
    return ChatTokenizer(hf, eos_token_ids=[token_id(hf, "<|end|>")])


def default_tokenizer() -> ChatTokenizer:
    """The tokenizer of the CPU presets (kept as the name older call sites use)."""
    return byte_tokenizer()


# --- conveniences over ChatTokenizer -----------------------------------------------------------------


def encode_chat(
    tok: ChatTokenizer,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """A whole conversation as ids (the template's rendering)."""
    return tok.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)


def extend_chat(
    tok: ChatTokenizer,
    history_ids: Sequence[int],
    new_messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """``history_ids`` (the last prompt plus the sampled ids) extended with ``new_messages``
    and the next assistant header; earlier ids are never re-tokenised."""
    history = list(history_ids)
    # the sampled part is what follows the last generation prompt; only its end matters here
    return [*history, *tok.continuation(history, new_messages, tools=tools)]


def assistant_stop_ids(tok: ChatTokenizer) -> list[int]:
    """The ids that end an assistant turn (tokenizer eos, generation config eos, end-of-turn)."""
    return list(tok.stop_ids)


@lru_cache(maxsize=64)
def _load_cached(directory: str, mtime_ns: int) -> ChatTokenizer:
    return ChatTokenizer.load(directory)


def tokenizer_source(model: str | None, init: str | None = None) -> str | None:
    """Which of ``model`` and ``init`` :func:`policy_tokenizer` takes the tokenizer from
    (``"model"`` or ``"init"``), or None for the byte tokenizer."""
    for name, ref in (("model", model), ("init", init)):
        if ref and ((Path(ref) / TOKENIZER_FILE).is_file() or ref in _FETCHED):
            return name
    return None


def policy_tokenizer(model: str | None, init: str | None = None) -> ChatTokenizer:
    """The tokenizer of a job's policy: that of ``policy.model`` when it is a model directory
    here (or an object-storage one fetched by :func:`fetch_policy_tokenizer`), else that of
    ``policy.init``, else the CPU presets' byte tokenizer (a model named only by a backend
    name, e.g. ``temper-tiny``)."""
    for ref in (model, init):
        if ref and (Path(ref) / TOKENIZER_FILE).is_file():
            path = Path(ref).resolve()
            return _load_cached(str(path), (path / TOKENIZER_FILE).stat().st_mtime_ns)
        if ref in _FETCHED:  # an object-storage prefix, see fetch_policy_tokenizer
            return _FETCHED[ref]
    return byte_tokenizer()


# Tokenizers of model directories kept in object storage, fetched once per prefix.
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    GENERATION_CONFIG_FILE,
)
_FETCHED: dict[str, ChatTokenizer] = {}


async def fetch_policy_tokenizer(
    store: Any, model: str | None, init: str | None, cache_dir: str | Path
) -> None:
    """Make the tokenizer of an object-storage model directory (``model`` or ``init`` as a
    prefix holding ``tokenizer.json``) known to :func:`policy_tokenizer`. Local
    directories and names need nothing; a prefix is fetched once per process."""
    import asyncio

    for ref in (model, init):
        if not ref or ref in _FETCHED or await asyncio.to_thread((Path(ref) / TOKENIZER_FILE).is_file):
            continue
        base = ref.rstrip("/")
        if not await store.exists(f"{base}/{TOKENIZER_FILE}"):
            continue
        files = {}
        for name in TOKENIZER_FILES:
            if await store.exists(f"{base}/{name}"):
                files[name] = await store.get(f"{base}/{name}")

        def save(files: dict[str, bytes] = files, base: str = base) -> ChatTokenizer:
            d = Path(cache_dir) / base.replace("/", "__")
            d.mkdir(parents=True, exist_ok=True)
            for name, data in files.items():
                (d / name).write_bytes(data)
            return ChatTokenizer.load(d)

        _FETCHED[ref] = await asyncio.to_thread(save)
        return
