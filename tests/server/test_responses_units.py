"""/v1/responses without a model: items <-> chat messages, the request's translation, the output builder, the store.

Expected values are written from OpenAI's Responses API reference (item and
event shapes) and checked against the ``openai`` package's own types where
the client validates them.
"""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from pagedllm.entrypoints.openai.protocol import APIError
from pagedllm.entrypoints.openai.response_items import (
    ResponseItemError,
    items_to_messages,
    normalize_input,
)
from pagedllm.entrypoints.openai.response_output import ResponseOutputBuilder
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.tool_messages import to_template_messages
from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage, ToolCallDelta

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_string_input_is_one_user_message() -> None:
    assert items_to_messages(normalize_input("hi")) == [{"role": "user", "content": "hi"}]


def test_text_parts_join_and_easy_messages_need_no_type() -> None:
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c",
                                                              "annotations": []}]},
    ]
    assert items_to_messages(items) == [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
    ]


def test_a_call_joins_the_assistant_turn_before_it_and_its_output_becomes_a_tool_message() -> None:
    items = [{"role": "user", "content": "weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
             CALL, {**CALL, "call_id": "call_2"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rainy"}]}]
    messages = items_to_messages(items)
    assert messages == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
    ]
    template = to_template_messages(messages)  # the chat route's own check accepts the conversation
    assert template[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert template[2]["name"] == "get_weather"


def test_a_call_after_a_tool_result_opens_a_new_assistant_turn() -> None:
    items = [{"role": "user", "content": "go"}, CALL, {"type": "function_call_output", "call_id": "call_1",
                                                       "output": "x"}, {**CALL, "call_id": "call_2"}]
    messages = items_to_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[3] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


@pytest.mark.parametrize("item, words", [
    ({"type": "item_reference", "id": "msg_1"}, "'item_reference' is not supported"),
    ({"role": "tool", "content": "x"}, "role must be one of"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}, "takes no images"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "must be a text part"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "'input[0].call_id'"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}, "JSON text"),
    ({"type": "function_call_output", "call_id": "c"}, "'input[0].output'"),
])
def test_bad_items_name_where(item: dict, words: str) -> None:
    with pytest.raises(ResponseItemError, match=words.replace("[", r"\[").replace("]", r"\]")):
        items_to_messages([item])


def test_the_request_becomes_a_chat_request() -> None:
    req = ResponsesRequest.model_validate({
        "model": "m", "instructions": "be brief", "input": "hi", "max_output_tokens": 7, "temperature": 0.5,
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"},
                   "strict": True}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        "reasoning": {"effort": "high"},
    })
    chat = req.to_chat_request(normalize_input(req.input), harmony=False)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and chat.parallel_tool_calls is False
    assert chat.tools[0].model_dump(exclude_none=True) == {
        "type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"},
                                         "strict": True}}
    assert chat.tool_choice.function.name == "f"
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert chat.chat_template_kwargs == {"reasoning_effort": "high"} and chat.reasoning_effort is None
    harmony = req.to_chat_request(normalize_input(req.input), harmony=True)
    assert harmony.reasoning_effort == "high" and harmony.chat_template_kwargs is None


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": "x", "reasoning": {"effort": "minimal"}}, "reasoning"),  # harmony knows low/medium/high
])
def test_bad_translations_are_400s_naming_the_field(body: dict, param: str) -> None:
    req = ResponsesRequest.model_validate(body)
    with pytest.raises(APIError) as e:
        req.to_chat_request(normalize_input(req.input), harmony=True)
    assert e.value.status_code == 400 and e.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({}, "input"),
    ({"input": [], "instructions": "x"}, "input"),
])
def test_what_the_server_cannot_do_is_refused(body: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        ResponsesRequest.model_validate(body).check()
    assert e.value.status_code == 400 and e.value.param == param


def test_what_is_not_served_is_refused_by_the_schema() -> None:
    with pytest.raises(ValidationError, match="include"):
        ResponsesRequest.model_validate({"input": "x", "include": ["message.output_text.logprobs"]})


def test_what_codex_sends_is_accepted() -> None:
    ResponsesRequest.model_validate({
        "model": "m", "instructions": "sys", "input": [{"type": "message", "role": "user",
                                                         "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [], "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium",
                                                                                         "summary": "auto"},
        "store": False, "stream": True, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
        "text": {"verbosity": "low"},
    }).check()


def _events(builder: ResponseOutputBuilder) -> list[dict]:
    events = builder.take_events()
    adapter = TypeAdapter(ResponseStreamEvent)
    for i, event in enumerate(events):
        adapter.validate_python({**event, "sequence_number": i})  # each is an event the client knows
    return events


def test_the_builder_streams_reasoning_then_text_then_a_call() -> None:
    b = ResponseOutputBuilder()
    b.add(DeltaMessage(reasoning_content="hm"), num_tokens=2)
    b.add(DeltaMessage(reasoning_content=" ok", content="\n"), num_tokens=2)  # whitespace opens no message
    b.add(DeltaMessage(content="Sure."), num_tokens=1)
    b.add(DeltaMessage(tool_calls=[ToolCallDelta(0, "call_a", "f", '{"x"')]), num_tokens=3)
    b.add(DeltaMessage(tool_calls=[ToolCallDelta(0, arguments=": 1}")]), num_tokens=2)
    b.finish()
    kinds = [e["type"] for e in _events(b)]
    assert kinds == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    reasoning, message, call = b.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hm ok"}]
    assert message["content"][0]["text"] == "\nSure." and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_a", "f", '{"x": 1}')
    assert b.num_reasoning_tokens == 2  # only the step that was all reasoning


def test_an_empty_output_is_one_empty_message_and_a_cut_one_is_incomplete() -> None:
    b = ResponseOutputBuilder()
    b.finish(incomplete=True)
    (item,) = b.items
    assert item["type"] == "message" and item["content"][0]["text"] == "" and item["status"] == "incomplete"
    body = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m", "output": b.items,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    assert Response.model_validate(body).output_text == ""


def test_the_store_evicts_by_count_and_bytes_least_recently_used_first() -> None:
    store = ResponseStore(max_num_responses=2, max_bytes=10_000)
    store.put("a", {"id": "a"}, [])
    store.put("b", {"id": "b"}, [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", {"id": "c"}, [])
    assert "b" not in store and "a" in store and "c" in store and store.num_evicted == 1
    big = [{"text": "x" * 3000}]
    size = len(json.dumps({"id": "d"})) + len(json.dumps(big))
    store.resize(10, 2 * size)
    store.put("d", {"id": "d"}, big)
    store.put("e", {"id": "e"}, big)
    assert "d" in store and "e" in store and "a" not in store and "c" not in store
    assert store.num_bytes == 2 * size
    assert store.put("huge", {"id": "huge"}, [{"text": "x" * 100_000}]) is False and "huge" not in store
    assert store.delete("d") and not store.delete("d") and store.num_bytes == size
    with pytest.raises(ValueError, match="max_bytes"):
        store.resize(1, 0)


def test_input_items_include_values() -> None:
    """Every value of the openai client's ``ResponseIncludable`` is served or refused by name, none ignored."""
    import typing

    from openai.types.responses import ResponseIncludable

    from pagedllm.entrypoints.openai.response_input_items import check_include, list_page

    items = [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"}]
    assert "encrypted_content" not in list_page(items)["data"][0]
    assert list_page(items, include=["reasoning.encrypted_content"])["data"][0]["encrypted_content"] == "x"
    for value in typing.get_args(ResponseIncludable):
        if value == "reasoning.encrypted_content":
            assert check_include([value]) == {value}
            continue
        with pytest.raises(APIError) as e:
            check_include([value])
        assert (e.value.status_code, e.value.param, e.value.code) == (400, "include", "unsupported_value")
    with pytest.raises(APIError, match="unknown value"):
        check_include(["reasoning.summary"])
