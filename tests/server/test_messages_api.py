"""Anthropic's Messages API (``/v1/messages``), driven by the official ``anthropic`` client.

One server on the bundled SmolLM2 with an API key (so ``x-api-key`` is
exercised by every call), ``--reasoning-parser qwen3`` and a ChatML chat
template with tools (``tests/tool_models.py``'s) whose generation prompt
opens ``<think>`` when the template variable ``enable_thinking`` is true, as
Qwen3's thinking releases do. Expected values come from the server's OpenAI
routes, which their own tests pin (the same conversation greedy on
``/v1/chat/completions``, its rendered prompt on ``/tokenize``, the raw
greedy text of ``/v1/completions``), or from transformers' own rendering.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest
from server_helpers import serve_in_thread, wait_kv_free
from tool_models import TOOL_CHAT_TEMPLATE

pytestmark = pytest.mark.slow  # a real server: outside the fast tier

KEY = "sk-messages-test"
BEARER = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = "You answer in one short sentence."
# anthropic 2.17's client has no temperature argument any more; the API (and this server) still take it
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


_GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n' }}"
THINKING_TEMPLATE = TOOL_CHAT_TEMPLATE.replace(
    _GENERATION_PROMPT, _GENERATION_PROMPT + "{%- if enable_thinking is defined and enable_thinking %}"
    "{{- '<think>\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def server() -> Iterator[dict]:
    from pagedllm import LLM

    assert THINKING_TEMPLATE != TOOL_CHAT_TEMPLATE
    llm = LLM(num_kv_blocks=96, max_model_len=1024, num_threads=1)
    with serve_in_thread(llm.llm_engine, model_name="smollm2", api_key=KEY, reasoning_parser="qwen3",
                         chat_template=THINKING_TEMPLATE) as url:
        yield {"url": url, "hf_tokenizer": llm.llm_engine.tokenizer.hf,
               "client": anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)}
        assert wait_kv_free(url) == 0.0


def _chat(url: str, messages: list[dict], max_tokens: int, **extra) -> dict:  # noqa: ANN003
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, headers=BEARER, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _prompt(url: str, messages: list[dict], thinking: bool | None = None) -> list[int]:
    body: dict = {"model": "smollm2", "messages": messages}
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    resp = httpx.post(f"{url}/tokenize", json=body, headers=BEARER)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def _prompt_len(url: str, messages: list[dict]) -> int:
    return len(_prompt(url, messages))


def _raw_greedy(url: str, prompt_ids: list[int], max_tokens: int) -> tuple[str, str, int]:
    """The greedy text of a prompt, with Anthropic's stop reason for how it ended, and its token count."""
    body = {"model": "smollm2", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{url}/v1/completions", json=body, headers=BEARER, timeout=300)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    reason = {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    return choice["text"], reason, resp.json()["usage"]["completion_tokens"]


def test_create_is_the_chat_reply(server) -> None:  # noqa: ANN001
    out = server["client"].messages.create(model="smollm2", max_tokens=12, system=SYSTEM, messages=ASK,
                                           extra_body=GREEDY)
    chat = _chat(server["url"], [{"role": "system", "content": SYSTEM}, *ASK], 12)
    assert out.type == "message" and out.role == "assistant" and out.model == "smollm2"
    assert out.id.startswith("msg_")
    (block,) = out.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"]
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert out.stop_reason == expected and out.stop_sequence is None
    assert out.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]


