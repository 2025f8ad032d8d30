"""The described API: /openapi.json and /docs, and a schema-driven fuzzer against a real server.

schemathesis reads the server's own ``/openapi.json`` and sends generated
requests (valid ones and broken ones) to every operation of a real uvicorn
server on loopback, bounded in examples. No answer may be a 5xx, break its
documented schema, status code or content type; afterwards every KV block
is back in the pool. The schema must also say what the server takes: a
request it allows is not refused (``positive_data_acceptance``) and one it
forbids is (``negative_data_rejection``), short of the rules JSON Schema
cannot state (``UNSTATABLE``). The model is a tiny random-weight Llama, so the
requests the fuzzer makes (up to 128 choices of up to 256 tokens) stay fast;
the KV pool is small enough that they preempt each other.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_helpers import serve_in_thread, wait_kv_free

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

FUZZ_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# per operation and mode (30 before): every operation is still fuzzed both ways, and test_hardening.py's
# fuzz sends hundreds more bodies to the two generating routes
NUM_EXAMPLES = 20

# 400s to a schema-valid request that no JSON Schema could rule out: each error message (a regex) is a rule
# about relations between values or messages, what a string holds, or how text tokenizes
UNSTATABLE = {
    r"maximum context length": "the prompt's token count (plus max_tokens) against the context",
    r"the prompt is empty": "a text that tokenizes to no token",
    r"min_tokens must be less than or equal to max_tokens": "a relation between two values",
    r"best_of must be": "best_of against n",
    r"best_of cannot be streamed": "best_of against n and stream",
    r"'tool' message must answer|answered twice|duplicate call id": "tool results against earlier messages' calls",
    r"function\.arguments (is not valid JSON|must be the JSON text)": "what a JSON string holds",
    r"^tool_choice|^tools|parallel_tool_calls": "tool_choice against tools, and the tools' JSON schemas",
    r"constrains the output already|set response_format or structured_outputs": "two constraints at once",
    r"^(structured_outputs|response_format)": "a regex, grammar or JSON schema that does not compile",
    r"^bad_words|^logit_bias|^allowed_token_ids|^stop_token_ids": "token ids and words against the vocabulary",
    # the generator compares big integers as doubles: -2**63 - 191 passes a minimum of -2**63 there
    r"^seed must be an integer (>= -9223372036854775808|<= 9223372036854775807)": "int64's bounds as doubles",
}


def _statable_rejection(response) -> bool:  # noqa: ANN001 - schemathesis' response
    """Whether a 400 is one the schema should have ruled out (not an ``UNSTATABLE`` rule)."""
    if response.status_code != 400:
        return True
    message = response.json()["error"]["message"]
    return not any(re.search(rule, message) for rule in UNSTATABLE)


def schema_allowed_is_accepted(ctx, response, case) -> bool | None:  # noqa: ANN001 - schemathesis' check API
    """``positive_data_acceptance``, short of the rules a schema cannot state."""
    if not _statable_rejection(response):
        return None
    return positive_data_acceptance(ctx, response, case)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dirs: dict[str, str]) -> Iterator[dict]:
    """A real server on loopback around the tiny Llama: 40 KV blocks of 8 tokens, contexts of 256."""
    from pagedllm import LLM

    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=40, block_size=8, max_model_len=256, num_threads=1)
    with serve_in_thread(llm.llm_engine, model_name="tiny", max_waiting=64) as url:
        yield {"url": url, "engine": llm.llm_engine}


@pytest.fixture(scope="module")
def api_schema(fuzz_server: dict) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzz_server['url']}/openapi.json")


def test_openapi_describes_every_request_field(fuzz_server: dict) -> None:
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    spec = httpx.get(f"{fuzz_server['url']}/openapi.json").json()
    paths = spec["paths"]
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = paths[route]["post"]["responses"]
        assert "422" not in responses  # validation errors are 400s here
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    schemas = spec["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest):
        documented = set(schemas[model.__name__]["properties"])
        fields = {f.alias or name for name, f in model.model_fields.items()}
        assert documented == fields
        assert schemas[model.__name__]["additionalProperties"] is False
    assert "text/event-stream" in paths["/v1/completions"]["post"]["responses"]["200"]["content"]
    docs = httpx.get(f"{fuzz_server['url']}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    # Swagger UI comes from this server, not a CDN: an offline machine gets a working page
    assets = re.findall(r'(?:src|href)="([^"]+)"', docs.text) + re.findall(r"url: '([^']+)'", docs.text)
    assert assets and all(a.startswith("/") for a in assets), assets
    for asset in assets:
        r = httpx.get(f"{fuzz_server['url']}{asset}")
        assert r.status_code == 200 and r.content, asset
    assert "SwaggerUIBundle" in httpx.get(f"{fuzz_server['url']}/docs/static/swagger-ui-bundle.js").text


def test_a_validation_error_is_a_400_in_openai_shape(fuzz_server: dict) -> None:
    r = httpx.post(f"{fuzz_server['url']}/v1/completions", json={"prompt": "hi", "max_tokens": "3"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["code"] == "invalid_type"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_get_no_5xx_and_follow_the_schema(api_schema: schemathesis.BaseSchema, mode) -> None:  # noqa: ANN001
    """Every operation, schema-valid bodies (positive) and broken ones (negative)."""
    labels = []
    statuses: dict[str, list[int]] = {}
    checks = FUZZ_CHECKS + [schema_allowed_is_accepted if mode is GenerationMode.POSITIVE else negative_data_rejection]
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and not len(operation.body) and not len(operation.query):
            continue  # GETs with no parameter but a free-form model name: nothing to break
        labels.append(operation.label)

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=NUM_EXAMPLES, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: schemathesis.Case) -> None:
            response = case.call_and_validate(checks=checks, timeout=120)
            statuses.setdefault(case.operation.label, []).append(response.status_code)

        fuzz()
    assert "POST /v1/chat/completions" in labels and "POST /v1/completions" in labels
    assert mode is GenerationMode.POSITIVE or "GET /kv/state" in labels  # its replica has a range to break
    if mode is GenerationMode.POSITIVE:
        # the fuzzer's valid requests reached the engine, not only the validators
        assert 200 in statuses["POST /v1/completions"] and 200 in statuses["POST /v1/chat/completions"]
    else:
        assert all(code < 500 for codes in statuses.values() for code in codes)


SURROGATE_EXAMPLES = 16  # per operation with a body (25 before), most refused at validation


def _with_surrogates(value: object, data: st.DataObject, found: list[int]) -> object:
    """``value`` with lone surrogates drawn into some of its strings and object keys (``found`` counts them)."""
    if isinstance(value, str):
        if not data.draw(st.booleans()):
            return value
        found.append(1)
        at = data.draw(st.integers(0, len(value)))
        return value[:at] + chr(data.draw(st.integers(0xD800, 0xDFFF))) + value[at:]
    if isinstance(value, list):
        return [_with_surrogates(v, data, found) for v in value]
    if isinstance(value, dict):
        return {_with_surrogates(k, data, found): _with_surrogates(v, data, found) for k, v in value.items()}
    return value


def test_fuzzed_bodies_with_lone_surrogates_get_no_5xx(fuzz_server: dict, api_schema: schemathesis.BaseSchema) -> None:
    """Schema-valid bodies with lone UTF-16 surrogates drawn into their strings and keys: never a 5xx, and
    a 400 in OpenAI's shape whenever one is there. Sent by hand as JSON with ``\\udXXX`` escapes (as a
    client's encoder writes them): schemathesis re-validates a changed body and cannot encode one."""
    num_with = 0
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if not len(operation.body):
            continue

        @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE), data=st.data())
        @settings(
            max_examples=SURROGATE_EXAMPLES, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: schemathesis.Case, data: st.DataObject) -> None:
            nonlocal num_with
            found: list[int] = []
            body = json.dumps(_with_surrogates(case.body, data, found))  # ensure_ascii: escapes
            response = httpx.request(
                case.method, f"{fuzz_server['url']}{case.formatted_path}", content=body.encode(),
                headers={"Content-Type": "application/json"}, timeout=120,
            )
            assert response.status_code < 500, response.text
            assert response.headers["content-type"].startswith(("application/json", "text/event-stream"))
            if found:
                num_with += 1
                err = response.json()["error"]
                assert response.status_code == 400 and "lone surrogate" in err["message"], response.text

        fuzz()
    assert num_with >= 20, num_with  # the draws did put surrogates in


def test_the_pool_is_whole_after_fuzzing(fuzz_server: dict) -> None:
    engine = fuzz_server["engine"]
    assert wait_kv_free(fuzz_server["url"]) == 0.0
    deadline = time.monotonic() + 15
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
