"""Structured outputs through ``pagedllm serve``: ``response_format`` and vLLM's ``structured_outputs``.

A real server in a subprocess, driven by the official ``openai`` client
(``chat.completions.parse`` with a pydantic model) and by plain HTTP for the
error bodies. Outputs are checked with ``jsonschema``, ``re`` and pydantic,
independently of the grammar engine. Greedy everywhere: the tests are about
the API, the sampled cases are offline (``test_structured_outputs.py``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from server_helpers import assert_openai_error, served

from pagedllm.loader import bundled_model_path

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "1024", "--num-threads", "1"]
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
}


class Person(BaseModel):
    """What ``parse`` turns the reply into."""

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from served(ENGINE, tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def client(server: str) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model() -> str:
    return os.path.basename(bundled_model_path())


def test_parse_with_a_pydantic_model(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Person, temperature=0, max_tokens=80
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.parsed == Person.model_validate_json(choice.message.content)


def test_json_schema_and_json_object_on_both_routes(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt, temperature=0,
                                          max_tokens=80)
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    comp = client.completions.create(model=model, prompt="A person as JSON:", temperature=0, max_tokens=80,
                                     extra_body={"response_format": fmt})
    assert comp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)
    obj = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=120,
        extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
    )
    content = obj.choices[0].message.content
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # the model's object outran max_tokens: still an object's beginning
        assert obj.choices[0].finish_reason == "length" and content.startswith("{")
    text = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=8,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content


def test_vllm_structured_outputs_field(client, model):
    regex = r"[A-Z][a-z]{2,8} [0-9]{2}"
    out = client.completions.create(model=model, prompt="Name and age:", temperature=0, max_tokens=20,
                                    extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, out.choices[0].text)
    choices = ["Paris", "London", "Rome"]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Capital of France?"}],
                                          n=2, temperature=1.0, seed=3, max_tokens=10,
                                          extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in chat.choices)
    grammar = 'root ::= "yes" | "no"'
    chat = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=5,
                                          extra_body={"structured_outputs": {"grammar": grammar}})
    assert chat.choices[0].message.content in ("yes", "no")
    schema_out = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=80,
                                                extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(schema_out.choices[0].message.content), SCHEMA)


def test_a_streamed_constrained_reply_is_the_same_text(client, model):
    body = dict(model=model, messages=MESSAGES, temperature=0, max_tokens=80,
                extra_body={"structured_outputs": {"json": SCHEMA}})
    whole = client.chat.completions.create(**body).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **body) if c.choices]
    assert "".join(parts) == whole


@pytest.mark.parametrize(
    "route, extra, param, needle",
    [
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format", "Unsupported type"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "json_schema.schema"),
        ("chat", {"response_format": {"type": "yaml"}}, "response_format", None),
        ("completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regular expression"),
        ("completions", {"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", "not defined"),
        ("chat", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ("chat", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", None),
        ("chat", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs", "not both"),
    ],
)
def test_a_bad_constraint_is_a_400_and_the_server_keeps_serving(server, model, route, extra, param, needle):
    if route == "chat":
        path, body = "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 8}
    else:
        path, body = "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 8}
    resp = httpx.post(f"{server}{path}", json={**body, **extra}, timeout=120)
    err = assert_openai_error(resp, 400)
    assert err["param"] == param, err
    if needle is not None:
        assert needle in err["message"], err
    ok = httpx.post(f"{server}{path}", json={**body, "structured_outputs": {"choice": ["fine"]}}, timeout=120)
    assert ok.status_code == 200, ok.text
    assert "fine" in ok.text
