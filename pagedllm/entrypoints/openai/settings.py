"""What ``pagedllm serve`` needs besides the engine: names, key, limits, address."""

from __future__ import annotations

import os
import time
from dataclasses import field
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from pagedllm.config_record import NonEmptyStr, PositiveFloat, PositiveInt, config_record
from pagedllm.entrypoints.arg_fields import NO_FLAG, Flag
from pagedllm.entrypoints.openai.guards import DEFAULT_MAX_REQUEST_BYTES, is_loopback
from pagedllm.entrypoints.openai.http_protocol import HTTPLimits
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSER_CHOICES
from pagedllm.entrypoints.openai.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_NUM_RESPONSES
from pagedllm.entrypoints.openai.sse import DEFAULT_STREAM_WRITE_TIMEOUT_S
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS


def _check_tool_call_parser(name: str) -> str:
    if name != "auto" and name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser {name!r} is unknown; known: auto, {', '.join(sorted(TOOL_PARSERS))}")
    return name


def _check_reasoning_parser(name: str) -> str:
    if name not in REASONING_PARSER_CHOICES:
        raise ValueError(f"reasoning_parser {name!r} is unknown; known: {', '.join(REASONING_PARSER_CHOICES)}")
    return name


LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


def comma_list(text: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]`` (``--allowed-hosts``, ``--allowed-origins``); ValueError for no name."""
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise ValueError(f"expects a comma-separated list of names, got {text!r}")
    return items


def seconds_or_unbounded(text: str) -> float | None:
    """``--stream-write-timeout``: seconds, "0" meaning no bound (None)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"must be a number of seconds >= 0 (0: no bound), got {text!r}")
    return seconds or None


def served_names(names: list[str]) -> list[str]:
    """``--served-model-name A B``: each name clients may pass as ``model``; the first answers in replies."""
    names = [n.strip() for n in names]
    if not names or not all(names):
        raise ValueError(f"expects one or more non-empty names, got {names!r}")
    return names


def template_text(text: str) -> str:
    """``--chat-template``: the file's text where ``text`` names a file, else ``text`` itself (an inline
    template, as vLLM takes it); a value that is neither a file nor a template is refused."""
    if os.path.isfile(os.path.expanduser(text)):
        with open(os.path.expanduser(text), encoding="utf-8") as f:
            text = f.read()
    elif not any(mark in text for mark in ("{{", "{%")):
        raise ValueError(f"names no file and is not a Jinja template: {text!r}")
    if not text.strip():
        raise ValueError("is an empty template")
    return text


def text_or_none(text: str) -> str | None:
    """``--api-key ""``: no key, as if the flag were not given."""
    return text or None


