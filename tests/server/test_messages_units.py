"""The Messages API's parts without a server: request conversion, content blocks, stop reasons, error bodies.

Expected values are written from Anthropic's documented shapes (``anthropic``'s
own types parse the events), not from this code's output.
"""

from __future__ import annotations

import json

import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from pagedllm.entrypoints.anthropic.content_blocks import ContentBlocks, stop_reason
from pagedllm.entrypoints.anthropic.convert import to_chat_request
from pagedllm.entrypoints.anthropic.errors import _rewrite, anthropic_error
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedllm.entrypoints.openai.protocol import APIError, NamedToolChoice
from pagedllm.entrypoints.openai.reasoning_parsers import ReplyParser, ThinkReasoningParser
from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage, HermesToolParser, ToolCallDelta

TOOL = {"name": "get_time", "description": "The time", "input_schema": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}
EVENTS = TypeAdapter(RawMessageStreamEvent)


def _req(**fields) -> MessagesRequest:  # noqa: ANN003
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 64, **fields})


def test_conversation_becomes_chat_messages() -> None:
    req = _req(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Time?"}, {"type": "text", "text": "In UTC."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "They want UTC.", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"},
            {"type": "text", "text": "Thanks; and CET?"}]},
    ], tools=[TOOL], stop_sequences=["###"], temperature=0.5, top_k=5)
    chat = to_chat_request(req, can_think=False)
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Time?\nIn UTC."},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_time", "content": "12:00"},
        {"role": "user", "content": "Thanks; and CET?"},
    ]
    assert chat.messages[2].reasoning_content == "They want UTC."
    assert [t.function.parameters for t in chat.tools] == [TOOL["input_schema"]]
    assert (chat.stop, chat.temperature, chat.top_k, chat.max_tokens) == (["###"], 0.5, 5, 64)
    assert chat.tool_choice is None  # auto, as Anthropic's default with tools


def test_failed_tool_result_is_marked() -> None:
    req = _req(messages=[
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True,
                                      "content": [{"type": "text", "text": "no such zone"}]}]},
    ], tools=[TOOL])
    messages = to_chat_request(req, can_think=False).template_messages()
    assert messages[-1] == {"role": "tool", "tool_call_id": "t", "name": "get_time", "content": "Error: no such zone"}


@pytest.mark.parametrize("choice, expected, parallel", [
    ({"type": "auto"}, "auto", None),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
    ({"type": "any"}, "required", None),
    ({"type": "none"}, "none", None),
    ({"type": "tool", "name": "get_time"}, NamedToolChoice(type="function", function={"name": "get_time"}), None),
])
def test_tool_choice(choice, expected, parallel) -> None:  # noqa: ANN001
    chat = to_chat_request(_req(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=choice), False)
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel


def test_thinking_reaches_the_template() -> None:
    ask = [{"role": "user", "content": "x"}]
    on = to_chat_request(_req(messages=ask, thinking={"type": "enabled", "budget_tokens": 16}), can_think=True)
    off = to_chat_request(_req(messages=ask, thinking={"type": "disabled"}), can_think=False)
    adaptive = to_chat_request(_req(messages=ask, thinking={"type": "adaptive"}), can_think=False)
    assert on.chat_template_kwargs == {"enable_thinking": True}
    assert on.thinking_token_budget == 16 and off.thinking_token_budget is None  # the block closes after 16
    assert off.chat_template_kwargs == {"enable_thinking": False}
    assert adaptive.chat_template_kwargs is None


def test_count_tokens_request_has_no_sampling() -> None:
    req = CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    chat = to_chat_request(req, can_think=False)
    assert chat.max_tokens is None and chat.stop is None


REFUSED = [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "Prefill"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 8}},
     "no reasoning parser"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "takes no images"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "takes no documents"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "1"}]}, {"role": "user", "content": "y"}]},
     "cannot be in an assistant message"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "takes no images"),
]


@pytest.mark.parametrize("fields, says", REFUSED)
def test_refused_requests(fields, says) -> None:  # noqa: ANN001
    with pytest.raises(APIError) as e:
        to_chat_request(_req(**fields), can_think=False)
    assert e.value.status_code == 400 and says in e.value.message


def test_budget_must_be_below_max_tokens() -> None:
    req = _req(messages=[{"role": "user", "content": "x"}], thinking={"type": "enabled", "budget_tokens": 64})
    with pytest.raises(APIError, match="less than max_tokens"):
        to_chat_request(req, can_think=True)


def test_blocks_from_deltas_stream_and_whole() -> None:
    blocks = ContentBlocks()
    deltas = [
        DeltaMessage(reasoning_content="Hmm, "), DeltaMessage(reasoning_content="time.", content="Let me "),
        DeltaMessage(content="check.", tool_calls=[ToolCallDelta(0, "call_a", "get_time", '{"zone"')]),
        DeltaMessage(tool_calls=[ToolCallDelta(0, arguments=': "UTC"}'), ToolCallDelta(1, "call_b", "get_time")]),
        None, DeltaMessage(tool_calls=[ToolCallDelta(1, arguments="{}")]),
    ]
    events = [e for d in deltas for e in blocks.add(d)] + blocks.close()
    for event in events:
        EVENTS.validate_python(event)  # each is an event the official client reads
    kinds = [(e["type"], e["index"]) for e in events]
    assert kinds == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3),
    ]
    assert blocks.content() == [
        {"type": "thinking", "thinking": "Hmm, time.", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_a", "name": "get_time", "input": {"zone": "UTC"}},
        {"type": "tool_use", "id": "call_b", "name": "get_time", "input": {}},
    ]
    assert blocks.num_calls == 2
    json_deltas = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == 2]
    assert json_deltas == [{"type": "input_json_delta", "partial_json": '{"zone"'},
                           {"type": "input_json_delta", "partial_json": ': "UTC"}'}]


