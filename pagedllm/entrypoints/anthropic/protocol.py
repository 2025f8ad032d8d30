"""Request bodies of Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``).

Validated strictly, as Anthropic's API does: an unknown field or a wrong
type is a 400 (in Anthropic's error shape, ``errors.py``). ``max_tokens`` is
required, as Anthropic requires it. Fields that ask for nothing this server
could do differently are accepted and have no effect: ``cache_control``
(the prefix cache is automatic), ``metadata.user_id``, ``service_tier``,
a tool's ``strict``. Image and document blocks pass the schema so that
``convert.py`` can refuse them with a sentence saying the model takes no
images, rather than a schema error.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import JsonInt, StopString, _Body
from pagedllm.sampling_params import MAX_INT32

# Anthropic's rule for tool names
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    """``cache_control``: a prompt-caching hint; pagedllm caches every shared prefix by itself."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    """``{"type": "text", "text": ...}``; ``citations`` come back with earlier replies and are not read."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class MediaBlock(BaseModel):
    """An image or document block: accepted by the schema, then refused (the model takes no images)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["image", "document"]


class ToolUseBlock(_Strict):
    """An earlier reply's call: ``{"type": "tool_use", "id", "name", "input": {...}}``."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    """The result of a call, in a user message: ``{"type": "tool_result", "tool_use_id", "content"}``."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    """An earlier reply's thinking, sent back as clients do; the chat templates do not show it again."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    """An earlier reply's redacted thinking (never produced here); dropped."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    """One turn: ``user`` or ``assistant``, its content a string or a list of blocks."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    """A client tool: its name, what it does, and its input's JSON schema."""

    name: str = Field(pattern=TOOL_NAME.pattern)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoiceAuto(_Strict):
    """The model decides whether to call."""

    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Strict):
    """The reply is at least one call (a grammar forces it)."""

    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Strict):
    """The reply is a call of the named tool (a grammar forces it)."""

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Strict):
    """No calls: the reply is text."""

    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Strict):
    """Thinking on: the template is asked for it, and the reasoning parser's output is sent as thinking blocks.

    ``budget_tokens`` must be below ``max_tokens`` (Anthropic's rule; not its minimum of 1,024); the
    thinking is closed after that many tokens (the chat route's ``thinking_token_budget``, gpt-oss's
    analysis channel included; see docs/messages-api.md).
    """

    type: Literal["enabled"]
    budget_tokens: JsonInt = Field(ge=1, le=MAX_INT32)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Strict):
    """Thinking off: the template is asked for no thinking (``enable_thinking: false``)."""

    type: Literal["disabled"]


class ThinkingAdaptive(_Strict):
    """The model decides: the template's default, thinking blocks wherever the reasoning parser finds thinking."""

    type: Literal["adaptive"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class Metadata(_Strict):
    """``metadata``: the caller's user id, for its own records; unused here."""

    user_id: str | None = None


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: the prompt a messages request would make, counted."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: JsonInt = Field(ge=1, le=MAX_INT32)
    stop_sequences: list[StopString] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: JsonInt | None = Field(None, ge=0, le=MAX_INT32)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