def test_system_as_text_blocks_and_content_as_blocks(server) -> None:  # noqa: ANN001
    client = server["client"]
    plain = client.messages.create(model="smollm2", max_tokens=6, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    blocks = client.messages.create(
        model="smollm2", max_tokens=6, extra_body=GREEDY, system=[{"type": "text", "text": SYSTEM,
                                                               "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}],
        metadata={"user_id": "u-1"},
    )
    assert blocks.content[0].text == plain.content[0].text


def test_stream_events_and_text_match_create(server) -> None:  # noqa: ANN001
    client = server["client"]
    whole = client.messages.create(model="smollm2", max_tokens=16, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(model="smollm2", max_tokens=16, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    # the raw events, in Anthropic's order, each named as its data's type
    body = {"model": "smollm2", "max_tokens": 16, "messages": ASK, "temperature": 0, "stream": True}
    names, datas = [], []
    with httpx.stream("POST", f"{server['url']}/v1/messages", json=body, headers={"x-api-key": KEY}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("event: "):
                names.append(line[len("event: "):])
            elif line.startswith("data: "):
                datas.append(json.loads(line[len("data: "):]))
    assert names == [d["type"] for d in datas]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert "".join(d["delta"]["text"] for d in datas[3:-3]) == text
    assert datas[-2]["delta"]["stop_reason"] == whole.stop_reason


def test_stop_sequences(server) -> None:  # noqa: ANN001
    client = server["client"]
    free = client.messages.create(model="smollm2", max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    words = free.split()
    assert len(words) >= 4, free
    stop = words[2]  # a word of the greedy reply: generation must end right before it
    out = client.messages.create(model="smollm2", max_tokens=24, messages=ASK, extra_body=GREEDY,
                                 stop_sequences=["@@never@@", stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == free[: free.index(stop)]
    with client.messages.stream(model="smollm2", max_tokens=24, messages=ASK, extra_body=GREEDY,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == out.content[0].text


def test_forced_tool_use_and_the_result_round_trip(server) -> None:  # noqa: ANN001
    client = server["client"]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.messages.create(model="smollm2", max_tokens=96, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert out.stop_reason == "tool_use"
    (call,) = [b for b in out.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # streamed: the same call, its input as input_json_delta pieces
    with client.messages.stream(model="smollm2", max_tokens=96, messages=ask, tools=[WEATHER], extra_body=GREEDY,
                                tool_choice={"type": "any"}) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and json.loads("".join(pieces)) == streamed.input
    jsonschema.validate(streamed.input, WEATHER["input_schema"])
    # the call and its result go back; the prompt holds both, as the chat route renders them
    history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "21 degrees"}]},
                                            {"type": "text", "text": "And tomorrow?"}]}]
    follow = client.messages.create(model="smollm2", max_tokens=8, messages=history, tools=[WEATHER])
    assert follow.stop_reason in ("end_turn", "max_tokens")
    openai_history = [*ask, {"role": "assistant", "content": None, "tool_calls": [{
        "id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
        {"role": "user", "content": "And tomorrow?"}]
    # /tokenize takes no tools: the conversation alone is compared there, the tools in the next test
    counted = client.messages.count_tokens(model="smollm2", messages=history)
    assert counted.input_tokens == _prompt_len(server["url"], openai_history)
    with_tools = client.messages.count_tokens(model="smollm2", messages=history, tools=[WEATHER]).input_tokens
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens == with_tools > counted.input_tokens


def test_count_tokens_is_the_prompt_the_engine_sees(server) -> None:  # noqa: ANN001
    client = server["client"]
    counted = client.messages.count_tokens(model="smollm2", system=SYSTEM, messages=ASK)
    expected = _prompt_len(server["url"], [{"role": "system", "content": SYSTEM}, *ASK])
    assert counted.input_tokens == expected
    out = client.messages.create(model="smollm2", max_tokens=1, system=SYSTEM, messages=ASK)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == expected
    # the same prompt again: its full blocks come from the prefix cache, and the split says so
    again = client.messages.create(model="smollm2", max_tokens=1, system=SYSTEM, messages=ASK)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == expected


BAD = [
    ("missing max_tokens", {"model": "smollm2", "messages": ASK}, 400, "max_tokens"),
    ("max_tokens a string", {"model": "smollm2", "messages": ASK, "max_tokens": "8"}, 400, "max_tokens"),
    ("messages not a list", {"model": "smollm2", "messages": "hi", "max_tokens": 8}, 400, "messages"),
    ("empty messages", {"model": "smollm2", "messages": [], "max_tokens": 8}, 400, "messages"),
    ("unknown field", {"model": "smollm2", "messages": ASK, "max_tokens": 8, "n": 2}, 400, "n"),
    ("temperature over 1", {"model": "smollm2", "messages": ASK, "max_tokens": 8, "temperature": 1.5}, 400,
     "temperature"),
    ("an image", {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400,
     "takes no images"),
    ("prefill", {"model": "smollm2", "max_tokens": 8, "messages": [*ASK, {"role": "assistant", "content": "It"}]},
     400, "Prefill is not supported"),
    ("thinking budget not below max_tokens", {"model": "smollm2", "max_tokens": 8, "messages": ASK,
                                              "thinking": {"type": "enabled", "budget_tokens": 8}}, 400,
     "less than max_tokens"),
    ("tool_result answering no call", {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, 400, "toolu_x"),
    ("tool_choice naming no tool", {"model": "smollm2", "max_tokens": 8, "messages": ASK, "tools": [WEATHER],
                                    "tool_choice": {"type": "tool", "name": "nope"}}, 400, "nope"),
    ("unknown model", {"model": "claude-x", "messages": ASK, "max_tokens": 8}, 404, "claude-x"),
]


@pytest.mark.parametrize("name, body, status, says", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_answer_in_anthropic_shape(server, name, body, status, says) -> None:  # noqa: ANN001
    resp = httpx.post(f"{server['url']}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert resp.status_code == status, resp.text
    err = resp.json()
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert says in err["error"]["message"], err
    if name == "missing max_tokens":  # the official client says the same
        with pytest.raises(anthropic.BadRequestError) as e:
            server["client"].messages.create(model="smollm2", messages=ASK, max_tokens=None)  # type: ignore[arg-type]
        assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"


def test_the_api_key(server) -> None:  # noqa: ANN001
    url, body = server["url"], {"model": "smollm2", "messages": ASK, "max_tokens": 1}
    assert httpx.post(f"{url}/v1/messages", json=body, headers=BEARER).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        resp = httpx.post(f"{url}/v1/messages", json=body, headers=headers)
        assert resp.status_code == 401
        assert resp.json() == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": "Incorrect API key provided."}}
    wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="smollm2", messages=ASK, max_tokens=1)
    # the OpenAI routes take x-api-key too, and keep their own error shape
    assert httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-api-key": KEY}).status_code == 200
    assert "type" not in httpx.post(f"{url}/v1/chat/completions", json=body).json()


TIME_ASK = [{"role": "user", "content": "What time is it in Paris?"}]
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}


def _token_ids(url: str, text: str) -> list[int]:
    resp = httpx.post(f"{url}/tokenize", json={"model": "smollm2", "prompt": text, "add_special_tokens": False},
                      headers=BEARER)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def test_thinking_blocks_whole_and_streamed(server) -> None:  # noqa: ANN001
    """``budget_tokens`` caps the thinking: after 6 tokens ``</think>`` is forced and the answer follows.

    SmolLM2 has no ``<think>`` token: the template's ``<think>`` is three tokens, found as text.
    """
    client, url = server["client"], server["url"]
    budget, max_tokens = 6, 16
    thinking = {"type": "enabled", "budget_tokens": budget}
    prompt = _prompt(url, TIME_ASK, thinking=True)
    counted = client.messages.count_tokens(model="smollm2", messages=TIME_ASK, thinking=thinking)
    assert counted.input_tokens == len(prompt)
    thought, _, _ = _raw_greedy(url, prompt, budget)
    assert "</think>" not in thought and thought
    head = prompt + _token_ids(url, thought)
    assert len(head) == len(prompt) + budget  # the thought round-trips through text
    head += _token_ids(url, "</think>") + _token_ids(url, "\n\n")
    answer, reason, num_tokens = _raw_greedy(url, head, max_tokens - (len(head) - len(prompt)))
    expected = [("thinking", thought), ("text", answer.lstrip("\n"))] if answer.strip() else [("thinking", thought)]
    out = client.messages.create(model="smollm2", max_tokens=max_tokens, messages=TIME_ASK, thinking=thinking,
                                 extra_body=GREEDY)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in out.content] == expected
    assert (out.stop_reason, out.usage.output_tokens) == (reason, max_tokens)
    with client.messages.stream(model="smollm2", max_tokens=max_tokens, messages=TIME_ASK, thinking=thinking,
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert "".join(pieces) == thought
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == expected


def test_thinking_with_a_forced_tool_is_refused(server) -> None:  # noqa: ANN001
    with pytest.raises(anthropic.BadRequestError, match="thinking may not be enabled") as caught:
        server["client"].messages.create(model="smollm2", max_tokens=32, messages=TIME_ASK, tools=[TIME],
                                         thinking={"type": "enabled", "budget_tokens": 8},
                                         tool_choice={"type": "any"})
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_without_thinking_the_reply_is_text(server) -> None:  # noqa: ANN001
    client, url = server["client"], server["url"]
    for thinking in ({"type": "disabled"}, None):
        kwargs = {"thinking": thinking} if thinking else {}
        prompt = _prompt(url, TIME_ASK, thinking=False)
        counted = client.messages.count_tokens(model="smollm2", messages=TIME_ASK, **kwargs).input_tokens
        assert counted == len(prompt)
        expected, _, _ = _raw_greedy(url, prompt, 10)
        out = client.messages.create(model="smollm2", max_tokens=10, messages=TIME_ASK, extra_body=GREEDY, **kwargs)
        assert [(b.type, b.text) for b in out.content] == [("text", expected)]


def test_tools_and_results_reach_the_template(server) -> None:  # noqa: ANN001
    client, url = server["client"], server["url"]
    out = client.messages.create(model="smollm2", max_tokens=48, messages=TIME_ASK, tools=[TIME], extra_body=GREEDY,
                                 tool_choice={"type": "tool", "name": "get_time"})
    (call,) = out.content
    assert call.type == "tool_use" and call.name == "get_time" and call.input["zone"] in ("UTC", "CET")
    assert out.stop_reason == "tool_use"
    history = [*TIME_ASK, {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12:00"}]}]
    counted = client.messages.count_tokens(model="smollm2", messages=history, tools=[TIME]).input_tokens
    # transformers' own rendering of the same conversation, as OpenAI-style messages
    tokenizer = server["hf_tokenizer"]
    openai_history = [*TIME_ASK, {"role": "assistant", "content": "", "tool_calls": [{
        "id": call.id, "type": "function", "function": {"name": "get_time", "arguments": call.input}}]},
        {"role": "tool", "tool_call_id": call.id, "name": "get_time", "content": "12:00"}]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": TIME["input_schema"]}}]
    text = tokenizer.apply_chat_template(openai_history, tools=tools, chat_template=THINKING_TEMPLATE,
                                         add_generation_prompt=True, tokenize=False)
    assert '"name": "get_time"' in text and "<tool_response>\n12:00\n</tool_response>" in text
    assert counted == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert counted > len(_prompt(url, TIME_ASK, thinking=False)) + 40  # the tool list is in the prompt


def test_a_claude_code_shaped_request(server) -> None:  # noqa: ANN001
    """What Claude Code sends: ``?beta=true``, beta headers, cached system blocks, tools with ``$schema``,
    ``metadata.user_id``, ``temperature: 1``, streamed; the stream is Anthropic's and the KV comes back."""
    bash = {"name": "Bash", "description": "Run a shell command", "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"], "additionalProperties": False}}
    body = {
        "model": "smollm2", "max_tokens": 24, "temperature": 1, "stream": True, "metadata": {"user_id": "user_abc"},
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "List the files.",
                                                   "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{**bash, "cache_control": {"type": "ephemeral"}}],
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
    with httpx.stream("POST", f"{server['url']}/v1/messages?beta=true", json=body, headers=headers,
                      timeout=300) as resp:
        assert resp.status_code == 200
        types = [json.loads(line[len("data: "):])["type"] for line in resp.iter_lines() if line.startswith("data: ")]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    assert wait_kv_free(server["url"]) == 0.0
