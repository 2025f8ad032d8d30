"""The OpenAI-compatible server, run for real on loopback, driven by the official ``openai`` client.

Two servers:

- ``server``: ``pagedllm serve`` in a subprocess (the CLI path), with the
  bundled model under its default name;
- ``guarded``: the same app in this process on a uvicorn thread, with an API
  key, ``max_num_seqs=1`` and ``max_waiting=2`` (so back-pressure is
  deterministic), and a model runner that fails any step holding a prompt that
  starts with ``POISON`` (so a failing request can be provoked).

Expected texts come from the offline ``LLM`` API, computed in this process
before its engine is handed to the guarded server; token counts come from the
server's ``ignore_eos``/``max_tokens`` contract and from the tokenizer.
Every model-loading command gets ``--num-threads 1``: the CI box has 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from server_helpers import (
    assert_openai_error,
    free_port,
    launch_server,
    metrics,
    sse_events,
    stop_server,
    wait_healthy,
    wait_kv_free,
)

from pagedllm.entrypoints import cli
from pagedllm.loader import bundled_model_path

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

# the default (8-bit) activations, batch-invariant here and in the offline reference (``ref``): the server
# runs a request among others, after prefix-cache hits, its decode steps captured, the reference alone and
# eager; without the mode those sum in other orders, and on 8-bit activations a last-bit difference can
# move a rounding step and a near-tie. With it a request's tokens and logprobs are the same bits however it
# is run (docs/batch-invariance.md), so the texts and logprobs below are compared exactly.
ENGINE = ["--num-kv-blocks", "256", "--max-model-len", "1024", "--num-threads", "1", "--batch-invariant"]
MAX_MODEL_LEN = 1024
API_KEY = "test-secret-key"
GUARDED_NAME = "guarded-smollm"
POISON = [31337, 31338, 31339]  # a prompt starting with these makes the guarded engine fail its step
STALL = [31340, 31341, 31342]  # ...and these make step() raise without aborting anything (a stuck engine)

COMPLETION_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SEEDED_PROMPT = "Once upon a time"
SEEDED = dict(n=3, temperature=1.0, top_p=0.95, seed=1234, max_tokens=10)
BEST_OF = dict(n=2, best_of=4, temperature=1.0, seed=99, max_tokens=8)
# every logits processor at once, offline and through both routes
PENALIZED = dict(temperature=0, max_tokens=12, presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3,
                 min_tokens=4, bad_words=[" Paris"], logit_bias={11: 2.5, 30: -100.0})


# --- the subprocess server ------------------------------------------------------------


@pytest.fixture(scope="module")
def server_launch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    """Start ``pagedllm serve`` (not waiting for it, so the in-process model loads meanwhile)."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = launch_server(["--port", str(port), *ENGINE], log)
    try:
        yield f"http://127.0.0.1:{port}", proc, log
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def server(server_launch: tuple[str, subprocess.Popen, Path], ref: dict) -> str:
    """The base URL of the running subprocess server (the reference model loads meanwhile)."""
    url, proc, log = server_launch
    wait_healthy(url, proc, log)
    return url


@pytest.fixture(scope="module")
def client(server: str) -> OpenAI:
    # no retries: a 429 or 500 must surface, not be retried away
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name() -> str:
    return os.path.basename(bundled_model_path())


# --- the in-process server, and the offline reference ---------------------------------


