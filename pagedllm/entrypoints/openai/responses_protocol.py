"""The request body of ``POST /v1/responses`` (OpenAI's Responses API) and its translation to a chat request.

Checked as strictly as the other routes' bodies (``protocol.py``: an unknown
field or a wrong type is a 400). A request becomes a ``ChatCompletionRequest``
(``to_chat_request``), so it goes through the chat route's machinery: the chat
template, the tool parsers and ``tool_choice``'s grammars, structured outputs,
the reasoning parser. What differs is translated here:

- ``input`` items -> chat messages (``response_items.py``), after the stored
  conversation of ``previous_response_id``, and ``instructions`` as a leading
  ``system`` message;
- ``tools`` in the Responses' flat shape (``{"type": "function", "name", ...}``)
  -> chat's nested one; ``tool_choice`` ``{"type": "function", "name"}`` likewise;
- ``text.format`` (``json_schema`` / ``json_object`` / ``text``) -> ``response_format``;
- ``reasoning.effort`` -> ``reasoning_effort`` (harmony) and the chat template's
  ``reasoning_effort`` variable (other templates that read it);
- ``max_output_tokens`` -> ``max_completion_tokens``.

Fields OpenAI defines that mean nothing on a local server are accepted with
their meaning stated: ``store`` (kept here, ``response_store.py``),
``metadata`` (echoed), ``user``, ``safety_identifier``, ``prompt_cache_key``
(the prefix cache needs no key), ``service_tier`` (one tier), ``include``
(only ``reasoning.encrypted_content``: asked for by Codex, never produced: reasoning items
carry their text instead),
``text.verbosity``. Those it would have to fake (``background``, hosted tools,
``truncation: "auto"``, ``top_logprobs``) are 400s. vLLM's ``seed`` and
``structured_outputs`` (a regex, a choice, a grammar...) are taken too, as on
the chat route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import (
    MAX_INT32,
    ChatCompletionRequest,
    JsonInt,
    StructuredOutputsRequest,
    _Body,
    _ranged,
    _Strict,
    bad_request,
    unsupported,
)
from pagedllm.entrypoints.openai.response_items import ResponseItemError, items_to_messages
from pagedllm.sampling_params import INT64_RANGE, MAX_FLOAT32

# reasoning efforts OpenAI defines; harmony (gpt-oss) knows low, medium and high
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
HARMONY_EFFORTS = ("low", "medium", "high")


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or JSON following a named schema (flat, unlike chat's)."""

    # what the schema says of the rule ``_response_format`` checks: json_schema comes with its schema
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"required": ["schema"], "properties": {"schema": {"type": "object"}}},
    ]})

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    """``text``: the output's format; ``verbosity`` is a hint to OpenAI's models that no local model reads."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Strict):
    """``reasoning``: how long a reasoning model thinks (``effort``); summaries are not made (the full
    reasoning text comes back instead, as ``reasoning_text`` content)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(_Strict):
    """``stream_options``: ``include_obfuscation`` pads events against side channels on OpenAI's wire;
    a local server's events are not padded."""

    include_obfuscation: bool | None = None


# what ``input`` may hold, for /openapi.json (``response_items.py`` checks it): a string, or input items
_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
_REFUSAL_PART = {"type": "object", "required": ["type", "refusal"], "properties": {
    "type": {"const": "refusal"}, "refusal": {"type": "string"}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART, _REFUSAL_PART]}}]}
_NAME = {"type": "string", "minLength": 1}
_INPUT_ITEMS = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
        "content": _CONTENT}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": _NAME, "name": _NAME, "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": _NAME, "output": _CONTENT}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}},
]}
_INPUT: Any = Field(None, json_schema_extra={"anyOf": [
    {"type": "string"}, {"type": "array", "minItems": 1, "items": _INPUT_ITEMS}, {"type": "null"}]})
# a function tool in the Responses' flat shape (``_chat_tool`` checks it; hosted tools are refused)
_TOOLS: Any = Field(None, json_schema_extra={"anyOf": [{"type": "array", "items": {
    "type": "object", "required": ["type", "name"], "additionalProperties": False, "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": ["string", "null"]}, "parameters": {"type": ["object", "null"]},
        "strict": {"type": ["boolean", "null"]}}}}, {"type": "null"}]})
