"""Tool calling on /v1/chat/completions, driven by the official openai client against real servers.

Two servers on loopback: the bundled SmolLM2 (its template ignores tools,
so calls come from ``required`` and named functions, which a grammar
forces) and a tiny random-weight Qwen3 whose template lists the tools and
renders calls Hermes-style (``tests/tool_models.py``). A random model never
writes a call on its own, so the ``auto`` tests give it a regex constraint
that makes its output one; the parser still has to find the call in it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from server_helpers import serve_in_thread, wait_kv_free

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# what a Hermes-style model writes when it calls get_weather after a few words
AUTO_CALL = r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'


def _serve(path: str | None, name: str, **settings) -> Iterator[dict]:  # noqa: ANN003
    from pagedllm import LLM

    kwargs = {"num_kv_blocks": 96, "max_model_len": 1024, "num_threads": 1}
    llm = LLM(path, **kwargs) if path is not None else LLM(**kwargs)
    with serve_in_thread(llm.llm_engine, model_name=name, **settings) as url:
        yield {"url": url, "client": OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)}


@pytest.fixture(scope="module")
def bundled() -> Iterator[dict]:
    yield from _serve(None, "smollm2")


@pytest.fixture(scope="module")
def tool_model(tiny_tool_model_dir: str) -> Iterator[dict]:
    yield from _serve(tiny_tool_model_dir, "tiny-tools")


@pytest.fixture(scope="module")
def thinking_tool_model(tiny_tool_model_dir: str) -> Iterator[dict]:
    yield from _serve(tiny_tool_model_dir, "tiny-tools", reasoning_parser="qwen3")


def _check_calls(calls, allowed: set[str]) -> None:  # noqa: ANN001
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_gives_valid_calls(bundled, parallel) -> None:  # noqa: ANN001
    for seed in range(6):
        out = bundled["client"].chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
            temperature=1.0, seed=seed, max_tokens=160,
        )
        choice = out.choices[0]
        if choice.finish_reason == "length":
            continue  # a call cut by max_tokens is not a call; the finished ones are checked
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls, set(SCHEMAS))
        if not parallel:
            assert len(choice.message.tool_calls) == 1
    assert wait_kv_free(bundled["url"]) == 0.0


def test_named_function_always_gives_that_call(bundled) -> None:  # noqa: ANN001
    finished = 0
    for seed in range(6):
        out = bundled["client"].chat.completions.create(
            model="smollm2", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=128,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )
        choice = out.choices[0]
        if choice.finish_reason == "length":
            continue
        finished += 1
        assert choice.finish_reason == "stop"  # OpenAI's reason for a forced call
        _check_calls(choice.message.tool_calls, {"get_time"})
        assert len(choice.message.tool_calls) == 1
    assert finished >= 3


def test_streamed_required_calls_reassemble_into_the_whole_answer(bundled) -> None:  # noqa: ANN001
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3,
                  max_tokens=160)
    whole = bundled["client"].chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in bundled["client"].chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id is not None:
                    assert call["id"] is None  # the id comes once, with the name
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == whole.finish_reason
    streamed = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]


def test_tools_reach_the_template_and_auto_calls_are_parsed(tool_model) -> None:  # noqa: ANN001
    client = tool_model["client"]
    out = client.chat.completions.create(
        model="tiny-tools", messages=ASK, tools=TOOLS, temperature=1.0, seed=0, max_tokens=96,
        extra_body={"structured_outputs": {"regex": AUTO_CALL}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content.strip() == "I will check."  # as vLLM, the text before the tag, as written
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and args["unit"] == "celsius"
    # the same output with tool_choice "none" is plain content
    plain = client.chat.completions.create(
        model="tiny-tools", messages=ASK, tools=TOOLS, tool_choice="none", temperature=1.0, seed=0, max_tokens=96,
        extra_body={"structured_outputs": {"regex": AUTO_CALL}},
    ).choices[0]
    assert plain.message.tool_calls in (None, []) and "<tool_call>" in plain.message.content
    # the prompt holds the tools: more tokens than without them
    bare = client.chat.completions.create(model="tiny-tools", messages=ASK, max_tokens=1)
    assert out.usage.prompt_tokens > bare.usage.prompt_tokens + 40


def test_streamed_auto_call_matches_the_whole_answer(tool_model) -> None:  # noqa: ANN001
    kwargs = dict(model="tiny-tools", messages=ASK, tools=TOOLS, temperature=1.0, seed=0, max_tokens=96,
                  extra_body={"structured_outputs": {"regex": AUTO_CALL}})
    whole = tool_model["client"].chat.completions.create(**kwargs).choices[0]
    content, args, names = "", "", []
    for chunk in tool_model["client"].chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.function.name:
                    names.append(d.function.name)
                args += d.function.arguments or ""
            if choice.finish_reason:
                assert choice.finish_reason == "tool_calls"
    assert "<tool_call>" not in content and content == whole.message.content
    assert names == ["get_weather"] and args == whole.message.tool_calls[0].function.arguments


def test_a_follow_up_with_the_tool_result(tool_model) -> None:  # noqa: ANN001
    client = tool_model["client"]
    first = client.chat.completions.create(
        model="tiny-tools", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=1,
        max_tokens=96, parallel_tool_calls=False,
    ).choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    follow = client.chat.completions.create(model="tiny-tools", messages=history, tools=TOOLS, max_tokens=8)
    assert follow.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(f"{tool_model['url']}/tokenize", json={"messages": history, "return_token_strs": True})
    text = "".join(rendered.json()["token_strs"])
    assert "tool_response" in text and call.function.name in text


BAD_TOOL_REQUESTS = [
    ("unknown function", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    ("required without tools", dict(tool_choice="required"), "tool_choice"),
    ("duplicate names", dict(tools=[WEATHER, WEATHER]), "tools"),
    ("parameters not a schema", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": 5}}]),
     "tools"),
    ("forced call with response_format", dict(tools=TOOLS, tool_choice="required",
                                              response_format={"type": "json_object"}), "tool_choice"),
    ("tool message answering no call",
     dict(messages=[*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]), "messages"),
    ("arguments not JSON", dict(messages=[*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{zone"}}]}]), "messages"),
    ("user message without content", dict(messages=[{"role": "user"}]), "messages"),
]


@pytest.mark.parametrize("name, kwargs, param", BAD_TOOL_REQUESTS, ids=[b[0] for b in BAD_TOOL_REQUESTS])
def test_bad_tool_requests_are_400(bundled, name, kwargs, param) -> None:  # noqa: ANN001
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        bundled["client"].chat.completions.create(**body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    # the server keeps serving
    assert bundled["client"].chat.completions.create(model="smollm2", messages=ASK, max_tokens=2).choices


def test_bench_serve_mixes_schemas_and_tools_into_the_workload(bundled, capsys) -> None:  # noqa: ANN001
    from pagedllm.entrypoints import cli

    argv = ["bench", "serve", "--base-url", bundled["url"], "--num-prompts", "9", "--input-len", "24",
            "--output-len", "40", "--max-concurrency", "4", "--mix", "plain:1,json:1,tools:1", "--json"]
    assert cli.main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["failed"] == 0 and res["completed"] == 9, res["errors"]
    assert set(res["by_kind"]) == {"plain", "json", "tools"}
    assert sum(k["completed"] for k in res["by_kind"].values()) == 9
    assert res["by_kind"]["plain"]["mean_output_tokens"] == 40
    for kind in res["by_kind"].values():
        assert kind["ttft_ms"]["mean"] > 0
    assert cli.main(["bench", "serve", "--base-url", bundled["url"], "--mix", "plain:1,video:2"]) == 2
    assert "unknown request kind" in capsys.readouterr().err
    assert wait_kv_free(bundled["url"]) == 0.0


# what Qwen3 writes when it thinks, then calls: a <tool_call> inside the thinking is not a call
THINK_CALL = (r'<think>\nMaybe <tool_call>\{"name": "get_time"\}</tool_call>\? No\.\n</think>\n\n'
              r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", '
              r'"unit": "celsius"\}\}\n</tool_call>')


def test_reasoning_and_calls_stream_together(thinking_tool_model) -> None:  # noqa: ANN001
    """``--reasoning-parser qwen3`` before the Hermes tool parser: the thinking is split off, the call after it parsed."""
    client = thinking_tool_model["client"]
    kwargs = dict(model="tiny-tools", messages=ASK, tools=TOOLS, temperature=1.0, seed=0, max_tokens=128,
                  extra_body={"structured_outputs": {"regex": THINK_CALL}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.reasoning_content == '\nMaybe <tool_call>{"name": "get_time"}</tool_call>? No.\n'
    assert whole.message.content.strip() == "I will check."
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert whole.finish_reason == "tool_calls"
    reasoning, content, names, args = "", "", [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                args += d.function.arguments or ""
    assert (reasoning, content) == (whole.message.reasoning_content, whole.message.content)
    assert names == ["get_weather"] and args == call.function.arguments
    assert wait_kv_free(thinking_tool_model["url"]) == 0.0


def test_thinking_token_budget_closes_the_block(thinking_tool_model, bundled) -> None:  # noqa: ANN001
    """A prompt that leaves ``<think>`` open: after 4 tokens the server forces ``</think>``, the answer follows."""
    client = thinking_tool_model["client"]
    # the template puts the user's text on its own line, so the prompt ends inside an open block
    ask = [{"role": "user", "content": "<think>"}]
    kwargs = dict(model="tiny-tools", messages=ask, temperature=0, max_tokens=24, logprobs=True,
                  extra_body={"thinking_token_budget": 4, "ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0]
    tokens = [t.token for t in whole.logprobs.content]
    assert "".join(tokens[4:7]).startswith("</think>")  # forced right after the budget
    assert whole.message.reasoning_content == "".join(tokens[:4])
    assert whole.message.content and "</think>" not in whole.message.content
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[0] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed[1] += choice.delta.content or ""
    assert streamed == [whole.message.reasoning_content, whole.message.content]
    # with a grammar: the thinking is free, the grammar holds after the forced end
    choices = ["yes indeed", "no"]
    guided = client.chat.completions.create(
        model="tiny-tools", messages=ask, temperature=0, max_tokens=24,
        extra_body={"thinking_token_budget": 4, "structured_outputs": {"choice": choices}}).choices[0]
    assert guided.message.reasoning_content == whole.message.reasoning_content
    assert guided.message.content in choices
    # no reasoning parser on the bundled server: a 400
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        bundled["client"].chat.completions.create(model="smollm2", messages=ask, max_tokens=4,
                                                  extra_body={"thinking_token_budget": 4})
