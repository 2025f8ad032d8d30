"""Tool-call parsers: the model's output text -> content and OpenAI tool calls.

Two formats that chat templates define, chosen by name as vLLM's
``--tool-call-parser`` does, or from the chat template:

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Qwen2.5/Qwen3, Hermes)
    llama3_json   {"name": ..., "parameters": {...}}; ...                   (Llama 3.1-3.3)

and two for the outputs ``tool_choice`` forces with a grammar
(``NamedFunctionParser``, ``RequiredToolsParser``). All share
``ToolParser``'s interface: ``feed``/``finish`` per streamed choice,
``extract`` for a whole output. No torch here: this runs on the server's
event loop.
"""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    assemble_deltas,
    new_tool_call_id,
)
from pagedllm.entrypoints.openai.tool_parsers.constrained import (
    NamedFunctionParser,
    RequiredToolsParser,
)
from pagedllm.entrypoints.openai.tool_parsers.hermes import START as HERMES_START
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "NamedFunctionParser",
    "RequiredToolsParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "assemble_deltas",
    "detect_tool_parser",
    "get_tool_parser",
    "new_tool_call_id",
]

# the parsers a server can be told to use, by vLLM's names
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
# Llama 3.x templates describe the call as {"name": function name, "parameters": ...}
_LLAMA3_HINT = re.compile(r"\"parameters\"\s*:")


def detect_tool_parser(chat_template: str | None) -> type[ToolParser]:
    """The parser for the call format a chat template asks for.

    A template that mentions ``<tool_call>`` is Hermes-style; one with
    ``<|python_tag|>`` or a ``"parameters":`` call description is Llama 3
    JSON. Anything else (no template, or a template with no tool support)
    gets Hermes, the format of most open models with tool templates; a
    template without tool support never shows the model its tools, so there
    only ``"required"`` and named functions (enforced by a grammar) give calls.
    """
    text = chat_template or ""
    if HERMES_START in text:
        return HermesToolParser
    if "<|python_tag|>" in text or _LLAMA3_HINT.search(text):
        return Llama3JsonToolParser
    return HermesToolParser


def get_tool_parser(name: str | None = "auto", chat_template: str | None = None) -> type[ToolParser]:
    """The parser called ``name`` (``hermes``, ``llama3_json``), or for ``"auto"``/None the one the template asks for.

    ValueError for an unknown name, listing the known ones.
    """
    if name is None or name == "auto":
        return detect_tool_parser(chat_template)
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown tool call parser {name!r}; known: auto, {', '.join(sorted(TOOL_PARSERS))}")
    return parser

