"""The request schema says exactly what the server does (issue 31, item 6).

Each check runs against a real uvicorn server on loopback around the bundled
SmolLM2, started with ``default_max_tokens=4`` (``--default-max-tokens``):
a refused request is a 400 with OpenAI's error body naming the field, and
what ``/openapi.json`` says of the same field agrees. The schemathesis runs
over every operation are in ``test_server_openapi.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from server_helpers import assert_openai_error, serve_in_thread

from pagedllm.entrypoints.openai.settings import ServerSettings
from pagedllm.entrypoints.openai.tool_messages import ROLES

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

CAP = 4
USER = {"role": "user", "content": "Say something."}
CALL = {"id": "call_a", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
CALL_B = {"id": "call_b", "type": "function", "function": {"name": "get_date", "arguments": "{}"}}


@pytest.fixture(scope="module")
def server(smollm_path: str) -> Iterator[dict]:
    from pagedllm import LLM

    llm = LLM(smollm_path, max_model_len=512, num_kv_blocks=64, num_threads=1)
    with serve_in_thread(llm.llm_engine, model_name="smollm2", default_max_tokens=CAP) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        yield {"url": url, "client": client, "spec": httpx.get(f"{url}/openapi.json", timeout=30).json()}


def _post(server: dict, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server['url']}{route}", json=body, timeout=120)


def _refused(server: dict, route: str, body: dict, param: str, code: str | None = None) -> dict:
    err = assert_openai_error(_post(server, route, body), 400, code)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    return err


def _schema(server: dict, name: str) -> dict:
    return server["spec"]["components"]["schemas"][name]


# --- roles ------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["system<|im_end|>", "0", "function", "", "System"])
def test_a_role_outside_the_api_is_refused(server: dict, role: str) -> None:
    body = {"messages": [{"role": role, "content": "hi"}, USER], "max_tokens": 1}
    err = _refused(server, "/v1/chat/completions", body, "messages")
    assert "messages[0].role" in err["message"]
    # /tokenize reads the same model: no special tokens smuggled into the template there either
    _refused(server, "/tokenize", {"messages": body["messages"]}, "messages")


def test_the_schema_lists_the_roles_the_server_takes(server: dict) -> None:
    role = _schema(server, "ChatMessage")["properties"]["role"]
    assert sorted(role["enum"]) == sorted(ROLES)
    assert "developer" in ROLES and "function" not in ROLES


def test_a_developer_message_is_the_system_prompt(server: dict) -> None:
    """OpenAI's newer models read developer messages as system instructions; the template gets ``system``."""
    def rendered(role: str) -> list[int]:
        body = {"messages": [{"role": role, "content": "Answer in French."}, USER]}
        r = _post(server, "/tokenize", body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    developer = rendered("developer")
    assert developer == rendered("system")
    # not the template's default system prompt plus a "developer" turn
    text = _post(server, "/detokenize", {"tokens": developer}).json()["prompt"]
    assert "developer" not in text and "Answer in French." in text
    out = server["client"].chat.completions.create(
        model="smollm2", messages=[{"role": "developer", "content": "Answer in French."}, USER], max_tokens=2,
    )
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens <= 2


# --- tool calls and their results -------------------------------------------------------------


def _tool_history(calls: list[dict], *replies: str, between: list[dict] | None = None) -> list[dict]:
    return [USER, {"role": "assistant", "content": None, "tool_calls": calls}, *(between or []),
            *({"role": "tool", "tool_call_id": r, "content": "12:00"} for r in replies)]


@pytest.mark.parametrize(("messages", "match"), [
    (_tool_history([CALL, {**CALL_B, "id": "call_a"}], "call_a"), "duplicate call id 'call_a'"),
    (_tool_history([CALL, CALL_B], "call_a", "call_a"), "answered twice"),
    (_tool_history([CALL], "call_z"), "no call has the id 'call_z'"),
    # the id of an earlier turn's call: OpenAI matches a result to the assistant message right before it
    (_tool_history([CALL], "call_a") + [{"role": "assistant", "content": "It is noon."}, USER,
                                          {"role": "tool", "tool_call_id": "call_a", "content": "13:00"}],
     "right before it"),
    (_tool_history([CALL], "call_a", between=[USER]), "right before it"),
])
def test_tool_messages_follow_openais_rules(server: dict, messages: list[dict], match: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server["client"].chat.completions.create(model="smollm2", messages=messages, max_tokens=1)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "messages" and match in e.value.body["message"], e.value.body


def test_every_call_answered_once_is_accepted(server: dict) -> None:
    out = server["client"].chat.completions.create(
        model="smollm2", messages=_tool_history([CALL, CALL_B], "call_b", "call_a"), max_tokens=1,
    )
    assert out.choices[0].finish_reason in ("stop", "length")


# --- the schema and the checks say the same --------------------------------------------------


def test_suffix_is_documented_as_unsupported_and_refused(server: dict) -> None:
    prop = _schema(server, "CompletionRequest")["properties"]["suffix"]
    assert prop["type"] == "null"
    _refused(server, "/v1/completions", {"prompt": "Hi", "suffix": "!", "max_tokens": 1}, "suffix",
             "unsupported_parameter")
    ok = _post(server, "/v1/completions", {"prompt": "Hi", "suffix": None, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_an_empty_stop_string_is_refused_by_the_schema_too(server: dict) -> None:
    """schemathesis found it: the schema allowed "" where the server refuses it."""
    prop = _schema(server, "CompletionRequest")["properties"]["stop"]
    text = [s for s in prop["anyOf"] if s.get("type") == "string"]
    listed = [s for s in prop["anyOf"] if s.get("type") == "array"]
    assert text[0]["minLength"] == 1 and listed[0]["items"]["minLength"] == 1
    for stop in ("", ["ok", ""]):
        _refused(server, "/v1/completions", {"prompt": "Hi", "stop": stop, "max_tokens": 1}, "stop")
    ok = _post(server, "/v1/completions", {"prompt": "Hi", "stop": ["\n"], "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_top_logprobs_needs_logprobs_in_the_schema_and_the_server(server: dict) -> None:
    rules = [rule["anyOf"] for rule in _schema(server, "ChatCompletionRequest")["allOf"]]
    assert any({"required": ["logprobs"], "properties": {"logprobs": {"const": True}}} in rule for rule in rules)
    for logprobs in ({}, {"logprobs": False}, {"logprobs": None}):
        _refused(server, "/v1/chat/completions", {"messages": [USER], "top_logprobs": 2, **logprobs},
                 "top_logprobs")
    out = server["client"].chat.completions.create(
        model="smollm2", messages=[USER], logprobs=True, top_logprobs=2, max_tokens=1,
    )
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 2


def test_kv_state_replica_has_the_range_the_server_serves(server: dict) -> None:
    params = server["spec"]["paths"]["/kv/state"]["get"]["parameters"]
    replica = next(p for p in params if p["name"] == "replica")["schema"]
    assert (replica["minimum"], replica["maximum"]) == (0, 0)  # one engine: replica 0 only
    assert httpx.get(f"{server['url']}/kv/state", params={"replica": 0}, timeout=30).status_code == 200
    for bad in ("1", "-1", "2147483648", "x", "0.0", "1e0"):
        err = assert_openai_error(httpx.get(f"{server['url']}/kv/state", params={"replica": bad}, timeout=30), 400)
        assert err["param"] == "replica", err


def test_detokenize_token_ids_are_the_vocabularys(server: dict) -> None:
    item = _schema(server, "DetokenizeRequest")["properties"]["tokens"]["items"]
    vocab = httpx.get(f"{server['url']}/tokenizer_info", timeout=30).json()["vocab_size"]
    assert (item["minimum"], item["maximum"]) == (0, vocab - 1)
    for bad in ([-1], [1, -5], [vocab]):
        _refused(server, "/detokenize", {"tokens": bad}, "tokens")
    ok = _post(server, "/detokenize", {"tokens": [vocab - 1, 0]})
    assert ok.status_code == 200, ok.text


def test_tokenize_needs_at_least_one_message(server: dict) -> None:
    messages = _schema(server, "TokenizeRequest")["properties"]["messages"]
    assert {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ChatMessage"}} in messages["anyOf"]
    _refused(server, "/tokenize", {"messages": []}, "messages")
    _refused(server, "/v1/chat/completions", {"messages": []}, "messages")


def test_an_integer_written_with_a_zero_fraction_is_that_integer(server: dict) -> None:
    """JSON Schema's ``integer`` takes ``2.0``; a fraction, a string or a boolean stays a 400."""
    r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2.0, "ignore_eos": True, "n": 1.0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    for bad in (2.5, "2", True):
        _refused(server, "/v1/completions", {"prompt": "Hi", "max_tokens": bad}, "max_tokens", "invalid_type")


# --- the server's default cap on a reply ---------------------------------------------------


def test_default_max_tokens_caps_a_chat_that_sets_none(server: dict) -> None:
    def completion_tokens(**limits: int) -> int:
        out = server["client"].chat.completions.create(
            model="smollm2", messages=[USER], extra_body={"ignore_eos": True}, **limits,
        )
        return out.usage.completion_tokens

    assert completion_tokens() == CAP
    # a request's own value is used as it is, above or below the cap
    assert completion_tokens(max_tokens=CAP + 3) == CAP + 3
    assert completion_tokens(max_completion_tokens=CAP + 2) == CAP + 2
    assert completion_tokens(max_tokens=2) == 2


def test_default_max_tokens_caps_a_completion_that_sets_none(server: dict) -> None:
    def completion_tokens(**limits: int | None) -> int:
        r = _post(server, "/v1/completions", {"prompt": "Once upon a time", "ignore_eos": True, **limits})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    assert completion_tokens() == CAP  # OpenAI's 16 when left out, lowered to the cap
    assert completion_tokens(max_tokens=None) == CAP  # null: the context's limit, so the cap
    assert completion_tokens(max_tokens=CAP + 3) == CAP + 3


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_a_bad_default_max_tokens_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="default_max_tokens"):
        ServerSettings(model_name="m", default_max_tokens=bad)
