"""The tools of a chat request: their checks, the grammar that enforces ``tool_choice``, and reading the output.

What the chat route does with it, in order::

    spec = ToolSpec.from_request(req.tools, req.tool_choice, req.parallel_tool_calls)
                                  # ToolRequestError (a ValueError with .param) -> 400; converts each
                                  # schema with xgrammar, so call it off the event loop
    prompt = tokenizer.apply_chat_template(to_template_messages(req.messages),
                                           tools=spec.template_tools())
    params.structured_outputs = spec.structured_outputs()   # None for "none"/"auto"
    # non-streamed, per choice:
    result = spec.extract(c.text, parser_cls)          # .content, .tool_calls
    finish = spec.finish_reason(c.finish_reason, result.tools_called)
    # streamed, per choice:
    parser = spec.new_parser(parser_cls)               # None: send the text as content
    delta = parser.feed(new_text) ... parser.finish()  # DeltaMessage | None each
    finish = spec.finish_reason(c.finish_reason, parser.num_calls > 0)

``parser_cls`` is ``tool_parsers.get_tool_parser(name_or_auto, chat_template)``,
chosen once per server.

``tool_choice`` as vLLM implements it:

- ``"none"``: no parsing, the text is the content. The tools still go to
  the template (vLLM's default), so the model knows them;
- ``"auto"`` (the default when there are tools): the model's own call format
  is parsed from its output (``tool_parsers``);
- ``"required"``: the output is constrained to a JSON array of ``{"name":
  <a tool's name>, "parameters": <that tool's arguments>}`` (at most one
  item with ``parallel_tool_calls: false``), so every answer has at least
  one call whose arguments follow the function's schema;
- a named function: the output is constrained to that function's arguments
  object, and the answer is one call to it.

OpenAI's finish reason is ``tool_calls`` when an ``auto`` or ``required``
answer holds calls, and ``stop`` for a named function (as OpenAI answers a
forced call); ``length`` stays ``length``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers import (
    ExtractedToolCalls,
    NamedFunctionParser,
    RequiredToolsParser,
    ToolParser,
    assemble_deltas,
)
from pagedllm.sampling_params import StructuredOutputsParams, check_text
from pagedllm.structured_output.limits import GrammarLimitError, GrammarLimits, check_schema

# OpenAI's rule for function names
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
# keywords whose values are data, not schemas: a "$ref" inside them is not a reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# keywords whose values map names to schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class ToolRequestError(ValueError):
    """A request's tools, tool_choice or parallel_tool_calls are invalid; ``param`` names the field (for a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    """One function tool of a request (OpenAI's ``tools[i].function``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates read it: ``{"type": "function", "function": {...}}``, unset fields left out."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def arguments_schema(self) -> dict[str, Any]:
        """The JSON schema of the arguments object: ``parameters``, made an object schema.

        No parameters means a function without arguments (``{}`` only), as vLLM reads it.
        """
        if self.parameters is None:
            return {"type": "object", "properties": {}}
        return {**self.parameters, "type": "object"}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and how it wants them used; build it with ``from_request``.

    Attributes:
        tools: the function tools, in request order.
        tool_choice: ``"none"``, ``"auto"``, ``"required"`` or ``"function"``
            (a named function, ``function_name``). ``"none"`` whenever there
            are no tools.
        function_name: the function a named ``tool_choice`` forces.
        parallel_tool_calls: False: at most one call per answer.
    """

    tools: tuple[FunctionTool, ...] = ()
    tool_choice: str = "none"
    function_name: str | None = None
    parallel_tool_calls: bool = True

    @classmethod
    def from_request(
        cls, tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None,
        parallel_tool_calls: bool | None = None, check_schemas: bool = True, limits: GrammarLimits | None = None,
    ) -> ToolSpec:
        """Check the request's tool fields and resolve them; ToolRequestError naming the field at fault.

        ``check_schemas``: convert each tool's parameters with xgrammar, so a
        schema that is not one (a number where a schema belongs, a bad
        ``pattern``...) is refused here whatever ``tool_choice`` is; keywords
        xgrammar does not enforce are accepted. ``limits``: the structural
        limits each schema (and a forced call's schema) must be within first,
        so the conversion stays cheap (default ``GrammarLimits()``).
        """
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ToolRequestError(f"parallel_tool_calls must be a boolean, got {parallel_tool_calls!r}",
                                   "parallel_tool_calls")
        limits = limits if limits is not None else GrammarLimits()
        parsed = _parse_tools(tools, check_schemas, limits)
        choice, name = _parse_tool_choice(tool_choice, parsed)
        spec = cls(parsed, choice, name, parallel_tool_calls is not False)
        forced = spec.constraint_schema()
        if forced is not None:
            # what the grammar is compiled from: all tools together for "required"
            _check_limits(forced, f"tool_choice={choice!r} forces a schema that", "tool_choice", limits)
        if check_schemas and choice == "required":
            _check_schema(forced, "tools", "tools")  # the combined schema's references
        return spec

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for calls (any tool_choice but ``"none"``)."""
        return self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What to pass as ``tools=`` to ``apply_chat_template`` (None without tools)."""
        return [tool.template_dict() for tool in self.tools] or None

    def constraint_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow, for ``"required"`` and a named function; None otherwise."""
        if self.tool_choice == "function":
            return next(t for t in self.tools if t.name == self.function_name).arguments_schema()
        if self.tool_choice != "required":
            return None
        items, defs = [], {}
        for i, tool in enumerate(self.tools):
            # each schema moves under $defs, its own "#..." references with it
            key = f"tool_{i}"
            defs[key] = _rebase_refs(tool.arguments_schema(), f"#/$defs/{key}")
            items.append({
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": {"$ref": f"#/$defs/{key}"}},
                "required": ["name", "parameters"],
            })
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return schema

    def structured_outputs(self, disable_any_whitespace: bool = True) -> StructuredOutputsParams | None:
        """The constraint to put in SamplingParams (None for ``"none"`` and ``"auto"``).

        ``disable_any_whitespace`` (default True, unlike vLLM): the arguments
        are read by programs, and a small model at a high temperature
        otherwise spends its token budget on newlines inside the JSON.
        """
        schema = self.constraint_schema()
        if schema is None:
            return None
        return StructuredOutputsParams(json=schema, disable_any_whitespace=disable_any_whitespace)

    def new_parser(self, auto_parser: type[ToolParser], *, buffered: bool = False) -> ToolParser | None:
        """A parser for one choice's output (None for ``"none"``: the text is the content).

        ``auto_parser``: the model's call format (``tool_parsers.get_tool_parser``), used for ``"auto"``.
        """
        max_calls = None if self.parallel_tool_calls else 1
        if self.tool_choice == "none":
            return None
        if self.tool_choice == "auto":
            if auto_parser.needs_tools:  # values typed by the tools' schemas (qwen3_coder)
                return auto_parser(max_calls, buffered=buffered, tools=self.tools)
            return auto_parser(max_calls, buffered=buffered)
        if self.tool_choice == "required":
            return RequiredToolsParser(max_calls, buffered=buffered)
        return NamedFunctionParser(max_calls, buffered=buffered, function_name=self.function_name)

    def extract(self, text: str, auto_parser: type[ToolParser]) -> ExtractedToolCalls:
        """A whole output split into content and calls (for a non-streamed answer)."""
        parser = self.new_parser(auto_parser, buffered=True)
        if parser is None:
            return ExtractedToolCalls(text, [])
        return assemble_deltas([parser.feed(text), parser.finish()])

    def finish_reason(self, finish_reason: str | None, tools_called: bool) -> str | None:
        """OpenAI's finish reason for a choice whose engine finish reason is ``finish_reason``."""
        if finish_reason == "stop" and tools_called and self.tool_choice in ("auto", "required"):
            return "tool_calls"
        return finish_reason


def _parse_tools(
    tools: Sequence[Mapping[str, Any]] | None, check_schemas: bool, limits: GrammarLimits
) -> tuple[FunctionTool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ToolRequestError(f"tools must be a list of function tools, got {type(tools).__name__}", "tools")
    parsed: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        parsed.append(_parse_tool(tool, f"tools[{i}]", check_schemas, limits))
    names = [t.name for t in parsed]
    for name in names:
        if names.count(name) > 1:
            raise ToolRequestError(f"tools has two functions named {name!r}; names must be unique", "tools")
    return tuple(parsed)


def _parse_tool(tool: object, where: str, check_schemas: bool, limits: GrammarLimits) -> FunctionTool:
    """One ``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``."""
    _check_keys(tool, where, {"type", "function"})
    if tool.get("type") != "function":
        raise ToolRequestError(f"{where}.type must be 'function' (the only tool type supported), "
                               f"got {tool.get('type')!r}", "tools")
    function = tool.get("function")
    _check_keys(function, f"{where}.function", {"name", "description", "parameters", "strict"})
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ToolRequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                               "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolRequestError(f"{where}.function.description must be a string", "tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolRequestError(f"{where}.function.strict must be a boolean", "tools")
    try:
        check_text(where, json.dumps(tool, ensure_ascii=False))
    except (TypeError, ValueError) as e:
        raise ToolRequestError(f"{where} is not JSON text: {e}", "tools") from None
    parameters = function.get("parameters")
    if parameters is not None:
        parameters = _check_parameters(parameters, f"{where}.function.parameters", check_schemas, limits)
    return FunctionTool(name, description, parameters)


def _check_keys(value: object, where: str, allowed: set[str]) -> None:
    if not isinstance(value, Mapping):
        raise ToolRequestError(f"{where} must be an object, got {type(value).__name__}", "tools")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ToolRequestError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}", "tools")


def _check_parameters(parameters: object, where: str, check_schemas: bool, limits: GrammarLimits) -> dict[str, Any]:
    """A function's parameters: a JSON schema of an object."""
    if not isinstance(parameters, Mapping):
        raise ToolRequestError(f"{where} must be a JSON schema (an object), got {type(parameters).__name__}", "tools")
    parameters = dict(parameters)
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ToolRequestError(f"{where} must describe an object (the arguments), got type {kind!r}", "tools")
    _check_limits(parameters, where, "tools", limits)
    if check_schemas:
        _check_schema({**parameters, "type": "object"}, where, "tools")
    return parameters


def _check_limits(schema: dict[str, Any], where: str, param: str, limits: GrammarLimits) -> None:
    """ToolRequestError when ``schema`` is over a structural limit (before xgrammar converts it)."""
    try:
        check_schema(schema, where, limits)
    except GrammarLimitError as e:
        raise ToolRequestError(str(e), param) from None


def _check_schema(schema: dict[str, Any], where: str, param: str) -> None:
    """ToolRequestError unless xgrammar can convert ``schema`` to a grammar."""
    reason = _schema_error(json.dumps(schema, sort_keys=True))
    if reason is not None:
        raise ToolRequestError(f"{where} is not a valid JSON schema: {reason}", param)


@functools.lru_cache(maxsize=64)  # keys up to GrammarLimits.max_bytes each
def _schema_error(schema_json: str) -> str | None:
    """Why xgrammar cannot convert a schema, or None; cached, since agents send the same tools every turn."""
    import xgrammar as xgr  # imports torch: only when a request has tools

    try:
        xgr.Grammar.from_json_schema(schema_json)
    except (RuntimeError, ValueError, TypeError) as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return re.sub(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*", "", lines[0]) if lines else type(e).__name__
    return None


def _parse_tool_choice(
    tool_choice: str | Mapping[str, Any] | None, tools: tuple[FunctionTool, ...]
) -> tuple[str, str | None]:
    """(mode, function name) from ``tool_choice``: ``"auto"`` by default with tools, ``"none"`` without."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ToolRequestError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                                   f"got {tool_choice!r}", "tool_choice")
        if tool_choice == "required" and not tools:
            raise ToolRequestError("tool_choice 'required' needs tools", "tool_choice")
        return (tool_choice if tools else "none"), None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or set(tool_choice) != {
        "type", "function"
    }:
        raise ToolRequestError("tool_choice must be a string or {'type': 'function', 'function': {'name': ...}}",
                               "tool_choice")
    function = tool_choice["function"]
    if not isinstance(function, Mapping) or set(function) != {"name"} or not isinstance(function["name"], str):
        raise ToolRequestError("tool_choice.function must be {'name': <a tool's name>}", "tool_choice")
    name = function["name"]
    if name not in {t.name for t in tools}:
        known = ", ".join(repr(t.name) for t in tools) or "none"
        raise ToolRequestError(f"tool_choice names the function {name!r}, which is not in tools (tools: {known})",
                               "tool_choice")
    return "function", name


def _rebase_refs(node: Any, prefix: str) -> Any:
    """A copy of a schema whose local references (``#...``) point at ``prefix``, where it now lives."""
    if isinstance(node, list):
        return [_rebase_refs(x, prefix) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = prefix + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, prefix) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, prefix)
    return out