_TOOL_CHOICE: Any = Field(None, json_schema_extra={"anyOf": [
    {"enum": ["none", "auto", "required"]}, {"type": "null"},
    {"type": "object", "required": ["type", "name"], "additionalProperties": False,
     "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]})


class ResponsesRequest(_Body):
    """``POST /v1/responses``."""

    # rules across fields: input (with a message, a call or a call's output, unless instructions make one) unless
    # a stored conversation continues; stream_options needs stream
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"anyOf": [{"required": ["previous_response_id"], "properties": {"previous_response_id": {"type": "string"}}},
                   {"required": ["input", "instructions"],
                    "properties": {"input": {"not": {"type": "null"}}, "instructions": {"type": "string"}}},
                   {"required": ["input"], "properties": {"input": {"anyOf": [
                       {"type": "string"}, {"type": "array", "contains": {"anyOf": _INPUT_ITEMS["anyOf"][:3]}}]}}}]},
        {"anyOf": [{"properties": {"stream_options": {"type": "null"}}},
                   {"required": ["stream"], "properties": {"stream": {"const": True}}}]},
    ]})

    model: str | None = None
    input: str | list[Any] | None = _INPUT
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = _TOOLS
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = _TOOL_CHOICE
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: JsonInt | None = _ranged(None, minimum=1, maximum=MAX_INT32)
    temperature: float | None = _ranged(None, minimum=0, maximum=MAX_FLOAT32)
    top_p: float | None = _ranged(None, exclusiveMinimum=0, maximum=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, json_schema_extra={"maxProperties": 16})
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # what would have to be faked is refused (``check``), and the schema says which values are served
    truncation: Literal["disabled", "auto"] | None = Field(
        None, json_schema_extra={"anyOf": [{"const": "disabled"}, {"type": "null"}]})
    background: bool | None = Field(None, json_schema_extra={"anyOf": [{"const": False}, {"type": "null"}]})
    top_logprobs: JsonInt | None = Field(None, json_schema_extra={"anyOf": [{"const": 0}, {"type": "null"}]})
    # vLLM's extensions, as its chat route takes them: a sampling seed and a constraint (regex, choice...)
    seed: JsonInt | None = _ranged(None, minimum=INT64_RANGE[0], maximum=INT64_RANGE[1])
    structured_outputs: StructuredOutputsRequest | None = None

    def check(self) -> None:
        """400 for what this server does not do (rather than pretending) and for values out of OpenAI's rules."""
        if self.background:
            raise unsupported("background", "answers are produced while the request waits; leave it false")
        if self.truncation == "auto":
            raise unsupported("truncation", "a conversation over the context is refused, never cut; use 'disabled'")
        if self.top_logprobs:
            raise unsupported("top_logprobs", "use /v1/chat/completions for logprobs")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")
        if self.metadata is not None and len(self.metadata) > 16:
            raise bad_request(f"metadata may hold at most 16 pairs, got {len(self.metadata)}", "metadata")
        if isinstance(self.input, list) and not self.input:
            raise bad_request("input must not be an empty list", "input")
        if self.input is None and self.previous_response_id is None:
            raise bad_request("missing required parameter: 'input'", "input", "missing_required_parameter")

    def to_chat_request(
        self, conversation: list[dict[str, Any]], harmony: bool
    ) -> ChatCompletionRequest:
        """The chat request this one is: ``conversation`` (earlier turns and this input, as items) with the
        instructions, tools, format and sampling fields translated; 400 naming the Responses field at fault.

        ``harmony``: the model speaks harmony (gpt-oss), which takes the effort itself; other templates get it
        as the ``reasoning_effort`` variable.
        """
        try:
            messages = items_to_messages(conversation)
        except ResponseItemError as e:
            raise bad_request(str(e), e.param, e.code) from e
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise bad_request("the conversation is empty: give input", "input")
        body: dict[str, Any] = {"messages": messages, "stream": self.stream}
        for name in ("model", "temperature", "top_p", "parallel_tool_calls", "seed"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.structured_outputs is not None:
            body["structured_outputs"] = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools is not None:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = self._response_format()
        if fmt is not None:
            body["response_format"] = fmt
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is not None:
            if harmony:
                if effort not in HARMONY_EFFORTS:
                    raise bad_request(f"reasoning.effort {effort!r} is not one this model knows; use one of "
                                      f"{', '.join(HARMONY_EFFORTS)}", "reasoning")
                body["reasoning_effort"] = effort
            else:
                body["chat_template_kwargs"] = {"reasoning_effort": effort}
        return ChatCompletionRequest.model_validate(body)

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.schema_ is None:
            raise bad_request("text.format of type 'json_schema' needs a schema", "text",
                              "missing_required_parameter")
        schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema_}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": schema}


# the fields of a Responses function tool and which of them chat's ``function`` object carries
_TOOL_FIELDS = {"type", "name", "description", "parameters", "strict"}


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool (``{"type": "function", "function": {...}}``)."""
    kind = tool.get("type")
    if kind != "function":
        raise bad_request(f"tools[{i}].type {kind!r} is not supported: this server runs no hosted tools "
                          "(web search, file search, code interpreter...); only 'function' tools", "tools",
                          "unsupported_value")
    unknown = sorted(set(tool) - _TOOL_FIELDS)
    if unknown:
        raise bad_request(f"tools[{i}] has unknown field(s) {', '.join(map(repr, unknown))}", "tools")
    if "name" not in tool:
        raise bad_request(f"tools[{i}].name is missing: a function tool needs its name", "tools",
                          "missing_required_parameter")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """``tool_choice``: the strings as they are; ``{"type": "function", "name"}`` as chat's named choice."""
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or set(choice) != {"type", "name"} or not isinstance(choice["name"], str):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...} "
                          "(hosted tools and allowed_tools are not supported)", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}