@pytest.fixture(scope="module")
def ref(server_launch: tuple[str, subprocess.Popen, Path]) -> dict:
    """Expected outputs from the offline API (loaded while the subprocess server loads)."""
    import gc

    from pagedllm import LLM, SamplingParams

    threads = torch.get_num_threads()
    # batch-invariant as the server is (ENGINE): the same bits as the server's, whatever its batches
    llm = LLM(num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, num_threads=1, batch_invariant=True)
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=12)
    out = {
        "completion": llm.generate(COMPLETION_PROMPT, greedy, use_tqdm=False)[0],
        "chat": llm.chat(CHAT_MESSAGES, greedy, use_tqdm=False)[0],
        "seeded": llm.generate(SEEDED_PROMPT, SamplingParams(**SEEDED), use_tqdm=False)[0],
        "hi_greedy": llm.generate("Hi", greedy, use_tqdm=False)[0],
        "logprobs": llm.generate(
            COMPLETION_PROMPT, SamplingParams(temperature=0, max_tokens=12, logprobs=3), use_tqdm=False
        )[0],
        "best_of": llm.generate(SEEDED_PROMPT, SamplingParams(**BEST_OF), use_tqdm=False)[0],
        "penalized": llm.generate(COMPLETION_PROMPT, SamplingParams(**PENALIZED), use_tqdm=False)[0],
        "penalized_chat": llm.chat(CHAT_MESSAGES, SamplingParams(**PENALIZED), use_tqdm=False)[0],
        "forced_text": tok.decode(tok.encode("Hello world")[:1] * 3),
        "hello_ids": tok.encode("Hello world"),
        "vocab_size": llm.llm_engine.model_config.vocab_size,
    }
    del llm, tok
    gc.collect()
    torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def guarded(ref: dict) -> Iterator[dict]:
    """The app in this process: API key, one sequence at a time, max_waiting=2, a poisonable runner."""
    import uvicorn

    from pagedllm import LLM
    from pagedllm.entrypoints.openai.api_server import ServerSettings, create_server_app

    threads = torch.get_num_threads()
    llm = LLM(num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_seqs=1, num_threads=1)
    engine = llm.llm_engine
    execute = engine.model_runner.execute

    def faulty_execute(record):  # noqa: ANN001, ANN202 - the runner's own signature
        # a poisoned prompt's first step sends it whole, starting with the poison tokens
        if any(list(n.token_ids[: len(POISON)]) == POISON for n in record.new_sequences):
            raise RuntimeError("injected fault")
        return execute(record)

    engine.model_runner.execute = faulty_execute
    step = engine.step

    def stuck_step():  # noqa: ANN202 - the engine's own signature
        if any(r.prompt_token_ids[: len(STALL)] == STALL for r in engine.requests.values()):
            raise RuntimeError("injected stall")
        return step()

    engine.step = stuck_step
    port = free_port()
    settings = ServerSettings(model_name=GUARDED_NAME, api_key=API_KEY, max_waiting=2, port=port)
    app = create_server_app(engine, settings)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield {"url": url, "engine": engine}
    finally:
        uv.should_exit = True
        thread.join(30)
        torch.set_num_threads(threads)


def guarded_client(guarded: dict, key: str = API_KEY) -> OpenAI:
    return OpenAI(base_url=f"{guarded['url']}/v1", api_key=key, max_retries=0, timeout=120)


# --- helpers -------------------------------------------------------------------------


# --- models, health, tokenizer --------------------------------------------------------


