"""A vLLM command line and an OpenAI client run unchanged against ``pagedllm serve`` (docs/coming-from-vllm.md).

The model is the tiny Qwen3 of tests/tool_models.py saved *without* a chat
template; the server gets one with ``--chat-template FILE``, two names with
``--served-model-name``, and vLLM's tool flags. Expected prompt sizes come from
transformers rendering the same template, never from the server.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from server_helpers import assert_openai_error, serve_in_thread, served, wait_kv_free
from tool_models import TOOL_CHAT_TEMPLATE

pytestmark = pytest.mark.slow  # a real server in a subprocess: outside the fast tier

# Qwen3's switch: with enable_thinking false the template opens and closes an empty thinking block
TEMPLATE = TOOL_CHAT_TEMPLATE + (
    "{%- if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
NAME, ALIAS = "tiny-chat", "org/tiny-chat"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def bare_model(tiny_tool_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny tool model's folder with its chat template removed (as many base checkpoints ship)."""
    path = tmp_path_factory.mktemp("tiny-no-template")
    shutil.copytree(tiny_tool_model_dir, path, dirs_exist_ok=True)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def server(bare_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    log_dir = tmp_path_factory.mktemp("vllm-compat-server")
    template = log_dir / "template.jinja"
    template.write_text(TEMPLATE)
    args = [bare_model, "--chat-template", str(template), "--served-model-name", NAME, ALIAS,
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--num-kv-blocks", "64", "--max-model-len", "512", "--num-threads", "1"]
    for url in served(args, log_dir):
        yield {"url": url, "client": OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)}


def _prompt_tokens(tokenizer, **template_kwargs: object) -> int:  # noqa: ANN001
    text = tokenizer.apply_chat_template(ASK, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False,
                                         **template_kwargs)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_a_model_without_a_template_chats_with_the_given_one(server: dict, smollm_tokenizer) -> None:  # noqa: ANN001
    client = server["client"]
    out = client.chat.completions.create(model=ALIAS, messages=ASK, max_tokens=2, temperature=0)
    assert out.model == NAME  # replies carry the first name, as vLLM's
    assert out.usage.prompt_tokens == _prompt_tokens(smollm_tokenizer)
    # chat_template_kwargs reach the template: Qwen3's enable_thinking
    off = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=2, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == _prompt_tokens(smollm_tokenizer, enable_thinking=False)
    assert off.usage.prompt_tokens > out.usage.prompt_tokens
    # and /tokenize renders the same
    tok = httpx.post(f"{server['url']}/tokenize", json={"model": ALIAS, "messages": ASK,
                                                        "chat_template_kwargs": {"enable_thinking": False}}, timeout=30)
    assert tok.json()["count"] == off.usage.prompt_tokens
    # list-of-parts content: text parts joined by newlines, as the same text given whole
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                          {"type": "text", "text": "in Paris?"}]}]
    whole = [{"role": "user", "content": "What is the weather\nin Paris?"}]
    a = client.chat.completions.create(model=NAME, messages=parts, max_tokens=3, temperature=0)
    b = client.chat.completions.create(model=NAME, messages=whole, max_tokens=3, temperature=0)
    assert (a.usage.prompt_tokens, a.choices[0].message.content) == (b.usage.prompt_tokens, b.choices[0].message.content)


def test_served_names_and_404(server: dict) -> None:
    client = server["client"]
    assert [m.id for m in client.models.list().data] == [NAME, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="someone-else", messages=ASK, max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("someone-else")


def test_auto_tool_choice_reads_hermes_calls(server: dict) -> None:
    out = server["client"].chat.completions.create(
        model=NAME, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=96,
        extra_body={"structured_outputs": {"regex": CALL}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_routine_request_fields_are_accepted(server: dict) -> None:
    client = server["client"]
    out = client.chat.completions.create(
        model=NAME, messages=ASK, max_tokens=2, store=False, metadata={"user_tier": "free"}, service_tier="auto",
        reasoning_effort="low", extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert out.service_tier == "default"  # the one tier a local server has
    assert out.choices[0].finish_reason == "length"
    plain = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=2)
    assert plain.service_tier is None  # not asked, not said


@pytest.mark.parametrize("body, param, words", [
    ({"store": True}, "store", "keeps no completion"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"service_tier": "platinum"}, "service_tier", "service_tier"),
    ({"chat_template_kwargs": {"messages": []}}, "messages", "may not set messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
     "messages", "takes no images"),
])
def test_refused_fields_are_openai_400s(server: dict, body: dict, param: str, words: str) -> None:
    resp = httpx.post(f"{server['url']}/v1/chat/completions", json={"model": NAME, "messages": ASK,
                                                                    "max_tokens": 1, **body}, timeout=60)
    err = assert_openai_error(resp, 400)
    assert words in err["message"]
    assert param in (err["param"] or "") or param in err["message"]
    assert wait_kv_free(server["url"]) == 0.0


def test_no_template_and_no_auto_tool_choice_are_400s_that_say_what_to_pass(bare_model: str) -> None:
    from pagedllm import LLM

    llm = LLM(bare_model, num_kv_blocks=16, max_model_len=256, num_threads=1)
    with serve_in_thread(llm.llm_engine, model_name="bare", enable_auto_tool_choice=False) as url:
        resp = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 1}, timeout=60)
        err = assert_openai_error(resp, 400, "no_chat_template")
        assert "--chat-template" in err["message"]
        text = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=60)
        assert text.status_code == 200
    with serve_in_thread(llm.llm_engine, model_name="bare", enable_auto_tool_choice=False,
                         chat_template=TEMPLATE) as url:
        resp = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 1},
                          timeout=60)
        assert "--enable-auto-tool-choice" in assert_openai_error(resp, 400)["message"]
        forced = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 1,
                                                                "tool_choice": "none"}, timeout=60)
        assert forced.status_code == 200


def test_tokenizer_info_shows_the_given_template(server: dict) -> None:
    # the template in use is the file's text, as vLLM shows the --chat-template it loaded
    info = httpx.get(f"{server['url']}/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == TEMPLATE
