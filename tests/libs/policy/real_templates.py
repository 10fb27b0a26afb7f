"""Tokenizers with the chat templates real models ship, for the tests: a byte-level BPE
trained here, the model's special tokens, and one of the fixture templates in
``templates/`` (each says which model's format it reproduces and what was checked), saved
as a model hub lays it out (the template inside ``tokenizer_config.json``) and loaded back
with :meth:`temper.policy.ChatTokenizer.load`, the code a downloaded model goes through."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temper.policy import ChatTokenizer
from temper.policy.build import train_chat_tokenizer

TEMPLATES = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class Shipped:
    """One model's tokenizer shape and how it calls tools."""

    template: str  # the fixture's file name
    specials: tuple[str, ...]
    eos: str
    stops: tuple[str, ...]
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    extra: tuple[str, ...] = ()
    parser: str = "hermes"  # environment.action_format
    tool_role: str | None = None  # environment.tool_role
    call: str = ""  # the model's text for python(code=CODE), CODE as a placeholder
    answer: str = "The answer is \\boxed{391}."
    job: dict[str, Any] = field(default_factory=dict)  # more environment fields a job needs

    @property
    def text(self) -> str:
        return (TEMPLATES / self.template).read_text()

    def call_text(self, code: str) -> str:
        return self.call.replace("CODE", code)


