"""Tool-call parsers: the model's output text -> content and OpenAI tool calls.

The formats that chat templates define, chosen by name as vLLM's
``--tool-call-parser`` does, or from the chat template:

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Qwen2.5/Qwen3, Hermes)
    llama3_json   {"name": ..., "parameters": {...}}; ...                   (Llama 3.1-3.3)
    qwen3_coder   <tool_call><function=NAME><parameter=ARG>V</parameter>...  (Qwen3-Coder, Qwen3.5)
    mistral       [TOOL_CALLS][{"name": ..., "arguments": ...}] or [TOOL_CALLS]NAME[ARGS]{...}
    pythonic      [get_weather(city="Paris"), ...]                          (Llama 3.2/4 pythonic)

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
from pagedllm.entrypoints.openai.tool_parsers.mistral import TOOL_CALLS as MISTRAL_START
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import FUNCTION as QWEN3_CODER_FUNCTION
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedFunctionParser",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
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
    Qwen3CoderToolParser.name: Qwen3CoderToolParser,
    MistralToolParser.name: MistralToolParser,
    PythonicToolParser.name: PythonicToolParser,
}
# Llama 3.x templates describe the call as {"name": function name, "parameters": ...}
_LLAMA3_HINT = re.compile(r"\"parameters\"\s*:")
# pythonic templates show the call syntax as [func_name1(params_name1=params_value1, ...), ...]
_PYTHONIC_HINT = re.compile(r"\[\s*func_name1?\s*\(")


def detect_tool_parser(chat_template: str | None) -> type[ToolParser]:
    """The parser for the call format a chat template asks for.

    In this order: a template that mentions ``<function=`` (with
    ``<tool_call>``) is Qwen3-Coder's XML; one with ``[TOOL_CALLS]`` is
    Mistral's; one that shows ``[func_name1(...)`` is pythonic; one that
    mentions ``<tool_call>`` is Hermes-style; one with ``<|python_tag|>`` or
    a ``"parameters":`` call description is Llama 3 JSON. Anything else (no
    template, or a template with no tool support) gets Hermes, the format of
    most open models with tool templates; a template without tool support
    never shows the model its tools, so there only ``"required"`` and named
    functions (enforced by a grammar) give calls.
    """
    text = chat_template or ""
    if QWEN3_CODER_FUNCTION in text and HERMES_START in text:
        return Qwen3CoderToolParser
    if MISTRAL_START in text:
        return MistralToolParser
    if _PYTHONIC_HINT.search(text):
        return PythonicToolParser
    if HERMES_START in text:
        return HermesToolParser
    if "<|python_tag|>" in text or _LLAMA3_HINT.search(text):
        return Llama3JsonToolParser
    return HermesToolParser


def get_tool_parser(name: str | None = "auto", chat_template: str | None = None) -> type[ToolParser]:
    """The parser called ``name`` (a key of ``TOOL_PARSERS``), or for ``"auto"``/None the one the template asks for.

    ValueError for an unknown name, listing the known ones.
    """
    if name is None or name == "auto":
        return detect_tool_parser(chat_template)
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown tool call parser {name!r}; known: auto, {', '.join(sorted(TOOL_PARSERS))}")
    return parser

