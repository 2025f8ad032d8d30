"""Request schemas of the OpenAI-compatible server, and their checks.

Requests are validated strictly (``extra="forbid"``, no type coercion), the
way OpenAI's API answers: an unknown field or a string where a number belongs
is a 400, never silently dropped or converted. Fields OpenAI defines that
pagedllm does not implement (``suffix``) are accepted only at
their default value; anything else is a 400 that says the field is not
supported, so no client believes it got what it asked for.

``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (string keys,
as JSON has them, turned into token ids) map onto SamplingParams. vLLM's
extra sampling fields are accepted too: ``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``repetition_penalty``, ``min_tokens``, ``allowed_token_ids``, ``bad_words``,
``truncate_prompt_tokens`` (and ``add_generation_prompt`` for chat).

Structured outputs: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``) and vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``, ``disable_any_whitespace``), on
both endpoints, as vLLM accepts them; one of the two per request.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException

from pagedllm.entrypoints.openai.json_response import find_lone_surrogate
from pagedllm.entrypoints.openai.tool_choice import ToolRequestError, ToolSpec
from pagedllm.entrypoints.openai.tool_messages import ToolMessageError, to_template_messages
from pagedllm.loader.tokenizer import TEMPLATE_RESERVED_NAMES
from pagedllm.sampling_params import (
    INT64_RANGE,
    MAX_ADDITIVE_PENALTY,
    MAX_FLOAT32,
    MAX_INT32,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedllm.structured_output.limits import GrammarLimits

# a stop string: SamplingParams refuses an empty one, so the schema says so too
StopString = Annotated[str, Field(min_length=1)]
# OpenAI's own upper bound on ``n``; also keeps one request from creating an
# unbounded number of sequences
MAX_N = 128


class APIError(HTTPException):
    """An error the server answers with an OpenAI-style body and a status.

    An ``HTTPException``, so FastAPI passes one raised while it reads a
    body (the body-size guard's 413) to the app's handler unchanged.

    Args:
        status_code: the HTTP status.
        message: what went wrong, for the client.
        type: OpenAI's error type (``invalid_request_error``...).
        code: OpenAI's error code, or None.
        param: the request field at fault, or None.
        headers: extra response headers (``Retry-After`` on a 429...).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status_code, message, headers)
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, "invalid_request_error", code, param)


def unsupported(param: str, what: str | None = None) -> APIError:
    """A 400 for an OpenAI field pagedllm does not implement (yet)."""
    return bad_request(
        f"'{param}' is not supported by this server yet{f' ({what})' if what else ''}; "
        "leave it unset or at its default",
        param,
        "unsupported_parameter",
    )


def _ranged(default: Any, **schema: Any) -> Any:
    """A field whose valid values the OpenAPI schema states (``minimum``...), checked by SamplingParams.

    The bounds are documentation for clients and fuzzers, not pydantic
    constraints: a value out of range gets SamplingParams' own message,
    the one the offline API gives.
    """
    return Field(default, json_schema_extra=schema)


def _json_integer(value: object) -> object:
    """An integral JSON number written with a fraction (``3.0``) as the integer it is; anything else unchanged.

    JSON Schema's ``integer`` is any number with a zero fraction, so the
    schema promises ``3.0`` is accepted; strict validation would refuse it.
    """
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# an integer as JSON Schema defines one (``3`` or ``3.0``; never ``"3"``, ``true`` or ``3.5``)
JsonInt = Annotated[int, BeforeValidator(_json_integer)]

# marks the schema of a token id, whose maximum ``served_model_schema`` lowers to the served vocabulary's
TOKEN_ID_MARK = "x-token-id"
_TOKEN_IDS = {"items": {"type": "integer", "minimum": 0, "maximum": MAX_INT32, TOKEN_ID_MARK: True}}
_NONEMPTY = {"minLength": 1}
# a token id as a validated type: the bounds are pydantic's, so the schema and the check are one
TokenId = Annotated[
    int, Field(ge=0, le=MAX_INT32, json_schema_extra={TOKEN_ID_MARK: True}), BeforeValidator(_json_integer)
]
# OpenAI fields pagedllm does not implement, accepted only as null (the schema says so)
UNSUPPORTED_FIELDS = ("suffix",)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# pydantic's error type for a string that is not Unicode text (``_describe`` turns it into the 400)
LONE_SURROGATE = "lone_surrogate"