def test_health_and_models(server, client, model_name):
    assert httpx.get(f"{server}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"


def test_tokenize_and_detokenize(server, ref):
    r = httpx.post(f"{server}/tokenize", json={"prompt": "Hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == ref["hello_ids"]
    assert body["count"] == len(ref["hello_ids"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    r = httpx.post(f"{server}/detokenize", json={"tokens": ref["hello_ids"]})
    assert r.status_code == 200
    assert r.json()["prompt"] == "Hello world"
    # a conversation is rendered by the chat template, as the chat endpoint does
    r = httpx.post(f"{server}/tokenize", json={"messages": CHAT_MESSAGES})
    assert r.json()["tokens"] == ref["chat"].prompt_token_ids
    assert_openai_error(httpx.post(f"{server}/detokenize", json={"tokens": [ref["vocab_size"]]}), 400)
    assert_openai_error(httpx.post(f"{server}/tokenize", json={"prompt": 5}), 400)
    assert_openai_error(httpx.post(f"{server}/tokenize", json={"prompt": "x", "model": "nope"}), 404)


# --- completions and chat --------------------------------------------------------------


def test_completion_equals_offline_greedy(client, model_name, ref):
    out = client.completions.create(model=model_name, prompt=COMPLETION_PROMPT, max_tokens=12, temperature=0)
    expected = ref["completion"]
    assert out.object == "text_completion"
    assert out.model == model_name
    assert len(out.choices) == 1
    assert out.choices[0].text == expected.outputs[0].text
    assert "Paris" in out.choices[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == len(expected.prompt_token_ids) + 12


def test_chat_equals_offline_greedy(client, model_name, ref):
    out = client.chat.completions.create(model=model_name, messages=CHAT_MESSAGES, max_tokens=12, temperature=0)
    expected = ref["chat"]
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert out.choices[0].finish_reason == expected.outputs[0].finish_reason


def test_streamed_completion_equals_the_whole_one(client, model_name, ref):
    stream = client.completions.create(
        model=model_name, prompt=COMPLETION_PROMPT, max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # streamed, not sent at the end
    assert "".join(c.choices[0].text for c in text_chunks) == ref["completion"].outputs[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == len(ref["completion"].prompt_token_ids)


def test_streamed_chat_sse_format(server, model_name, ref):
    body = {"model": model_name, "messages": CHAT_MESSAGES, "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # the role opens the stream once, never again
    assert sum("role" in c["choices"][0]["delta"] for c in chunks) == 1
    assert all("usage" not in c for c in chunks)  # not asked for
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == ref["chat"].outputs[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == ref["chat"].outputs[0].finish_reason


def test_n_with_seed_is_reproducible_and_equals_offline(client, model_name, ref):
    kwargs = dict(model=model_name, prompt=SEEDED_PROMPT, **SEEDED)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert texts == [o.text for o in ref["seeded"].outputs]
    assert len(set(texts)) > 1  # n independent samples, not one copied
    assert first.usage.completion_tokens == sum(len(o.token_ids) for o in ref["seeded"].outputs)
    # streamed, the n choices interleave by index and add up to the same texts
    stream = client.completions.create(**kwargs, stream=True)
    parts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
    assert [parts[i] for i in range(3)] == texts


def test_chat_n_with_seed(client, model_name):
    kwargs = dict(model=model_name, messages=CHAT_MESSAGES, n=2, temperature=1.0, seed=7, max_tokens=8)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert len(a.choices) == 2
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, model_name, ref, include, stream):
    full = ref["completion"].outputs[0].text
    # a stop string from the middle of the greedy text; it may span tokens, so
    # streaming must hold text back until the match is decided
    mid = len(full) // 2
    stop = full[mid : mid + 3]
    cut = full.find(stop)
    expected = full[: cut + len(stop)] if include else full[:cut]
    extra = {"include_stop_str_in_output": True} if include else None
    out = client.completions.create(
        model=model_name, prompt=COMPLETION_PROMPT, max_tokens=12, temperature=0, stop=[stop, "@@@@"],
        stream=stream, extra_body=extra,
    )
    if stream:
        chunks = [c for c in out if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0]
    else:
        text, finish = out.choices[0].text, out.choices[0]
    assert text == expected
    assert finish.finish_reason == "stop"
    assert finish.model_extra["stop_reason"] == stop


def test_prompt_as_token_ids_and_lists(client, model_name, ref):
    ids = ref["completion"].prompt_token_ids
    want = ref["completion"].outputs[0].text
    out = client.completions.create(model=model_name, prompt=ids, max_tokens=12, temperature=0)
    assert out.choices[0].text == want
    assert out.usage.prompt_tokens == len(ids)
    # two prompts: choices numbered prompt_index * n + i, usage summed
    out = client.completions.create(
        model=model_name, prompt=[COMPLETION_PROMPT, "Hi"], max_tokens=12, temperature=0, n=1
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == want
    assert out.usage.prompt_tokens == len(ids) + 1
    assert out.usage.completion_tokens == 12 + len(ref["hi_greedy"].outputs[0].token_ids)
    assert out.choices[1].text == ref["hi_greedy"].outputs[0].text
    out = client.completions.create(model=model_name, prompt=[ids, ids], max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12
    # OpenAI's schema has no lists that mix text and token ids
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt=[COMPLETION_PROMPT, ids], max_tokens=2)


def test_ignore_eos_gives_exact_token_counts(client, model_name):
    out = client.completions.create(
        model=model_name, prompt="Hi", max_tokens=20, temperature=1.0, seed=3, extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 20
    assert out.choices[0].finish_reason == "length"


# --- errors --------------------------------------------------------------------------


def test_malformed_json_and_wrong_types_are_400(server, model_name):
    url = f"{server}/v1/completions"
    err = assert_openai_error(
        httpx.post(url, content=b'{"prompt": "x", oops', headers={"Content-Type": "application/json"}),
        400, "invalid_json",
    )
    assert "JSON" in err["message"]
    assert_openai_error(httpx.post(url, content=b"[1, 2]", headers={"Content-Type": "application/json"}), 400)
    assert_openai_error(httpx.post(url, content=b"", headers={"Content-Type": "application/json"}), 400)
    for bad in (
        {"prompt": "x", "max_tokens": "5"},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": "x", "n": 1.5},
        {"prompt": "x", "stream": "yes"},
        {"prompt": 12},
        {"prompt": [1, "a"]},
        {"prompt": "x", "stop": [1]},
    ):
        err = assert_openai_error(httpx.post(url, json={"model": model_name, **bad}), 400)
        assert err["type"] == "invalid_request_error"
    err = assert_openai_error(httpx.post(url, json={"max_tokens": 5}), 400, "missing_required_parameter")
    assert "prompt" in err["message"]
    chat = f"{server}/v1/chat/completions"
    assert_openai_error(httpx.post(chat, json={"messages": "hello"}), 400)
    assert_openai_error(httpx.post(chat, json={"messages": [{"role": "user"}], "bogus": 1}), 400)
    assert_openai_error(httpx.post(chat, json={"messages": [{"role": 1, "content": "x"}]}), 400)


BAD_REQUESTS = [
    ("negative max_tokens", dict(max_tokens=-1), "max_tokens"),
    ("zero max_tokens", dict(max_tokens=0), "max_tokens"),
    ("n = 0", dict(n=0), "n must"),
    ("n too large", dict(n=500), "n must"),
    ("negative temperature", dict(temperature=-0.5), "temperature"),
    ("top_p = 0", dict(top_p=0), "top_p"),
    ("top_p > 1", dict(top_p=1.5), "top_p"),
    ("bad top_k", dict(extra_body={"top_k": -3}), "top_k"),
    ("bad min_p", dict(extra_body={"min_p": 2}), "min_p"),
    ("empty stop", dict(stop=[""]), "stop"),
    ("logprobs over 20", dict(logprobs=21), "logprobs"),
    ("negative logprobs", dict(logprobs=-1), "logprobs"),
    ("presence_penalty > 2", dict(presence_penalty=2.5), "presence_penalty"),
    ("frequency_penalty < -2", dict(frequency_penalty=-3), "frequency_penalty"),
    ("logit_bias key not a token id", dict(logit_bias={"fifty": 10}), "logit_bias"),
    ("logit_bias negative key", dict(logit_bias={"-5": 10}), "logit_bias"),
    ("logit_bias key outside the vocabulary", dict(logit_bias={"99999999": 10}), "logit_bias"),
    ("logit_bias string value", dict(logit_bias={"50": "10"}), "logit_bias"),
    ("repetition_penalty 0", dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    ("min_tokens > max_tokens", dict(max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
    ("empty allowed_token_ids", dict(extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
    ("allowed_token_ids outside the vocabulary", dict(extra_body={"allowed_token_ids": [10**8]}), "allowed_token_ids"),
    ("empty bad word", dict(extra_body={"bad_words": [""]}), "bad_words"),
    ("bad_words not a list", dict(extra_body={"bad_words": "Paris"}), "bad_words"),
    ("truncate_prompt_tokens 0", dict(extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens"),
    ("suffix", dict(suffix="end"), "suffix"),
    ("best_of < n", dict(n=2, best_of=1), "best_of"),
    ("best_of streamed", dict(best_of=3, stream=True), "best_of"),
    ("prompt_logprobs", dict(extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
    ("unknown field", dict(extra_body={"frobnicate": True}), "frobnicate"),
    ("stream_options without stream", dict(stream_options={"include_usage": True}), "stream"),
    ("too long for max_tokens", dict(max_tokens=MAX_MODEL_LEN), "maximum context length"),
]


@pytest.mark.parametrize("name, kwargs, words", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_completion_requests_are_400(client, model_name, name, kwargs, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="Hello", **kwargs)
    assert e.value.status_code == 400
    assert words in e.value.message
    assert e.value.type == "invalid_request_error"


def test_logits_processor_errors_name_their_field_and_the_server_keeps_serving(server, client, model_name):
    for field, value in [("logit_bias", {"1e3": 1}), ("logit_bias", {"99999999": 1}), ("presence_penalty", 9),
                         ("allowed_token_ids", [5, 10**8]), ("bad_words", [" "]), ("min_tokens", 99)]:
        for route, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": CHAT_MESSAGES})):
            resp = httpx.post(f"{server}/v1/{route}", json={**body, "max_tokens": 4, field: value}, timeout=60)
            err = assert_openai_error(resp, 400)
            assert err["param"] == field, (field, value, err)
            assert err["type"] == "invalid_request_error"
    out = client.completions.create(model=model_name, prompt="Hi", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_penalties_and_vllm_extras_equal_offline(client, model_name, ref):
    fields = dict(PENALIZED)
    extra = {k: fields.pop(k) for k in ("repetition_penalty", "min_tokens", "bad_words")}
    fields["logit_bias"] = {str(t): b for t, b in fields["logit_bias"].items()}  # JSON keys are strings
    out = client.completions.create(model=model_name, prompt=COMPLETION_PROMPT, extra_body=extra, **fields)
    assert out.choices[0].text == ref["penalized"].outputs[0].text
    assert "Paris" not in out.choices[0].text  # " Paris" is what the model says unpenalized
    assert ref["penalized"].outputs[0].text != ref["completion"].outputs[0].text
    chat = client.chat.completions.create(model=model_name, messages=CHAT_MESSAGES, extra_body=extra, **fields)
    assert chat.choices[0].message.content == ref["penalized_chat"].outputs[0].text
    assert chat.usage.completion_tokens == len(ref["penalized_chat"].outputs[0].token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_and_allowed_token_ids_force_a_token(client, model_name, ref, stream):
    token = ref["hello_ids"][0]
    for kwargs in (dict(logit_bias={str(token): 100}), dict(extra_body={"allowed_token_ids": [token]})):
        kwargs.setdefault("extra_body", {})["ignore_eos"] = True
        out = client.completions.create(model=model_name, prompt="Once upon", max_tokens=3, temperature=0.8,
                                        seed=5, stream=stream, **kwargs)
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert text == ref["forced_text"]


def test_min_tokens_and_truncate_prompt_tokens_in_chat_and_completions(client, model_name):
    chat = client.chat.completions.create(model=model_name, messages=CHAT_MESSAGES, max_tokens=40, temperature=0,
                                          extra_body={"min_tokens": 40})
    assert chat.usage.completion_tokens == 40
    assert chat.choices[0].finish_reason == "length"
    long_text = "hello " * (MAX_MODEL_LEN + 50)  # too long for the context unless truncated
    out = client.completions.create(model=model_name, prompt=long_text, max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 8})
    assert out.usage.prompt_tokens == 8
    out = client.completions.create(model=model_name, prompt=list(range(100, 100 + MAX_MODEL_LEN + 5)), max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 5})
    assert out.usage.prompt_tokens == 5
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": long_text}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 16})
    assert chat.usage.prompt_tokens == 16


def test_completion_logprobs_equal_offline(client, model_name, ref):
    expected = ref["logprobs"].outputs[0]
    out = client.completions.create(
        model=model_name, prompt=COMPLETION_PROMPT, max_tokens=12, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    want = [pos[t].logprob for t, pos in zip(expected.token_ids, expected.logprobs)]
    assert lp.token_logprobs == want  # the same bits as offline (batch-invariant, ENGINE); JSON floats round-trip
    assert len(lp.tokens) == out.usage.completion_tokens == 12
    assert "".join(lp.tokens) == out.choices[0].text  # plain ASCII text: tokens concatenate to it
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3  # greedy: the chosen token is the most likely of the 3
        assert top[chosen] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))
        assert logprob <= 0
    # streamed, the chunks carry the logprobs of their own tokens
    chunks = [c for c in client.completions.create(
        model=model_name, prompt=COMPLETION_PROMPT, max_tokens=12, temperature=0, logprobs=3, stream=True,
    ) if c.choices]
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert [x for c in chunks for x in c.choices[0].logprobs.text_offset] == lp.text_offset
    # not asked for: null
    plain = client.completions.create(model=model_name, prompt=COMPLETION_PROMPT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs(client, model_name, ref):
    out = client.chat.completions.create(
        model=model_name, messages=CHAT_MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    # the EOS token counts (usage, logprobs) but has no text in the message
    assert "".join(t.token for t in content).startswith(out.choices[0].message.content)
    for t in content:
        assert t.bytes == list(t.token.encode("utf-8"))
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy
    # logprobs without top_logprobs: the chosen tokens only
    out = client.chat.completions.create(
        model=model_name, messages=CHAT_MESSAGES, max_tokens=4, temperature=0, logprobs=True
    )
    assert all(t.top_logprobs == [] for t in out.choices[0].logprobs.content)
    streamed = [c for c in client.chat.completions.create(
        model=model_name, messages=CHAT_MESSAGES, max_tokens=4, temperature=0, logprobs=True, stream=True,
    ) if c.choices and c.choices[0].logprobs]
    assert [t.token for c in streamed for t in c.choices[0].logprobs.content] == [
        t.token for t in out.choices[0].logprobs.content
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=CHAT_MESSAGES, top_logprobs=2)
    assert e.value.param == "top_logprobs"


def test_best_of_equals_offline(client, model_name, ref):
    out = client.completions.create(model=model_name, prompt=SEEDED_PROMPT, **BEST_OF)
    assert [c.text for c in out.choices] == [o.text for o in ref["best_of"].outputs]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(len(o.token_ids) for o in ref["best_of"].outputs)


def test_prompt_errors_are_400(client, model_name, ref):
    too_long = [100] * (MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=too_long, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=[100] * (MAX_MODEL_LEN - 10), max_tokens=20)
    assert e.value.code == "context_length_exceeded"
    long_text = "hello " * (MAX_MODEL_LEN + 50)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": long_text}])
    assert e.value.code == "context_length_exceeded"
    assert e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=[ref["vocab_size"] + 5], max_tokens=4)
    assert "vocabulary" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="", max_tokens=4)
    assert "empty" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[])


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="Hi", max_tokens=2)
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=CHAT_MESSAGES, max_tokens=2)
    assert e.value.code == "model_not_found"


def test_unknown_route_is_an_openai_error(server):
    assert_openai_error(httpx.get(f"{server}/v1/nothing-here"), 404)
    assert_openai_error(httpx.get(f"{server}/v1/completions"), 405)


# --- disconnects ---------------------------------------------------------------------


def test_disconnect_mid_stream_frees_the_blocks(server, model_name):
    assert wait_kv_free(server) == 0
    body = {
        "model": model_name, "prompt": "Once upon a time", "max_tokens": 900, "stream": True, "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as http:
        request = http.build_request("POST", f"{server}/v1/completions", json=body)
        resp = http.send(request, stream=True)
        events = sse_events(resp.iter_lines())
        for _ in range(3):
            next(events)
        held = metrics(server)
        assert held["pagedllm:kv_cache_usage_perc"] > 0
        assert held["pagedllm:num_requests_running"] == 1
        # a long generation blocks nobody: other routes answer meanwhile
        start = time.monotonic()
        assert httpx.get(f"{server}/v1/models", timeout=10).status_code == 200
        assert httpx.post(f"{server}/tokenize", json={"prompt": "hi"}, timeout=10).status_code == 200
        assert time.monotonic() - start < 5
        resp.close()  # the client goes away mid-stream
    assert wait_kv_free(server) == 0
    after = metrics(server)
    assert after["pagedllm:num_requests_running"] == 0
    # generation stopped long before 900 tokens
    time.sleep(0.3)
    assert metrics(server)["pagedllm:generation_tokens_total"] == after["pagedllm:generation_tokens_total"]


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_blocks(server, model_name):
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.5)
    assert wait_kv_free(server) == 0


# --- concurrency and metrics -----------------------------------------------------------


def test_32_concurrent_streams_complete_and_metrics_agree(server, client, model_name):
    assert wait_kv_free(server) == 0
    before = metrics(server)
    num = 32
    results: list[dict | None] = [None] * num

    def one(i: int) -> None:
        max_tokens = 4 + i % 5
        stream = client.completions.create(
            model=model_name, prompt=f"Request number {i} says", max_tokens=max_tokens, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        results[i] = {
            "max_tokens": max_tokens,
            "text": "".join(c.choices[0].text for c in chunks if c.choices),
            "finish": [c.choices[0].finish_reason for c in chunks if c.choices][-1],
            "usage": chunks[-1].usage,
        }

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, 150 - (time.monotonic() - start)))
    assert not any(t.is_alive() for t in threads), "some streams did not finish in time"
    assert all(r is not None for r in results)
    for r in results:
        assert r["usage"].completion_tokens == r["max_tokens"]
        assert r["finish"] == "length"
        assert r["text"]
    after = metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    generated = sum(r["usage"].completion_tokens for r in results)
    prompts = sum(r["usage"].prompt_tokens for r in results)
    assert delta("pagedllm:generation_tokens_total") == generated
    assert delta("pagedllm:prompt_tokens_total") == prompts
    assert delta("pagedllm:time_to_first_token_seconds_count") == num
    assert delta("pagedllm:e2e_request_latency_seconds_count") == num
    assert delta("pagedllm:inter_token_latency_seconds_count") == generated - num
    assert delta('pagedllm:request_success_total{"finished_reason": "length"}') == num
    assert delta("pagedllm:prefix_cache_queries_total") >= prompts
    assert after["pagedllm:kv_cache_usage_perc"] == 0
    assert after["pagedllm:num_requests_running"] == 0
    assert after["pagedllm:num_requests_waiting"] == 0
    # drained: only cached prefixes (of this and earlier tests on the shared server) stay resident
    assert after["pagedllm:kv_cache_resident_bytes"] < after["pagedllm:kv_cache_reserved_bytes"]


def test_metrics_are_exported(server, client, model_name):
    # the same 40-token prompt twice: the second finds its 2 full blocks (of 16) cached
    ids = list(range(1000, 1040))
    before = metrics(server)
    for _ in range(2):
        client.completions.create(model=model_name, prompt=ids, max_tokens=2, temperature=0)
    after = metrics(server)
    assert after["pagedllm:prefix_cache_queries_total"] - before["pagedllm:prefix_cache_queries_total"] >= 80
    assert after["pagedllm:prefix_cache_hits_total"] - before["pagedllm:prefix_cache_hits_total"] >= 32
    assert after["pagedllm:prompt_tokens_total"] - before["pagedllm:prompt_tokens_total"] == 80
    # the computed prompt tokens leave the cache hits out
    assert after["pagedllm:prompt_tokens_computed_total"] - before["pagedllm:prompt_tokens_computed_total"] <= 48
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "pagedllm:kv_cache_usage_perc", "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total",
        "pagedllm:num_preemptions_total", "pagedllm:num_requests_running", "pagedllm:num_requests_waiting",
        "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total",
        "pagedllm:time_to_first_token_seconds_bucket", "pagedllm:inter_token_latency_seconds_bucket",
        "pagedllm:e2e_request_latency_seconds_bucket",
    ):
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name
    assert after["pagedllm:num_kv_blocks"] == 256
    assert after["pagedllm:batch_invariant"] == 1  # ENGINE's --batch-invariant, which the exact comparisons rest on
    assert after["pagedllm:kv_cache_reserved_bytes"] >= after["pagedllm:kv_cache_resident_bytes"] > 0
    assert 0 <= after["pagedllm:kv_cache_usage_perc"] <= 1



def test_vllm_metric_names_follow_ours(server, client, model_name):
    """The names a Gateway API Inference Extension / llm-d router and vLLM dashboards read (docs/cluster.md):
    the same samples as ours in one scrape, and they move with a request."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, dict]:
        text = httpx.get(f"{server}/metrics").text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def pair(samples: dict, name: str) -> tuple[float, float]:
        key = f"vllm:{name}" + json.dumps({"model_name": model_name})
        return samples[key], samples[key.replace("vllm:", "pagedllm:", 1)]

    before = scrape()
    out = client.completions.create(model=model_name, prompt="Metrics for routers", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert wait_kv_free(server) == 0
    after = scrape()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_sum",
                 "e2e_request_latency_seconds_count"):
        vllm, ours = pair(after, name)
        assert vllm == ours, name
    tpot = "vllm:time_per_output_token_seconds_count" + json.dumps({"model_name": model_name})
    assert after[tpot] == pair(after, "inter_token_latency_seconds_count")[1]

    def delta(name: str) -> float:
        return pair(after, name)[0] - pair(before, name)[0]

    assert delta("prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("generation_tokens_total") == 3
    assert delta("time_to_first_token_seconds_count") == 1
    assert delta("e2e_request_latency_seconds_count") == 1
    assert delta("inter_token_latency_seconds_count") == 2
    assert pair(after, "kv_cache_usage_perc")[0] == 0
    length = "vllm:request_success_total" + json.dumps({"finished_reason": "length", "model_name": model_name},
                                                        sort_keys=True)
    assert after[length] - before.get(length, 0.0) == 1
    cache = [k for k in after if k.startswith("vllm:cache_config_info")]
    assert cache == ["vllm:cache_config_info" + json.dumps(
        {"block_size": "16", "model_name": model_name, "num_gpu_blocks": "256"}, sort_keys=True)]
    assert after["vllm:lora_requests_info" + json.dumps(
        {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}, sort_keys=True)] > 0


# --- the guarded server: API key, back-pressure, failures -------------------------------


def test_api_key_is_enforced_on_every_route_but_health_metrics_and_docs(guarded):
    url = guarded["url"]
    wrong = guarded_client(guarded, "wrong-key")
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=GUARDED_NAME, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=GUARDED_NAME, messages=CHAT_MESSAGES, max_tokens=2)
    # no key at all (the openai client insists on one, so raw HTTP); checked before the body is read
    err = assert_openai_error(httpx.post(f"{url}/v1/chat/completions", content=b"{bad json"), 401, "invalid_api_key")
    assert err["type"] == "invalid_request_error"
    assert_openai_error(httpx.get(f"{url}/v1/models"), 401, "invalid_api_key")
    assert_openai_error(httpx.get(f"{url}/v1/models", headers={"Authorization": API_KEY}), 401)
    ok = guarded_client(guarded)
    assert [m.id for m in ok.models.list().data] == [GUARDED_NAME]
    out = ok.completions.create(model=GUARDED_NAME, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
    # served name, not the file name
    with pytest.raises(openai.NotFoundError):
        ok.completions.create(model=os.path.basename(bundled_model_path()), prompt="Hi", max_tokens=2)
    # the tokenizer routes cost CPU, so they are guarded too; only probes and scrapers are open
    assert_openai_error(httpx.post(f"{url}/tokenize", json={"prompt": "Hi"}), 401, "invalid_api_key")
    assert_openai_error(httpx.post(f"{url}/detokenize", json={"tokens": [1]}), 401, "invalid_api_key")
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{url}/tokenize", json={"prompt": "Hi"}, headers=keyed).json()["count"] >= 1
    assert httpx.post(f"{url}/detokenize", json={"tokens": [1]}, headers=keyed).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    # the API's description and the Swagger page a browser opens (it cannot send the key)
    assert httpx.get(f"{url}/openapi.json").json()["info"]["title"] == "pagedllm"
    assert httpx.get(f"{url}/docs").status_code == 200
    assert httpx.get(f"{url}/docs/static/swagger-ui.css").status_code == 200
    assert_openai_error(httpx.get(f"{url}/docsx"), 401, "invalid_api_key")
    assert_openai_error(httpx.get(f"{url}/tokenizer_info"), 401, "invalid_api_key")


def open_stream(url: str, body: dict) -> tuple[httpx.Client, httpx.Response, Iterator[str]]:
    http = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
    resp = http.send(http.build_request("POST", f"{url}/v1/completions", json=body), stream=True)
    return http, resp, sse_events(resp.iter_lines())


def test_past_max_waiting_new_requests_get_429(guarded):
    url = guarded["url"]
    long = {"model": GUARDED_NAME, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    # A runs (max_num_seqs=1 on this server), so B and C wait: the limit of 2
    a = open_stream(url, long)
    next(a[2])
    waiting = [open_stream(url, {**long, "max_tokens": 3}) for _ in range(2)]
    assert all(w[1].status_code == 200 for w in waiting)
    c = guarded_client(guarded)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=GUARDED_NAME, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 429
    resp = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": CHAT_MESSAGES, "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    err = assert_openai_error(resp, 429)
    assert "waiting" in err["message"]
    assert int(resp.headers["retry-after"]) >= 1  # when to come back, for clients that honour it
    a[1].close()
    a[0].close()
    # once A is gone, the waiting ones run to the end
    for http, resp, events in waiting:
        rest = list(events)
        assert rest[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in rest[:-1])
        assert text
        resp.close()
        http.close()
    out = c.completions.create(model=GUARDED_NAME, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
    assert wait_kv_free(url) == 0


def test_a_failing_request_fails_alone(guarded):
    url = guarded["url"]
    c = guarded_client(guarded)
    # A streams first; P (poisoned) and G queue behind it (one sequence at a time here)
    a = open_stream(url, {"model": GUARDED_NAME, "prompt": "Count:", "max_tokens": 40, "ignore_eos": True,
                          "stream": True})
    next(a[2])
    results: dict[str, object] = {}

    def poisoned() -> None:
        try:
            c.completions.create(model=GUARDED_NAME, prompt=POISON + [100, 101], max_tokens=4)
        except openai.APIStatusError as e:
            results["p"] = e

    def good() -> None:
        results["g"] = c.completions.create(
            model=GUARDED_NAME, prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True}
        )

    tp = threading.Thread(target=poisoned)
    tp.start()
    time.sleep(0.3)  # P queues before G
    tg = threading.Thread(target=good)
    tg.start()
    rest = list(a[2])
    a[1].close()
    a[0].close()
    tp.join(60)
    tg.join(60)
    assert rest[-1] == "[DONE]" and not any('"error"' in e for e in rest)
    assert isinstance(results.get("p"), openai.InternalServerError)
    assert "injected fault" in results["p"].message
    assert results["g"].usage.completion_tokens == 5
    # streamed, the failure arrives as an error event, then [DONE]
    http, resp, events = open_stream(url, {"model": GUARDED_NAME, "prompt": POISON, "max_tokens": 4, "stream": True})
    got = list(events)
    resp.close()
    http.close()
    assert got[-1] == "[DONE]"
    assert json.loads(got[-2])["error"]["type"] == "server_error"
    assert httpx.get(f"{url}/health").status_code == 200
    assert wait_kv_free(url) == 0
    assert c.completions.create(model=GUARDED_NAME, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_a_step_failure_that_aborts_nothing_ends_the_newest_request_only(guarded):
    url = guarded["url"]
    c = guarded_client(guarded)
    a = open_stream(url, {"model": GUARDED_NAME, "prompt": "Count:", "max_tokens": 30, "ignore_eos": True,
                          "stream": True})
    next(a[2])
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=GUARDED_NAME, prompt=STALL + [100], max_tokens=4)
    assert "injected stall" in e.value.message
    rest = list(a[2])  # the older request was not taken down with it
    a[1].close()
    a[0].close()
    assert rest[-1] == "[DONE]" and not any('"error"' in e for e in rest)
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    assert wait_kv_free(url) == 0


# --- the serving benchmark ----------------------------------------------------------------


@pytest.mark.parametrize("rate", ["inf", "40"])
def test_bench_serve_against_the_server(server, capsys, rate):
    argv = ["bench", "serve", "--base-url", server, "--num-prompts", "6", "--input-len", "16",
            "--output-len", "5", "--max-concurrency", "3", "--request-rate", rate, "--json"]
    assert cli.main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["completed"] == 6
    assert res["failed"] == 0
    assert res["total_output_tokens"] == 30
    assert res["total_input_tokens"] == 96
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert res[key]["mean"] > 0
        assert res[key]["median"] <= res[key]["p99"]
    assert res["e2el_ms"]["mean"] >= res["ttft_ms"]["mean"]
    assert res["request_throughput"] > 0
    assert res["output_throughput"] == pytest.approx(30 / res["duration_s"])


def test_bench_serve_without_a_server_is_an_error(capsys):
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1"]
    assert cli.main(argv) == 2
    assert "no server answers" in capsys.readouterr().err


def test_serve_flags_are_checked_before_loading(capsys):
    assert cli.main(["serve", "--max-waiting", "0"]) == 2
    assert "max-waiting" in capsys.readouterr().err
    assert cli.main(["serve", "--max-request-bytes", "0"]) == 2
    assert "max-request-bytes" in capsys.readouterr().err
    assert cli.main(["serve", "--allowed-hosts", ","]) == 2
    assert "comma-separated" in capsys.readouterr().err


# --- last: the subprocess server never failed, and stops cleanly ---------------------------


def test_server_log_has_no_traceback_and_no_500(server_launch, server):
    _, proc, log = server_launch
    assert proc.poll() is None
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert " 500 " not in text


def test_sigterm_ends_open_streams_with_an_error_event(server_launch, server, model_name):
    _, proc, log = server_launch
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 900, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        resp = http.send(http.build_request("POST", f"{server}/v1/completions", json=body), stream=True)
        events = sse_events(resp.iter_lines())
        next(events)
        proc.terminate()
        rest = list(events)  # ends: the server does not leave the stream hanging
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])["error"]
    assert err["code"] == "engine_unavailable"
    assert "shutting down" in err["message"]
    proc.wait(30)
    text = log.read_text()
    assert "Application shutdown complete" in text
    assert "Traceback" not in text, text[-3000:]
