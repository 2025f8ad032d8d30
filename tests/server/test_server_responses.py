"""/v1/responses driven by the official openai client (``client.responses``) against real servers on loopback.

One server on the bundled SmolLM2 for the API itself, whose answers are
checked against the chat route's for the same conversation (the same greedy
text, the same prompt token count: an independent reading of what the
Responses input should have become), and one on a tiny random Qwen3 with
``--reasoning-parser qwen3`` for reasoning items next to a call (a regex
constraint writes what Qwen3 would, as in test_server_tools.py).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from server_helpers import assert_openai_error, free_port, wait_healthy, wait_kv_free

pytestmark = pytest.mark.slow  # real servers: outside the fast tier

WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False},
}
ASK = "What is the weather in Paris?"


@contextlib.contextmanager
def _serve(path: str | None, name: str, **settings) -> Iterator[dict]:  # noqa: ANN003
    """A server on a thread (as server_helpers.serve_in_thread), with its app at hand for the store."""
    import torch
    import uvicorn

    from pagedllm import LLM
    from pagedllm.entrypoints.openai.api_server import ServerSettings, create_server_app

    kwargs = {"num_kv_blocks": 96, "max_model_len": 1024, "num_threads": 1}
    llm = LLM(path, **kwargs) if path is not None else LLM(**kwargs)
    threads = torch.get_num_threads()
    port = free_port()
    app = create_server_app(llm.llm_engine, ServerSettings(port=port, model_name=name, **settings))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield {"url": url, "app": app, "client": OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                                        timeout=300)}
    finally:
        server.should_exit = True
        thread.join(30)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bundled() -> Iterator[dict]:
    with _serve(None, "smollm2") as served:
        yield served


@pytest.fixture(scope="module")
def thinking(tiny_tool_model_dir: str) -> Iterator[dict]:
    with _serve(tiny_tool_model_dir, "tiny-tools", reasoning_parser="qwen3") as served:
        yield served


def _chat(client: OpenAI, messages: list[dict], max_tokens: int, **kwargs):  # noqa: ANN003, ANN202
    return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens,
                                          temperature=0, **kwargs)


def test_a_response_is_the_chat_answer_to_the_same_conversation(bundled) -> None:  # noqa: ANN001
    client = bundled["client"]
    r = client.responses.create(model="smollm2", instructions="Answer briefly.", input=ASK, max_output_tokens=10,
                                temperature=0, metadata={"k": "v"})
    chat = _chat(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}], 10)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "smollm2"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # 10 tokens, cut: OpenAI's incomplete answer
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].status == "incomplete"
    assert r.metadata == {"k": "v"} and r.instructions == "Answer briefly."
    assert client.responses.retrieve(r.id).output_text == r.output_text  # stored by default


def test_a_stream_has_the_responses_events_in_order(bundled) -> None:  # noqa: ANN001
    client = bundled["client"]
    kwargs = dict(model="smollm2", input=ASK, max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    n = kinds.count("response.output_text.delta")
    assert n >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * n,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type.startswith("response.output_text"))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text == done.text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert wait_kv_free(bundled["url"]) == 0.0


def test_a_function_tool_round_trip(bundled) -> None:  # noqa: ANN001
    """A forced call comes back as a function_call item; its output, sent with previous_response_id, is read."""
    client = bundled["client"]
    first = client.responses.create(model="smollm2", input=ASK, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=40, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = client.responses.create(
        model="smollm2", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
    )
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    chat = _chat(client, [
        {"role": "user", "content": ASK},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ], 8, tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none")
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content


def test_input_items_list_the_conversation_a_response_read(bundled) -> None:  # noqa: ANN001
    """``responses.input_items.list``: the user's message, the earlier call and its output (through
    ``previous_response_id``), newest first unless ``order="asc"``, a page at a time with ``after``."""
    client, url = bundled["client"], bundled["url"]
    first = client.responses.create(model="smollm2", input=ASK, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=40, temperature=0)
    (call,) = first.output
    second = client.responses.create(
        model="smollm2", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=2, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
    )
    listed = client.responses.input_items.list(second.id)
    assert [item.type for item in listed.data] == ["function_call_output", "function_call", "message"]
    output, called, asked = listed.data
    assert (output.call_id, output.output, output.status) == (call.call_id, "Sunny, 21 C", "completed")
    assert (called.id, called.call_id, called.name, called.arguments) == (call.id, call.call_id, call.name,
                                                                        call.arguments)
    assert asked.role == "user" and [(p.type, p.text) for p in asked.content] == [("input_text", ASK)]
    assert (listed.first_id, listed.last_id, listed.has_more) == (output.id, asked.id, False)
    assert len({item.id for item in listed.data}) == 3 and all(item.id for item in listed.data)
    # the first response's own input is the message alone, with the same id (ids are kept once given)
    assert [item.id for item in client.responses.input_items.list(first.id).data] == [asked.id]
    # pages, oldest first: one at a time, each after the last
    seen, after = [], None
    while True:
        page = client.responses.input_items.list(second.id, order="asc", limit=1,
                                                 **({"after": after} if after else {}))
        seen += [item.id for item in page.data]
        after = page.last_id
        if not page.has_more:
            break
    assert seen == [asked.id, called.id, output.id]
    for query, param in [({"order": "up"}, "order"), ({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                         ({"after": "msg_nothing"}, "after")]:
        resp = httpx.get(f"{url}/v1/responses/{second.id}/input_items", params=query)
        assert assert_openai_error(resp, 400)["param"] == param
    unstored = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.input_items.list(unstored.id)


def test_input_items_include(bundled) -> None:  # noqa: ANN001
    """``include``: ``reasoning.encrypted_content`` keeps a reasoning input item's ``encrypted_content`` (left
    out without it), sent as the openai client sends it (``include[]=``) or as ``include=``; the values this
    server cannot serve (hosted tools, images, logprobs) and unknown ones are 400s naming ``include``."""
    client, url = bundled["client"], bundled["url"]
    reasoning = {"type": "reasoning", "id": "rs_earlier", "summary": [], "encrypted_content": "opaque-state"}
    stored = client.responses.create(
        model="smollm2", max_output_tokens=2, temperature=0,
        input=[{"role": "user", "content": ASK}, reasoning, {"role": "assistant", "content": "Sunny."},
               {"role": "user", "content": "And in Rome?"}],
    )
    plain = client.responses.input_items.list(stored.id, order="asc")
    assert [item.type for item in plain.data] == ["message", "reasoning", "message", "message"]
    assert plain.data[1].id == "rs_earlier" and plain.data[1].encrypted_content is None
    assert "encrypted_content" not in plain.data[1].model_dump(exclude_unset=True)
    included = client.responses.input_items.list(stored.id, order="asc", include=["reasoning.encrypted_content"])
    assert included.data[1].encrypted_content == "opaque-state"
    assert [item.model_dump() for i, item in enumerate(included.data) if i != 1] == [
        item.model_dump() for i, item in enumerate(plain.data) if i != 1]
    resp = httpx.get(f"{url}/v1/responses/{stored.id}/input_items",
                     params={"order": "asc", "include": "reasoning.encrypted_content"})
    assert resp.status_code == 200 and resp.json()["data"][1]["encrypted_content"] == "opaque-state"
    for value in ("message.output_text.logprobs", "web_search_call.results", "message.input_image.image_url"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.input_items.list(stored.id, include=["reasoning.encrypted_content", value])
        assert e.value.body["param"] == "include" and value in e.value.body["message"]
    resp = httpx.get(f"{url}/v1/responses/{stored.id}/input_items", params={"include": "reasoning.everything"})
    assert assert_openai_error(resp, 400)["param"] == "include"


def test_streamed_call_arguments(bundled) -> None:  # noqa: ANN001
    client = bundled["client"]
    events = list(client.responses.create(model="smollm2", input=ASK, tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, temperature=0, stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments and json.loads(done.arguments)["city"]
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == pieces


def test_text_format_json_schema_parses(bundled) -> None:  # noqa: ANN001
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = bundled["client"].responses.create(
        model="smollm2", input=ASK, max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(bundled) -> None:  # noqa: ANN001
    client = bundled["client"]
    first = client.responses.create(model="smollm2", input="Name a color.", max_output_tokens=6, temperature=0)
    second = client.responses.create(model="smollm2", input="Why?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    chat = _chat(client, [{"role": "user", "content": "Name a color."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "Why?"}], 6)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens_details.cached_tokens > 0  # the earlier turn's blocks were reused


def test_unknown_ids_are_404s_and_delete_forgets(bundled) -> None:  # noqa: ANN001
    client, url = bundled["client"], bundled["url"]
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model="smollm2", input="x", previous_response_id="resp_unknown")
    resp = httpx.post(f"{url}/v1/responses", json={"input": "x", "previous_response_id": "resp_unknown"})
    err = assert_openai_error(resp, 404, "previous_response_not_found")
    assert err["param"] == "previous_response_id" and "restart" in err["message"]
    unstored = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
    assert_openai_error(httpx.get(f"{url}/v1/responses/{unstored.id}"), 404, "response_not_found")
    kept = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2)
    assert httpx.delete(f"{url}/v1/responses/{kept.id}").json() == {"id": kept.id, "object": "response",
                                                                     "deleted": True}
    assert_openai_error(httpx.get(f"{url}/v1/responses/{kept.id}"), 404, "response_not_found")


def test_the_store_limits_evict(bundled) -> None:  # noqa: ANN001
    client, store = bundled["client"], bundled["app"].state.responses.store
    before = (store.max_num_responses, store.max_bytes)
    store.resize(2, before[1])
    try:
        ids = [client.responses.create(model="smollm2", input=f"Count to {i}.", max_output_tokens=2).id
               for i in range(3)]
        assert ids[0] not in store and ids[1] in store and ids[2] in store and len(store) == 2
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="smollm2", input="and?", previous_response_id=ids[0])
        store.resize(10, store.num_bytes)  # exactly what is kept: the next response pushes the oldest out
        newest = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2).id
        assert newest in store and ids[1] not in store and store.num_bytes <= store.max_bytes
    finally:
        store.resize(*before)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "background": True}, "background"),
    ({"input": 5}, "input"),
])
def test_bad_requests_are_400s_in_openai_shape(bundled, body: dict, param: str) -> None:  # noqa: ANN001
    err = assert_openai_error(httpx.post(f"{bundled['url']}/v1/responses", json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


# what Qwen3 writes when it thinks, then calls (test_server_tools.THINK_CALL)
THINK_CALL = (r'<think>\nMaybe\. No\.\n</think>\n\nI will check\.\n<tool_call>\n\{"name": "get_weather", '
              r'"arguments": \{"city": "Paris"\}\}\n</tool_call>')


def test_reasoning_items_stream_before_the_call(thinking) -> None:  # noqa: ANN001
    client = thinking["client"]
    kwargs = dict(model="tiny-tools", input=ASK, tools=[WEATHER], temperature=1.0, max_output_tokens=128,
                  reasoning={"effort": "low"}, extra_body={"seed": 0, "structured_outputs": {"regex": THINK_CALL}})
    whole = client.responses.create(**kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "\nMaybe. No.\n"
    assert whole.output[1].content[0].text.strip() == "I will check."
    assert json.loads(whole.output[2].arguments) == {"city": "Paris"}
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    events = list(client.responses.create(**kwargs, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == whole.output[0].content[0].text
    final = events[-1].response
    assert final.status == "completed"
    assert [(i.type, getattr(i, "name", None)) for i in final.output] == [
        (i.type, getattr(i, "name", None)) for i in whole.output]
    assert wait_kv_free(thinking["url"]) == 0.0