@config_record
class ServerSettings:
    """What ``pagedllm serve`` needs besides the engine.

    Attributes:
        model_name: the name clients pass as ``model`` (and see in /v1/models); replies carry it.
            ``--served-model-name`` takes several names, as vLLM's: the first is this one, the others
            ``model_aliases``.
        model_aliases: further names a request's ``model`` may use (listed in /v1/models too); any
            other name is a 404.
        model_path: where the weights came from (shown in /v1/models).
        api_key: when set, every route but /health, /metrics, /openapi.json, /docs and the /kv page's
            needs ``Authorization: Bearer <key>``.
        max_waiting: most requests waiting for their first token; past it new requests get 429.
            None: no limit.
        host: address to bind (loopback by default).
        port: TCP port (0: any free one).
        log_level: uvicorn's log level (and pagedllm's).
        max_request_bytes: largest request body; larger ones get 413 unread.
        allowed_hosts: ``Host`` names accepted besides loopback ones while bound to loopback (``*``:
            any; comma-separated on the command line; other names are refused: DNS rebinding). None: loopback names only. Bound elsewhere,
            None accepts any name.
        allowed_origins: origins a browser may call from (CORS; comma-separated on the command line).
            None: no CORS headers at all, so
            no other origin can read an answer.
        tool_call_parser: the model's tool-call format for ``tool_choice="auto"``: ``hermes``,
            ``llama3_json``, ``qwen3_coder``, ``mistral``, ``pythonic``, or ``auto`` (read from the
            chat template).
        enable_auto_tool_choice: whether a request with tools may leave the calls to the model
            (``tool_choice="auto"``, the default when tools are given), read by ``tool_call_parser``.
            On by default, unlike vLLM's flag of the same name, which must be given for it; off,
            such a request is a 400, as in vLLM without the flag.
        chat_template: the Jinja chat template for every conversation, instead of the model's own
            (a file, or the template's text on the command line); the one way to chat with a model
            that has none. None: the model's.
        reasoning_parser: how replies are split into ``reasoning_content`` and content: ``gpt_oss``
            (harmony channels), ``qwen3`` / ``deepseek_r1`` (``<think>`` blocks), ``granite``
            (Granite 3.x's thought/response markers), ``none``, or ``auto`` (``gpt_oss`` for a
            gpt-oss model, ``qwen3`` for a template writing ``<think>``/``</think>``, ``granite``
            for one asking for Granite's thought process, else none; logged at start).
        kv_page: serve the live KV-cache page (``/kv``, ``/kv/state``, ``/kv/events``).
        http_limits: header deadline and count, lingering close (``http_protocol.py``).
        default_max_tokens: most tokens a reply gets when its request sets no ``max_tokens`` /
            ``max_completion_tokens`` (None: the model's ``max_new_tokens`` from its
            generation_config.json, else no cap, to the end of the context, as in OpenAI and vLLM).
            Never raises or lowers a request's own value.
        stream_write_timeout_s: the most seconds one write of a streamed answer may wait for a client
            that reads nothing, then the stream ends and its request is aborted (None, or 0 on the
            command line: no bound). Its KV blocks are freed and it is counted in
            ``pagedllm:stream_write_timeouts_total`` (``sse.py``).
        max_num_stored_responses: most responses ``/v1/responses`` keeps in memory (``store``, for
            ``previous_response_id`` and ``GET``); past it the least recently used is forgotten.
        max_stored_response_bytes: most bytes (their JSON, conversations included) those responses
            take; past it the least recently used are forgotten.
        created: when the server started (the ``created`` of /v1/models).
    """

    # each field's ``Flag`` says how ``pagedllm serve`` spells it where its name does not (arg_fields.py)
    model_name: Annotated[str, Flag("--served-model-name", parser=served_names, metavar="NAME", nargs="+",
                                    default="the model's file or folder name")]
    model_path: Annotated[str, NO_FLAG] = ""
    model_aliases: Annotated[list[NonEmptyStr], NO_FLAG] = field(default_factory=list)
    api_key: Annotated[str | None, Flag(parser=text_or_none, metavar="KEY")] = None
    max_waiting: Annotated[PositiveInt | None, Flag(metavar="N")] = 1024
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    log_level: LogLevel = "info"
    max_request_bytes: Annotated[PositiveInt, Flag(metavar="N")] = DEFAULT_MAX_REQUEST_BYTES
    allowed_hosts: Annotated[list[NonEmptyStr] | None, Flag(parser=comma_list, metavar="NAMES")] = None
    allowed_origins: Annotated[list[NonEmptyStr] | None, Flag(parser=comma_list, metavar="ORIGINS")] = None
    tool_call_parser: Annotated[
        str, AfterValidator(_check_tool_call_parser), Flag(metavar="{" + ",".join(["auto", *sorted(TOOL_PARSERS)]) + "}"),
    ] = "auto"
    enable_auto_tool_choice: bool = True
    chat_template: Annotated[str | None, Flag(parser=template_text, metavar="FILE_OR_TEMPLATE")] = None
    reasoning_parser: Annotated[
        str, AfterValidator(_check_reasoning_parser), Flag(metavar="{" + ",".join(REASONING_PARSER_CHOICES) + "}"),
    ] = "auto"
    kv_page: bool = True
    http_limits: Annotated[HTTPLimits, Flag(prefix="")] = field(default_factory=HTTPLimits)
    default_max_tokens: Annotated[PositiveInt | None, Flag(metavar="N")] = None
    stream_write_timeout_s: Annotated[
        PositiveFloat | None, Flag("--stream-write-timeout", parser=seconds_or_unbounded, metavar="SECONDS"),
    ] = DEFAULT_STREAM_WRITE_TIMEOUT_S
    max_num_stored_responses: Annotated[PositiveInt, Flag(metavar="N")] = DEFAULT_MAX_NUM_RESPONSES
    max_stored_response_bytes: Annotated[PositiveInt, Flag(metavar="N")] = DEFAULT_MAX_BYTES
    created: Annotated[int, NO_FLAG] = field(default_factory=lambda: int(time.time()))

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may use: ``model_name`` first, then ``model_aliases``."""
        return (self.model_name, *self.model_aliases)

    @property
    def host_check(self) -> list[str] | None:
        """The extra Host names to allow, or None when no Host check applies."""
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        return [] if is_loopback(self.host) else None