# what Qwen3 writes when it thinks and then calls (Qwen3's documented <think> and Hermes <tool_call> formats)
QWEN3_OUTPUT = ('<think>\nThe user wants the time in UTC.\n</think>\n\nI will look it up.\n<tool_call>\n'
                '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')


def _parser(buffered: bool) -> ReplyParser:
    return ReplyParser(ThinkReasoningParser(prompt_text="<|im_start|>assistant\n", calls_allowed=True),
                       HermesToolParser(buffered=buffered))


def test_parser_output_as_blocks_at_every_split() -> None:
    whole_parser, whole = _parser(buffered=True), ContentBlocks()
    whole.add(whole_parser.feed(QWEN3_OUTPUT, []))
    whole.add(whole_parser.finish())
    expected = [
        {"type": "thinking", "thinking": "\nThe user wants the time in UTC.\n", "signature": ""},
        {"type": "text", "text": "I will look it up.\n"},
        {"type": "tool_use", "name": "get_time", "input": {"zone": "UTC"}},
    ]
    content = whole.content()
    assert [{k: v for k, v in b.items() if k != "id"} for b in content] == expected
    for cut in range(1, len(QWEN3_OUTPUT)):
        parser, blocks = _parser(buffered=False), ContentBlocks()
        events = blocks.add(parser.feed(QWEN3_OUTPUT[:cut], []))
        events += blocks.add(parser.feed(QWEN3_OUTPUT[cut:], [])) + blocks.add(parser.finish()) + blocks.close()
        got = [{k: v for k, v in b.items() if k != "id"} for b in blocks.content()]
        assert got == expected, cut
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        streamed_json = "".join(d.get("partial_json", "") for d in deltas)
        assert json.loads(streamed_json) == {"zone": "UTC"}


@pytest.mark.parametrize("finish, engine_reason, calls, expected", [
    ("stop", None, 0, ("end_turn", None)),
    ("stop", 2, 0, ("end_turn", None)),  # a stop token id
    ("stop", "###", 0, ("stop_sequence", "###")),
    ("length", None, 0, ("max_tokens", None)),
    ("length", None, 1, ("max_tokens", None)),
    ("stop", None, 1, ("tool_use", None)),
])
def test_stop_reason(finish, engine_reason, calls, expected) -> None:  # noqa: ANN001
    assert stop_reason(finish, engine_reason, calls) == expected


def test_error_bodies() -> None:
    openai_body = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": "x",
                                        "code": None}}).encode()
    assert json.loads(_rewrite(openai_body, 400)) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "bad"}}
    assert json.loads(_rewrite(openai_body, 429))["error"]["type"] == "rate_limit_error"
    assert json.loads(_rewrite(openai_body, 413))["error"]["type"] == "request_too_large"
    assert _rewrite(b"not json", 400) is None
    assert _rewrite(json.dumps(anthropic_error(404, "x")).encode(), 404) is None  # already Anthropic's
    assert anthropic_error(503, "stopping") == {"type": "error", "error": {"type": "overloaded_error",
                                                                           "message": "stopping"}}


class _FakeStream:
    """A ``RequestStream`` whose engine outputs are given: deltas of one choice, then maybe a failure."""

    def __init__(self, pieces: list[tuple[str, int, str | None, object]], fail: Exception | None = None) -> None:
        self.prompt_token_counts = [7]
        self.pieces = pieces
        self.fail = fail

    async def outputs(self):  # noqa: ANN201
        from pagedllm.outputs import CompletionOutput, RequestOutput

        for text, num_tokens, finish, engine_reason in self.pieces:
            out = CompletionOutput(0, text, list(range(num_tokens)), finish_reason=finish, stop_reason=engine_reason)
            yield 0, RequestOutput("r", None, [1] * 7, [out], finish is not None, num_cached_tokens=4)
        if self.fail is not None:
            raise self.fail


def _stream_events(sub: _FakeStream, parser=None) -> list[dict]:  # noqa: ANN001
    import asyncio

    from pagedllm.entrypoints.anthropic.serving_messages import _events, _Reply

    async def collect() -> list[dict]:
        header = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m"}
        return [e async for e in _events(header, sub, _Reply(parser))]

    events = asyncio.run(collect())
    assert all(json.loads(e["data"])["type"] == e["event"] for e in events)
    return [json.loads(e["data"]) for e in events]


def test_stream_of_a_stop_sequence_reply() -> None:
    events = _stream_events(_FakeStream([("Hello", 1, None, None), (" world", 2, "stop", "###")]))
    for event in events:
        if event["type"] != "ping":  # the client skips pings; its event union has none
            EVENTS.validate_python(event)
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "###"}
    assert events[-2]["usage"] == {"input_tokens": 3, "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 4, "output_tokens": 3}


def test_stream_failures_end_with_an_error_event() -> None:
    from pagedllm.engine.protocol import EngineDeadError, EngineStepError

    step = _stream_events(_FakeStream([("Hi", 1, None, None)], EngineStepError("the step failed")))
    assert step[-1] == {"type": "error", "error": {"type": "api_error", "message": "the step failed"}}
    dead = _stream_events(_FakeStream([], EngineDeadError("stopping")))
    assert dead[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "stopping"}}
    cut = _stream_events(_FakeStream([("Hi", 1, None, None)]))  # the outputs ended before a finish reason
    assert cut[-1]["type"] == "error" and "ended before its reply" in cut[-1]["error"]["message"]
    bug = _stream_events(_FakeStream([("Hi", 1, None, None)], KeyError("x")))
    assert bug[-1] == {"type": "error", "error": {"type": "api_error", "message": "internal error: KeyError"}}