# What each call looks like in the model's own format (the parsers' inputs).
SHIPPED: dict[str, Shipped] = {
    "qwen2.5": Shipped(
        "qwen2.5.jinja",
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        extra=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stops=("<|im_end|>", "<|endoftext|>"),
        parser="hermes",
        call='<tool_call>\n{"name": "python", "arguments": {"code": "CODE"}}\n</tool_call>',
    ),
    "llama3.1": Shipped(
        "llama3.1.jinja",
        specials=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        stops=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
        parser="llama3_json",
        call='{"name": "python", "parameters": {"code": "CODE"}}',
    ),
    "mistral-v0.3": Shipped(
        "mistral-v0.3.jinja",
        specials=(
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        bos="<s>",
        eos="</s>",
        unk="<unk>",
        stops=("</s>",),
        parser="mistral",
        # v0.3 writes the call's id itself: the tool result must carry the same one
        call='[TOOL_CALLS] [{"name": "python", "arguments": {"code": "CODE"}, "id": "Ab3dE6gH9"}]',
        answer=" The answer is \\boxed{391}.",  # the template writes " " + content|trim
        # its template joins the system text to the last user turn only while that turn is
        # the conversation's last message: a job without a system message re-renders stably
        job={"system_prompt": ""},
    ),
    "gemma3": Shipped(
        "gemma3.jinja",
        specials=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        stops=("<end_of_turn>", "<eos>"),
        parser="tool_code",
        tool_role="user",  # no tool role in the template
        call='```tool_code\npython(code="CODE")\n```',
        # the template drops tools: the system prompt describes them (the door checks it)
        job={
            "system_prompt": (
                "Solve the problem. Tools: python(code: str) runs Python and shows what it prints; "
                "submit(answer: str) gives the answer. Call one in a ```tool_code block, e.g. "
                '```tool_code\npython(code="print(1)")\n```. Give the final answer as \\boxed{...}.'
            )
        },
    ),
}

CORPUS = [
    "Compute 17 * 23 with python and give the answer.",
    "print(17 * 23)",
    "391\nThe answer is \\boxed{391}.",
    "[exit code 0; 0.01s]\nstdout:\n391",
    '{"name": "python", "arguments": {"code": "print(17 * 23)"}}',
]


def tokenizer(name: str, *, vocab_size: int = 600) -> ChatTokenizer:
    """The BPE tokenizer of ``name``'s shape, trained on the corpus as its template renders it."""
    s = SHIPPED[name]
    corpus = [*CORPUS, s.call_text("print(17 * 23)"), s.text] * 20
    return train_chat_tokenizer(
        corpus,
        chat_template=s.text,
        specials=s.specials,
        extra=s.extra,
        bos=s.bos,
        eos=s.eos,
        pad=s.pad,
        unk=s.unk,
        stops=s.stops,
        vocab_size=vocab_size,
    )


def save_as_on_a_hub(tok: ChatTokenizer, directory: Path) -> Path:
    """``tok``'s files in ``directory`` with the chat template inside
    ``tokenizer_config.json`` (where Llama 3.1, Mistral v0.3 and Qwen2.5 ship it), not in
    a ``chat_template.jinja`` beside it."""
    tok.save(directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = tok.hf.chat_template
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    return directory


def hub_tokenizer(name: str, directory: Path) -> ChatTokenizer:
    """:func:`tokenizer` saved as on a hub and loaded back from ``directory``."""
    save_as_on_a_hub(tokenizer(name), directory)
    return ChatTokenizer.load(directory)


# --- templates as the models ship them (templates/shipped/, SOURCES.json) ------------------------

SHIPPED_DIR = TEMPLATES / "shipped"


def shipped_text(name: str) -> str:
    return (SHIPPED_DIR / name).read_text()


# The hand-written shapes above run again on the shipped bytes (the parametrised tests of
# test_real_templates.py take every entry): the same tokens, calls and settings.
for _name, _file in (
    ("qwen2.5", "qwen2.5-instruct.jinja"),
    ("llama3.1", "llama-3.1-instruct.jinja"),
    ("gemma3", "gemma-3-it.jinja"),
):
    SHIPPED[f"{_name}-shipped"] = dataclasses.replace(SHIPPED[_name], template=f"shipped/{_file}")
SHIPPED["qwen3-coder-shipped"] = Shipped(
    "shipped/qwen3-coder.jinja",
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    extra=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    eos="<|im_end|>",
    pad="<|endoftext|>",
    stops=("<|im_end|>", "<|endoftext|>"),
    parser="qwen3_coder",
    call="<tool_call>\n<function=python>\n<parameter=code>\nCODE\n</parameter>\n</function>\n</tool_call>",
)


# --- Mistral's real tokenizer, from the mistral_common wheel --------------------------------------

MISTRAL_V3 = "mistral_instruct_tokenizer_240323.model.v3"  # Mistral-7B-Instruct-v0.3's tokenizer.model.v3


def mistral_common_file(name: str) -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / name


def mistral_v3_tokenizer(directory: Path, template: str = "mistral-v3-spm.jinja") -> ChatTokenizer:
    """Mistral's v3 SentencePiece tokenizer as shipped in ``mistral_common`` (32,768 pieces,
    its control tokens), converted to a fast tokenizer (the vocabulary read from the model
    file by transformers' ``SentencePieceExtractor``, merges in the order of the pieces'
    scores as SentencePiece applies them; byte fallback; a ``▁`` before the text, as
    SentencePiece's dummy prefix), saved with ``template`` inside ``tokenizer_config.json``
    as on a hub and loaded back with ``ChatTokenizer.load``. One difference from
    SentencePiece is left: text that starts with a space gets no second ``▁``
    (SentencePiece: ``" x"`` is ``▁ ▁x``); chat text never starts so, as the templates write
    their spaces after the control tokens (the episode test below checks a whole episode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, generate_merges

    extractor = SentencePieceExtractor(str(mistral_common_file(MISTRAL_V3)))
    found = extractor.extract(models.BPE)
    # SentencePiece merges by piece score: the merges in that order
    merges = generate_merges(found["vocab"], {p.piece: p.score for p in extractor.proto.pieces})
    tok = Tokenizer(
        models.BPE(vocab=found["vocab"], merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    tok.add_special_tokens(found["additional_special_tokens"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = (
        shipped_text(template) if template.endswith("-spm.jinja") else (TEMPLATES / template).read_text()
    )
    save_as_on_a_hub(ChatTokenizer(hf), directory)
    return ChatTokenizer.load(directory)
