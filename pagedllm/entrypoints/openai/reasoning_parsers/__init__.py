"""Reasoning parsers: a choice's output -> ``reasoning_content``, content (and harmony's tool calls).

Chosen by name as vLLM's ``--reasoning-parser`` is, or from the model:

    gpt_oss       harmony channels (gpt-oss): analysis, final, commentary calls
    qwen3         <think>...</think>, opened in the output or by the prompt
    deepseek_r1   the same, assumed opened by the prompt when it is not known

``auto`` picks ``gpt_oss`` for a gpt-oss model (``harmony.detect``), the
one choice that is never ambiguous; ``<think>`` models are served plainly
unless named, since some templates mention ``<think>`` without the model
always writing it. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.gpt_oss import GptOssReasoningParser
from pagedllm.entrypoints.openai.reasoning_parsers.reply_parser import ReplyParser
from pagedllm.entrypoints.openai.reasoning_parsers.think import (
    DeepSeekR1ReasoningParser,
    ThinkReasoningParser,
)
from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "GptOssReasoningParser",
    "ReasoningParser",
    "ReplyParser",
    "ThinkReasoningParser",
    "get_reasoning_parser",
    "parse_reply",
]

# the parsers a server can be told to use, by vLLM's names
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    GptOssReasoningParser.name: GptOssReasoningParser,
    ThinkReasoningParser.name: ThinkReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}
REASONING_PARSER_CHOICES = ("auto", "none", *sorted(REASONING_PARSERS))


def get_reasoning_parser(name: str | None, harmony_model: bool = False) -> type[ReasoningParser] | None:
    """The parser called ``name``; for ``"auto"``/None ``gpt_oss`` on a harmony model, else none; ``"none"``: none.

    ValueError for an unknown name, listing the known ones.
    """
    if name is None or name == "auto":
        return GptOssReasoningParser if harmony_model else None
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
    gpt-oss; the ``<think>`` parsers read ``text`` (and ``prompt_text``).
    """
    cls = get_reasoning_parser(parser)
    if cls is None:
        return ExtractedToolCalls(text, [])
    return ReplyParser(cls(prompt_text=prompt_text, calls_allowed=calls_allowed), None).extract(text, token_ids)
