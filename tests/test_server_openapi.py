"""The described API: /openapi.json and /docs, and a schema-driven fuzzer against a real server.

schemathesis reads the server's own ``/openapi.json`` and sends generated
requests (valid ones and broken ones) to every operation of a real uvicorn
server on loopback, bounded in examples. No answer may be a 5xx, break its
documented schema, status code or content type; afterwards every KV block
is back in the pool. The model is a tiny random-weight Llama, so the
requests the fuzzer makes (up to 128 choices of up to 256 tokens) stay fast;
the KV pool is small enough that they preempt each other.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_helpers import serve_in_thread, wait_kv_free

FUZZ_CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
NUM_EXAMPLES = 30


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
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and not len(operation.body):
            continue  # the GETs take no parameter but a free-form model name: nothing to break
        labels.append(operation.label)

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=NUM_EXAMPLES, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: schemathesis.Case) -> None:
            response = case.call_and_validate(checks=FUZZ_CHECKS, timeout=120)
            statuses.setdefault(case.operation.label, []).append(response.status_code)

        fuzz()
    assert "POST /v1/chat/completions" in labels and "POST /v1/completions" in labels
    if mode is GenerationMode.POSITIVE:
        # the fuzzer's valid requests reached the engine, not only the validators
        assert 200 in statuses["POST /v1/completions"] and 200 in statuses["POST /v1/chat/completions"]
    else:
        assert all(code < 500 for codes in statuses.values() for code in codes)


def test_the_pool_is_whole_after_fuzzing(fuzz_server: dict) -> None:
    engine = fuzz_server["engine"]
    assert wait_kv_free(fuzz_server["url"]) == 0.0
    deadline = time.monotonic() + 15
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
