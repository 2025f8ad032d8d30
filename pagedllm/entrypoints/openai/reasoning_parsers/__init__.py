"""Reasoning parsers: a choice's output -> ``reasoning_content``, content (and harmony's tool calls).

Chosen by name as vLLM's ``--reasoning-parser`` is, or from the model:

    gpt_oss       harmony channels (gpt-oss): analysis, final, commentary calls
    qwen3         <think>...</think>, opened in the output or by the prompt
    deepseek_r1   the same, assumed opened by the prompt when it is not known
    granite       Here is my thought process: ... Here is my response: ...  (Granite 3.x)

``auto`` picks from the model where the choice cannot be wrong
(``detect_reasoning_parser``): ``gpt_oss`` for a gpt-oss model, ``qwen3``
for a chat template that writes both ``<think>`` and ``</think>``,
``granite`` for one that tells the model to write Granite's thought marker;
anything else gets none. ``none`` turns it off. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.gpt_oss import GptOssReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.granite import (
    THOUGHT_MARKERS,
    GraniteReasoningParser,
)
from pagedllm.entrypoints.openai.reasoning_parsers.reply_parser import ReplyParser
from pagedllm.entrypoints.openai.reasoning_parsers.think import (
    CLOSE,
    OPEN,
    DeepSeekR1ReasoningParser,
    ThinkReasoningParser,
)
from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "GptOssReasoningParser",
    "GraniteReasoningParser",
    "ReasoningParser",
    "ReplyParser",
    "ThinkReasoningParser",
    "detect_reasoning_parser",
    "get_reasoning_parser",
    "parse_reply",
]

# the parsers a server can be told to use, by vLLM's names
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    GptOssReasoningParser.name: GptOssReasoningParser,
    ThinkReasoningParser.name: ThinkReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    GraniteReasoningParser.name: GraniteReasoningParser,
}
REASONING_PARSER_CHOICES = ("auto", "none", *sorted(REASONING_PARSERS))


def detect_reasoning_parser(
    harmony_model: bool = False, chat_template: str | None = None
) -> tuple[type[ReasoningParser] | None, str]:
    """The parser ``auto`` picks, and why (a sentence for the log).

    Only where the template leaves no doubt: a harmony model -> ``gpt_oss``;
    a template that writes both ``<think>`` and ``</think>`` (Qwen3, QwQ,
    DeepSeek-R1: the ``qwen3`` parser reads from the rendered prompt whether
    the block was opened there) -> ``qwen3``; a template that asks for
    Granite's ``Here is my thought process:`` -> ``granite``. Otherwise none.
    """
    if harmony_model:
        return GptOssReasoningParser, "the model speaks harmony (gpt-oss)"
    text = chat_template or ""
    if OPEN in text and CLOSE in text:
        return ThinkReasoningParser, f"the chat template writes {OPEN}...{CLOSE} blocks"
    if any(marker in text for marker in THOUGHT_MARKERS):
        return GraniteReasoningParser, "the chat template asks for Granite's thought process"
    return None, "the chat template shows no reasoning format"


def get_reasoning_parser(
    name: str | None, harmony_model: bool = False, chat_template: str | None = None
) -> type[ReasoningParser] | None:
    """The parser called ``name``; for ``"auto"``/None the one ``detect_reasoning_parser`` picks; ``"none"``: none.

    ValueError for an unknown name, listing the known ones.
    """
    if name is None or name == "auto":
        return detect_reasoning_parser(harmony_model, chat_template)[0]
    if name == "none":
        return None
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSER_CHOICES)}")
    return parser


def parse_reply(
    token_ids: Sequence[int], text: str = "", parser: str = "gpt_oss", prompt_text: str | None = None,
    calls_allowed: bool = True,
) -> ExtractedToolCalls:
    """A finished output split into ``reasoning_content``, ``content`` and (harmony's) ``tool_calls``.

    For ``LLM.chat``'s outputs: ``parse_reply(out.outputs[0].token_ids)`` for
    gpt-oss (``prompt_text=out.prompt`` with a thinking budget, whose prompt opens
    the analysis message); the ``<think>`` parsers read ``text`` (and ``prompt_text``).
    """
    cls = get_reasoning_parser(parser)
    if cls is None:
        return ExtractedToolCalls(text, [])
    return ReplyParser(cls(prompt_text=prompt_text, calls_allowed=calls_allowed), None).extract(text, token_ids)