class _Body(_Strict):
    """A request body: every string in it, object keys included, must be Unicode text.

    Checked once over the whole body before any field is validated, so every
    route and field refuses a lone UTF-16 surrogate the same way (a 400 naming
    where it is), and no later step (the model's 404, a validation message
    quoting the value, the tokenizer) ever meets one.
    """

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        found = find_lone_surrogate(data)
        if found is not None:
            where, index = found
            raise PydanticCustomError(
                LONE_SURROGATE, "{where} is not valid UTF-8 text: a lone surrogate at position {index}",
                {"where": where, "index": index},
            )
        return data


class StreamOptions(_Strict):
    """``stream_options``: only ``include_usage`` is defined by OpenAI."""

    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema.

    The output always follows the schema strictly (no properties it does
    not name), whatever ``strict`` says: ``strict: false`` asks for less.
    """

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: plain text, any JSON object, or JSON following a schema."""

    # what the schema says of the rule _constraint checks: json_schema (with a schema) exactly with its type
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"type": {"const": "json_schema"}, "json_schema": {"type": "object", "required": ["schema"],
                                                                          "properties": {"schema": {"type": "object"}}}},
         "required": ["json_schema"]},
        {"properties": {"type": {"not": {"const": "json_schema"}}, "json_schema": {"type": "null"}}},
    ]})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` extra field: the fields of ``StructuredOutputsParams``."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


# what the schema says of a rule across fields (checked in _check_common): stream_options needs stream true
_STREAM_OPTIONS_RULE = {"anyOf": [
    {"properties": {"stream_options": {"type": "null"}}},
    {"required": ["stream"], "properties": {"stream": {"const": True}}},
]}


class _SamplingRequest(_Body):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_RULE]})

    model: str | None = None
    n: JsonInt = _ranged(1, minimum=1, maximum=MAX_N)
    temperature: float | None = _ranged(None, minimum=0, maximum=MAX_FLOAT32)
    top_p: float | None = _ranged(None, exclusiveMinimum=0, maximum=1)
    seed: JsonInt | None = _ranged(None, minimum=INT64_RANGE[0], maximum=INT64_RANGE[1])
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own records; nothing to do here
    presence_penalty: float | None = _ranged(None, minimum=-MAX_ADDITIVE_PENALTY, maximum=MAX_ADDITIVE_PENALTY)
    frequency_penalty: float | None = _ranged(None, minimum=-MAX_ADDITIVE_PENALTY, maximum=MAX_ADDITIVE_PENALTY)
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias
    # vLLM's extra sampling fields
    top_k: JsonInt | None = _ranged(None, minimum=-1, maximum=MAX_INT32)
    min_p: float | None = _ranged(None, minimum=0, maximum=1)
    ignore_eos: bool = False
    stop_token_ids: list[JsonInt] | None = _ranged(None, **_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = _ranged(None, exclusiveMinimum=0, maximum=MAX_FLOAT32)
    min_tokens: JsonInt = _ranged(0, minimum=0, maximum=MAX_INT32)
    allowed_token_ids: list[JsonInt] | None = _ranged(None, minItems=1, **_TOKEN_IDS)
    bad_words: list[str] | None = None
    truncate_prompt_tokens: JsonInt | None = _ranged(None, minimum=1, maximum=MAX_INT32)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @property
    def constraint_param(self) -> str:
        """The request field that holds its structured-output constraint."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def _constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint of ``response_format`` or ``structured_outputs``; 400 when malformed."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise bad_request("set response_format or structured_outputs, not both", "structured_outputs")
        try:
            if self.structured_outputs is not None:
                so = self.structured_outputs
                return StructuredOutputsParams(
                    json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                    json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
                )
            if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
                raise ValueError("response_format.json_schema is only read with type 'json_schema'")
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        except ValueError as e:
            raise bad_request(str(e), self.constraint_param) from e

    def _logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with its JSON string keys as token ids; a key that is not one is a 400."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not re.fullmatch(r"[0-9]{1,19}", key):
                raise bad_request(f"logit_bias keys must be token ids (decimal integers), got {key!r}", "logit_bias")
            bias[int(key)] = value
        return bias

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")
        if self.n > MAX_N:
            raise bad_request(f"n must be at most {MAX_N}, got {self.n}", "n")

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None = None, best_of: int | None = None,
        prompt_logprobs: int | None = None, structured_outputs: StructuredOutputsParams | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        model = sampling_defaults or {}

        def pick(name: str, fallback: float) -> Any:  # noqa: ANN401 (the field's own type)
            """The request's value, else the model's default, else OpenAI's."""
            value = getattr(self, name)
            return value if value is not None else model.get(name, fallback)

        try:
            return SamplingParams(
                n=self.n,
                best_of=best_of,
                prompt_logprobs=prompt_logprobs,
                logprobs=logprobs,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                seed=self.seed,
                max_tokens=max_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
                frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
                repetition_penalty=pick("repetition_penalty", 1.0),
                min_tokens=self.min_tokens,
                logit_bias=self._logit_bias(),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                structured_outputs=structured_outputs or self._constraint(),
            )
        except ValueError as e:
            param = re.match(r"\w*", str(e)).group(0)  # the messages start with the field's name
            if param == "logprobs" and isinstance(self, ChatCompletionRequest):
                param = "top_logprobs"
            raise bad_request(str(e), param if param in type(self).model_fields else None) from e

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings, a list of token ids or a list
    of token-id lists; each prompt gets ``n`` choices, numbered
    ``prompt_index * n + i`` as in OpenAI's API.
    """

    prompt: str | list[str] | list[JsonInt] | list[list[JsonInt]] = Field(
        json_schema_extra={
            "anyOf": [
                {"type": "string", **_NONEMPTY},
                {"type": "array", "items": {"type": "string", **_NONEMPTY}, "minItems": 1},
                {"type": "array", "minItems": 1, **_TOKEN_IDS},
                {"type": "array", "items": {"type": "array", "minItems": 1, **_TOKEN_IDS}, "minItems": 1},
            ]
        }
    )
    max_tokens: JsonInt | None = _ranged(16, minimum=1, maximum=MAX_INT32)
    logprobs: JsonInt | None = _ranged(None, minimum=0, maximum=MAX_LOGPROBS)
    echo: bool = False
    best_of: JsonInt | None = _ranged(None, minimum=1, maximum=MAX_N)
    suffix: None = Field(None, description="not supported by this server: only null")

    def to_sampling_params(
        self, default_max_tokens: int | None = None, sampling_defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """Check the request and build its SamplingParams; raises APIError (400).

        ``max_tokens`` left out is OpenAI's 16; ``null`` is no limit but the
        context's, or ``default_max_tokens`` (the server's cap) when set,
        which also lowers the 16 of a request that left it out, never a value
        the request gives. ``sampling_defaults``: the model's
        (``GenerationDefaults.values``), for temperature, top_p, top_k, min_p
        and repetition_penalty the request leaves out.

        ``logprobs=k``: each output token's logprob and the k most likely
        alternatives. ``best_of``: sample that many, return the ``n`` with the
        highest cumulative logprob (known only at the end, so not streamable).
        ``echo``: each choice's text starts with its prompt; with ``logprobs``
        the prompt's tokens lead the lists, scored as the prompt (the first
        token has none).
        """
        self._check_common()
        if self.best_of is not None and self.best_of != self.n and self.stream:
            raise bad_request("best_of cannot be streamed: the best outputs are known only at the end", "best_of")
        if self.best_of is not None and self.best_of > MAX_N:
            raise bad_request(f"best_of must be at most {MAX_N}, got {self.best_of}", "best_of")
        # echo with logprobs scores the prompt too (lm-eval's log-likelihoods)
        prompt_logprobs = self.logprobs if self.echo else None
        max_tokens = self.max_tokens
        if default_max_tokens is not None and (max_tokens is None or "max_tokens" not in self.model_fields_set):
            max_tokens = default_max_tokens if max_tokens is None else min(max_tokens, default_max_tokens)
        return self._sampling_params(max_tokens, self.logprobs, self.best_of, prompt_logprobs,
                                     sampling_defaults=sampling_defaults)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # one prompt given as token ids
        else:
            prompts = list(p)
        if not prompts:
            raise bad_request("prompt must not be an empty list", "prompt")
        return prompts


class ContentPart(_Strict):
    """One part of a message's content; only text parts are supported.

    Any part type parses here, so that an image (or audio, a file) part is refused by
    ``engine/chat_content.py`` with a 400 saying the model takes no images, not with a schema error.
    """

    # the schema promises what is served: a text part (other parts are refused, as the schema says)
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        "required": ["type", "text"], "additionalProperties": False,
    })

    type: str
    text: str | None = None


class MessageFunctionCall(_Strict):
    """The function an assistant message called, with its arguments as JSON text."""

    name: str = Field(min_length=1)
    arguments: str


class MessageToolCall(_Strict):
    """One call in an assistant message's ``tool_calls`` (from an earlier answer)."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(_Strict):
    """One message of a conversation.

    ``content`` may be left out only by an assistant message that makes
    ``tool_calls``; a ``tool`` message answers one of them by
    ``tool_call_id``. Checked in ``tool_messages.to_template_messages``.
    """

    # what the schema says of the rule above: content, or an assistant's calls
    # and that a tool message names the call it answers
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"anyOf": [
            {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
            {"required": ["role", "tool_calls"], "properties": {
                "role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}},
        ]},
        {"anyOf": [
            {"properties": {"role": {"not": {"const": "tool"}}}},
            {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string", "minLength": 1}}},
        ]},
    ]})

    # OpenAI's roles (tool_messages.ROLES): the template prints a role verbatim, so no other string
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # an earlier reply's reasoning, as clients send replies back; not shown to the model again
    # (harmony drops earlier turns' analysis, and <think> templates drop earlier thinking)
    reasoning_content: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as OpenAI's plain JSON (for ``to_template_messages``)."""
        return self.model_dump(exclude_none=True)


class FunctionDefinition(_Strict):
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema when a call is forced


class ChatTool(_Strict):
    """One entry of ``tools``: only function tools exist."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    """The function a named ``tool_choice`` forces."""

    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming a function: the answer is one call to it."""

    type: Literal["function"]
    function: NamedFunction


# ``chat_template_kwargs``: template variables; the schema says which names the renderer keeps for itself
_TEMPLATE_KWARGS: Any = Field(None, json_schema_extra={"anyOf": [
    {"type": "object", "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$", "not": {"enum": sorted(
        TEMPLATE_RESERVED_NAMES)}}},
    {"type": "null"},
]})


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    # what the schema says of a rule across fields (checked in to_sampling_params): top_logprobs needs logprobs
    # rules across fields (checked in to_sampling_params): top_logprobs needs logprobs, as stream_options stream
    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_RULE, {"anyOf": [
        {"properties": {"top_logprobs": {"type": "null"}}},
        {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    ]}]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: JsonInt | None = _ranged(None, minimum=1, maximum=MAX_INT32)
    max_completion_tokens: JsonInt | None = _ranged(None, minimum=1, maximum=MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: JsonInt | None = _ranged(None, minimum=0, maximum=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # how long a reasoning model thinks: gpt-oss's harmony system message carries it
    # (reasoning_parsers/, harmony/prompt.py); other models have no such setting and ignore it
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking...), as LLM.chat takes them
    chat_template_kwargs: dict[str, Any] | None = _TEMPLATE_KWARGS
    # OpenAI's stored completions (its dashboard, evals, GET /v1/chat/completions): this server keeps no
    # completion once answered, so only "do not store" is true of it; store=true is a 400 (no_store_check)
    store: bool | None = Field(None, json_schema_extra={"anyOf": [{"const": False}, {"type": "null"}]})
    # key-value tags of a stored completion (OpenAI: at most 16, keys up to 64 characters, values up to 512);
    # checked, then unused: nothing is stored to tag, and replies do not echo them (OpenAI's do not either)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, json_schema_extra={"maxProperties": 16})
    # OpenAI's processing tier; one local server has one tier, which the reply names ("default")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # vLLM's: at most this many reasoning tokens, then the server's reasoning parser's end marker is forced
    # (thinking_budget.py; serving_chat applies it, a 400 without a reasoning parser that has markers)
    thinking_token_budget: JsonInt | None = _ranged(None, minimum=0, maximum=MAX_INT32)

    @property
    def constraint_param(self) -> str:
        """The request field that holds its structured-output constraint (``tool_choice`` when it forces calls)."""
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            return "tool_choice"
        return super().constraint_param

    def tool_spec(self, limits: GrammarLimits | None = None) -> ToolSpec:
        """The request's tools, checked (their schemas converted by xgrammar: call it off the event loop); 400.

        ``limits``: the engine's structured-output limits, which each schema must be within.
        """
        tools = None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice
        try:
            return ToolSpec.from_request(tools, choice, self.parallel_tool_calls, limits=limits)
        except ToolRequestError as e:
            raise bad_request(str(e), e.param) from e

    def to_sampling_params(
        self, tools: ToolSpec | None = None, default_max_tokens: int | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """Check the request and build its SamplingParams; raises APIError (400).

        With no ``max_tokens``/``max_completion_tokens`` the reply may run to
        the end of the context, as in OpenAI and vLLM, unless the server sets
        ``default_max_tokens`` (``--default-max-tokens``, else the model's
        max_new_tokens), which then caps it; a value the request gives is used
        as it is. ``sampling_defaults``: the model's, for the sampling fields
        the request leaves out (as ``CompletionRequest``'s). ``tools``: the request's checked
        tools; a forced call (``required``, a named function) becomes the
        structured-output constraint, so it cannot be combined with another.
        """
        self._check_common()
        self._check_stored_fields()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        forced = tools.structured_outputs() if tools is not None else None
        if forced is not None and self._constraint() is not None:
            raise bad_request(
                f"tool_choice {self.tool_choice if isinstance(self.tool_choice, str) else 'naming a function'!r} "
                "constrains the output already; it cannot be combined with response_format or structured_outputs",
                "tool_choice",
            )
        return self._sampling_params(max_tokens, logprobs, structured_outputs=forced,
                                     sampling_defaults=sampling_defaults)

    def _check_stored_fields(self) -> None:
        """``store`` and ``metadata``: this server keeps nothing, so storing is refused, not pretended."""
        if self.store:
            raise bad_request("store=true is not supported: this server keeps no completion once it has "
                              "answered (nothing to list or fetch later); leave store unset or false", "store",
                              "unsupported_parameter")
        if self.metadata is not None and len(self.metadata) > 16:
            raise bad_request(f"metadata may hold at most 16 pairs, got {len(self.metadata)}", "metadata")

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat templates read it (tool calls' arguments decoded); 400 when malformed."""
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them; a malformed one (a tool message answering no call...) is a 400."""
    try:
        return to_template_messages([m.to_template_dict() for m in messages])
    except ToolMessageError as e:
        raise bad_request(str(e), "messages", e.code) from e


class TokenizeRequest(_Body):
    """``POST /tokenize``: a prompt, or a conversation rendered by the chat template."""

    # exactly one of prompt and messages (checked by the handler); what the schema says of it
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]})

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = _TEMPLATE_KWARGS  # as the chat request's (vLLM's too)


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[TokenId]


def served_model_schema(schema: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """The OpenAPI schema with the served model's limits: every token id (``TOKEN_ID_MARK``) at most its last id.

    The models know only int32's bound; the vocabulary check is the
    engine's (``/detokenize``, prompt ids, ``stop_token_ids``...), and the
    schema says the same. Changes ``schema`` in place and returns it.
    """
    pending: list[Any] = [schema]
    while pending:  # iterative: a deep schema cannot overflow the stack
        node = pending.pop()
        if isinstance(node, dict):
            if node.get(TOKEN_ID_MARK) is True:
                node["maximum"] = vocab_size - 1
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return schema


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer: ``{"error": {...}}``."""

    error: ErrorDetail


def describe_validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for a body that failed validation (FastAPI's errors, ``loc`` starting at ``body``)."""
    first = dict(errors[0])
    loc = tuple(first.get("loc", ()))
    # a body's fields, or a query parameter (``/kv/state?replica=``)
    first["loc"] = loc[1:] if loc[:1] in (("body",), ("query",)) else loc
    return bad_request(*_describe(first))


def _describe(first: dict[str, Any]) -> tuple[str, str | None, str]:
    """(message, param, code) for the first field at fault."""
    if first["type"] == LONE_SURROGATE:
        where = first["ctx"]["where"]
        return first["msg"], where.split(".", 1)[0].split("[", 1)[0] if " " not in where else None, "invalid_value"
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        return f"the request body is not valid JSON: {reason}", None, "invalid_json"
    if not first["loc"] or isinstance(first["loc"][0], int):
        return f"the request body must be a JSON object: {first['msg']}", None, "invalid_type"
    field = str(first["loc"][0])
    # where inside the field: messages[0].content, not just messages
    where = field + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"][1:])
    if first["type"] == "extra_forbidden":
        return f"unrecognized request argument supplied: {where}", field, "unknown_parameter"
    if first["type"] == "missing":
        return f"missing required parameter: '{where}'", field, "missing_required_parameter"
    if field in UNSUPPORTED_FIELDS and len(first["loc"]) == 1:
        err = unsupported(field)
        return err.message, field, "unsupported_parameter"
    if field == "prompt":
        return (
            "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
            field,
            "invalid_type",
        )
    value = repr(first.get("input"))
    if len(value) > 80:
        value = value[:77] + "..."
    # a value of the right type out of its range or set is a bad value, not a bad type
    code = "invalid_value" if first["type"] in _VALUE_ERRORS else "invalid_type"
    return f"invalid value for '{where}': {first['msg']} (got {value})", field, code


# pydantic's error types for a value of the right type that a constraint refuses
_VALUE_ERRORS = frozenset({
    "literal_error", "greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long",
    "string_too_short", "string_too_long",
})
