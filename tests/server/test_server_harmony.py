"""gpt-oss's harmony format on /v1/chat/completions (the official openai client) and /v1/messages (anthropic's).

The server runs a tiny random Llama with the o200k_harmony vocabulary and a
harmony chat template (``tests/harmony_models.py``), so it picks the
``gpt_oss`` reasoning parser and openai-harmony's renderer on its own. A
random model never writes harmony by itself: each request gives a regex
(the exact text of the reply) and a ``logit_bias`` of -100 on every ordinary
token with a ``<`` in it, so that where the regex reaches ``<|channel|>`` the
only token left that spells it is harmony's special one (not ``<|`` written
out), and of +100 on the stop token the test wants (``<|return|>`` or
``<|call|>``). The expected reasoning, content
and call are the literal pieces of the regex, not the server's output. The
Messages API has no field for a regex or a bias: its tests give them to the
engine's ``add_request`` for the one request (``_forcing_engine``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from server_helpers import serve_in_thread, wait_kv_free

pytestmark = pytest.mark.slow  # a real server: outside the fast tier

RETURN, CALL = 200002, 200012
NUM_RANKS = 199998  # o200k_base's ordinary tokens; the special ones follow
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "The user asks about the weather."
ANSWER = "It is sunny in Paris."
CALL_THOUGHT = "I should call get_weather."
ARGUMENTS = '{"city": "Paris"}'
# what gpt-oss writes after "<|start|>assistant": analysis, then the final answer or a call
FINAL_REGEX = (r"<\|channel\|>analysis<\|message\|>The user asks about the weather\.<\|end\|>"
               r"<\|start\|>assistant<\|channel\|>final<\|message\|>It is sunny in Paris\.")
CALL_REGEX = (r"<\|channel\|>analysis<\|message\|>I should call get_weather\.<\|end\|>"
              r"<\|start\|>assistant<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json"
              r'<\|message\|>\{"city": "Paris"\}')


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny harmony model's folder, and its ordinary tokens with a ``<`` in them."""
    from harmony_models import save_tiny_harmony_model
    from transformers import AutoTokenizer

    path = save_tiny_harmony_model(Path(tmp_path_factory.mktemp("tiny-harmony")))
    vocab = AutoTokenizer.from_pretrained(path).get_vocab()
    return {"path": path, "angled": sorted(i for token, i in vocab.items() if "<" in token and i < NUM_RANKS)}


@pytest.fixture(scope="module")
def harmony_server(harmony_dir: dict) -> Iterator[dict]:
    from pagedllm import LLM

    llm = LLM(harmony_dir["path"], num_kv_blocks=64, max_model_len=1024, num_threads=1)
    with serve_in_thread(llm.llm_engine, model_name="tiny-harmony") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
        yield {"url": url, "client": client, "angled": harmony_dir["angled"], "engine": llm.llm_engine}


def _forced(server: dict, regex: str, stop: int) -> dict:
    """Request fields that make the random model write ``regex`` in harmony's tokens, then ``stop``."""
    bias = {**{str(t): -100 for t in server["angled"]}, str(stop): 100}
    return {"temperature": 0, "max_tokens": 80, "logit_bias": bias, "extra_body": {"structured_outputs": {"regex": regex}}}


def _stream(client: OpenAI, **kwargs) -> dict:  # noqa: ANN003
    """A streamed reply put back together as a client does: reasoning, content, calls by index."""
    reasoning, content, calls, finish = [], [], {}, None
    for chunk in client.chat.completions.create(model="tiny-harmony", stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            piece = (delta.model_extra or {}).get("reasoning_content")
            if piece:
                reasoning.append(piece)
            if delta.content:
                content.append(delta.content)
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls, "a call's name is sent once"
                    calls[call.index] = [call.id, call.function.name, ""]
                calls[call.index][2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"reasoning": "".join(reasoning), "content": "".join(content), "calls": calls, "finish": finish}


def test_analysis_and_final(harmony_server) -> None:  # noqa: ANN001
    client = harmony_server["client"]
    out = client.chat.completions.create(
        model="tiny-harmony", messages=ASK, reasoning_effort="low", **_forced(harmony_server, FINAL_REGEX, RETURN)
    )
    message = out.choices[0].message
    assert message.reasoning_content == THOUGHT  # the openai client reads it (an extra field)
    assert message.content == ANSWER
    assert not message.tool_calls
    assert out.choices[0].finish_reason == "stop"
    streamed = _stream(client, messages=ASK, **_forced(harmony_server, FINAL_REGEX, RETURN))
    assert streamed == {"reasoning": THOUGHT, "content": ANSWER, "calls": {}, "finish": "stop"}
    assert wait_kv_free(harmony_server["url"]) == 0.0


def test_analysis_and_tool_call(harmony_server) -> None:  # noqa: ANN001
    client = harmony_server["client"]
    kwargs = {"messages": ASK, "tools": [WEATHER], "reasoning_effort": "high", **_forced(harmony_server, CALL_REGEX, CALL)}
    out = client.chat.completions.create(model="tiny-harmony", **kwargs)
    choice = out.choices[0]
    assert choice.message.reasoning_content == CALL_THOUGHT
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.function.arguments == ARGUMENTS
    assert choice.finish_reason == "tool_calls"
    streamed = _stream(client, **kwargs)
    assert streamed["reasoning"] == CALL_THOUGHT and streamed["content"] == ""
    assert [(name, args) for _, name, args in streamed["calls"].values()] == [("get_weather", ARGUMENTS)]
    assert streamed["finish"] == "tool_calls"
    # the round trip: the call and its result go back, rendered by openai-harmony
    follow = [*ASK, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    again = client.chat.completions.create(model="tiny-harmony", messages=follow, tools=[WEATHER],
                                           **_forced(harmony_server, FINAL_REGEX, RETURN))
    assert again.choices[0].message.content == ANSWER
    assert wait_kv_free(harmony_server["url"]) == 0.0


def test_harmony_refusals(harmony_server) -> None:  # noqa: ANN001
    import openai

    client = harmony_server["client"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-harmony", messages=ASK, tools=[WEATHER], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-harmony", messages=ASK, reasoning_effort="extreme")


def test_a_non_harmony_reasoning_parser_is_refused_at_start(harmony_server) -> None:  # noqa: ANN001
    """qwen3's ``<think>`` markers never occur in harmony's channels: the server refuses to start with it, naming
    the parser that reads the format, rather than serve replies it cannot split (or a budget that never fires)."""
    from pagedllm.entrypoints.openai.api_server import ServerSettings, create_server_app

    with pytest.raises(ValueError, match="gpt_oss reasoning parser reads, not the qwen3 one"):
        create_server_app(harmony_server["engine"], ServerSettings(port=1, model_name="tiny-harmony", reasoning_parser="qwen3"))


@pytest.fixture(scope="module")
def harmony_llm(harmony_dir: dict):  # noqa: ANN201
    """One offline engine of the tiny harmony model for the ``LLM.chat`` tests (each request finishes in its
    ``chat`` call, so one test's requests leave nothing behind for the next)."""
    from pagedllm import LLM

    return LLM(harmony_dir["path"], num_kv_blocks=32, max_model_len=512, num_threads=1)


def test_llm_chat_renders_harmony_and_parses(harmony_dir: dict, harmony_llm) -> None:  # noqa: ANN001
    """``LLM.chat`` renders with openai-harmony and stops at <|call|>; ``parse_reply`` reads the output."""
    from pagedllm import SamplingParams, StructuredOutputsParams
    from pagedllm.entrypoints.openai.reasoning_parsers import parse_reply
    from pagedllm.harmony.prompt import render_prompt

    llm = harmony_llm
    bias = {**{t: -100.0 for t in harmony_dir["angled"]}, CALL: 100.0}
    params = SamplingParams(temperature=0.0, max_tokens=80, logit_bias=bias,
                            structured_outputs=StructuredOutputsParams(regex=CALL_REGEX))
    (out,) = llm.chat(ASK, params, use_tqdm=False, tools=[WEATHER], reasoning_effort="low")
    assert out.prompt_token_ids == render_prompt(ASK, [WEATHER], "low")
    assert out.outputs[0].token_ids[-1] == CALL and out.outputs[0].finish_reason == "stop"
    found = parse_reply(out.outputs[0].token_ids)
    assert found.reasoning_content == CALL_THOUGHT and found.content is None
    assert [(c.name, c.arguments) for c in found.tool_calls] == [("get_weather", ARGUMENTS)]
    with pytest.raises(ValueError, match="reasoning_effort"):
        llm.chat(ASK, params, use_tqdm=False, reasoning_effort="max")


@contextlib.contextmanager
def _forcing_engine(server: dict, regex: str, stop: int) -> Iterator[None]:
    """Every request the engine takes meanwhile writes ``regex`` then ``stop`` (as ``_forced``'s fields)."""
    from pagedllm import StructuredOutputsParams

    engine = server["engine"]
    add_request = engine.add_request
    bias = {**{t: -100.0 for t in server["angled"]}, stop: 100.0}

    def forced(request_id, prompt, params):  # noqa: ANN001, ANN202
        params.structured_outputs = StructuredOutputsParams(regex=regex)
        params.logit_bias = bias
        params.temperature = 0.0
        return add_request(request_id, prompt, params)

    engine.add_request = forced
    try:
        yield
    finally:
        del engine.add_request  # the method again


def _anthropic(server: dict):  # noqa: ANN202
    import anthropic

    return anthropic.Anthropic(base_url=server["url"], api_key="x", max_retries=0, timeout=300)


ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}


def test_messages_analysis_is_thinking_and_final_is_text(harmony_server) -> None:  # noqa: ANN001
    """Harmony's ``analysis`` channel comes back as a thinking block, ``final`` as text, whole and streamed."""
    client = _anthropic(harmony_server)
    kwargs = {"model": "tiny-harmony", "max_tokens": 80, "system": ASK[0]["content"], "messages": ASK[1:]}
    with _forcing_engine(harmony_server, FINAL_REGEX, RETURN):
        out = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in out.content] == [
        ("thinking", THOUGHT), ("text", ANSWER)]
    assert out.stop_reason == "end_turn"
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [
        ("thinking", THOUGHT), ("text", ANSWER)]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == THOUGHT
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    # count_tokens is openai-harmony's rendering of the same conversation
    from pagedllm.harmony.prompt import render_prompt

    counted = client.messages.count_tokens(model="tiny-harmony", system=ASK[0]["content"], messages=ASK[1:])
    assert counted.input_tokens == len(render_prompt(ASK, None, None))
    assert wait_kv_free(harmony_server["url"]) == 0.0


def test_messages_commentary_call_is_tool_use_and_the_result_round_trip(harmony_server) -> None:  # noqa: ANN001
    client = _anthropic(harmony_server)
    kwargs = {"model": "tiny-harmony", "max_tokens": 80, "system": ASK[0]["content"], "messages": ASK[1:],
              "tools": [ANTHROPIC_WEATHER]}
    with _forcing_engine(harmony_server, CALL_REGEX, CALL):
        out = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
    thinking, call = out.content
    assert (thinking.type, thinking.thinking) == ("thinking", CALL_THOUGHT)
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", json.loads(ARGUMENTS))
    assert out.stop_reason == "tool_use" and final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[1].input == call.input
    pieces = "".join(e.delta.partial_json for e in events
                     if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(pieces) == json.loads(ARGUMENTS)
    # the call and its result go back; openai-harmony renders them as the chat route's messages would be
    history = [*ASK[1:], {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    with _forcing_engine(harmony_server, FINAL_REGEX, RETURN):
        again = client.messages.create(**{**kwargs, "messages": history})
    assert [b.type for b in again.content] == ["thinking", "text"] and again.content[1].text == ANSWER
    from pagedllm.harmony.prompt import render_prompt

    chat_history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    counted = client.messages.count_tokens(model="tiny-harmony", system=ASK[0]["content"], messages=history,
                                           tools=[ANTHROPIC_WEATHER])
    assert counted.input_tokens == len(render_prompt(chat_history, [WEATHER], None))
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        client.messages.create(**kwargs, tool_choice={"type": "any"})
    assert wait_kv_free(harmony_server["url"]) == 0.0


# a thinking budget on the analysis channel: the random model is kept off every harmony special token and every
# ordinary token with a "<" (so it can neither end its analysis nor spell a marker), and the budget ends it
BUDGET = 5
CLOSE_TO_FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"


def _no_markers(angled: list[int]) -> dict[int, float]:
    from harmony_models import VOCAB_SIZE

    return {t: -100.0 for t in [*angled, *range(NUM_RANKS, VOCAB_SIZE)]}


def _harmony_ids(text: str) -> list[int]:
    from pagedllm.harmony.vocab import harmony_encoding

    return harmony_encoding().encode(text, allowed_special="all")


@pytest.fixture(scope="module")
def budget_reference(harmony_dir: dict, harmony_llm) -> dict:  # noqa: ANN001
    """``LLM.chat``'s greedy outputs of ASK with budgets 5 and 0 (and without), for the server tests to match."""
    from pagedllm import SamplingParams

    llm = harmony_llm
    llm.reset_prefix_cache()  # computed whole, as by a fresh engine: no prefix of an earlier test's prompts
    bias = _no_markers(harmony_dir["angled"])
    outs = {}
    for budget in (BUDGET, 0, None):
        params = SamplingParams(temperature=0.0, max_tokens=BUDGET + 10, logit_bias=bias,
                                thinking_token_budget=budget)
        (outs[budget],) = llm.chat(ASK, params, use_tqdm=False)
        assert params.think_start_str == "<think>"  # the caller's params are left as they were
    outs["llm"] = llm
    return outs


def test_llm_chat_thinking_budget_ends_the_analysis(budget_reference: dict) -> None:
    """With a budget of N the prompt opens the analysis message, N tokens of it follow, then harmony's tokens
    that end it and open the final channel (openai-harmony's ids), then the answer; ``parse_reply`` agrees."""
    from pagedllm import SamplingParams, StructuredOutputsParams
    from pagedllm.entrypoints.openai.reasoning_parsers import parse_reply
    from pagedllm.harmony.prompt import render_prompt
    from pagedllm.harmony.vocab import harmony_encoding

    forced = _harmony_ids(CLOSE_TO_FINAL)
    assert len(forced) == 6
    for budget in (BUDGET, 0):
        out = budget_reference[budget]
        assert out.prompt_token_ids == render_prompt(ASK) + _harmony_ids("<|channel|>analysis<|message|>")
        ids = list(out.outputs[0].token_ids)
        assert len(ids) == BUDGET + 10
        assert all(t < NUM_RANKS for t in ids[:budget])  # the analysis: ordinary tokens only
        assert ids[budget : budget + 6] == forced
        assert all(t < NUM_RANKS for t in ids[budget + 6 :])  # the final answer
        found = parse_reply(ids, prompt_text=out.prompt)
        assert found.reasoning_content == (harmony_encoding().decode(ids[:budget]) or None)
        assert found.content == harmony_encoding().decode(ids[budget + 6 :])
    # without a budget the prompt stops at <|start|>assistant and nothing is forced (no special token)
    free = budget_reference[None]
    assert free.prompt_token_ids == render_prompt(ASK)
    assert all(t < NUM_RANKS for t in free.outputs[0].token_ids)
    with pytest.raises(ValueError, match="structured outputs"):
        budget_reference["llm"].chat(ASK, SamplingParams(thinking_token_budget=2, structured_outputs=
                                                         StructuredOutputsParams(regex="a")), use_tqdm=False)


def test_chat_thinking_token_budget_on_harmony(harmony_server, budget_reference: dict) -> None:  # noqa: ANN001
    """``thinking_token_budget`` through the openai client: the reply's tokens (logprobs, as bytes) are
    ``LLM.chat``'s, with the forced ones at N; the analysis is the reasoning, the rest the content."""
    import openai

    from pagedllm.harmony.vocab import harmony_encoding

    client = harmony_server["client"]
    bias = {str(t): b for t, b in _no_markers(harmony_server["angled"]).items()}
    kwargs = {"messages": ASK, "temperature": 0, "max_tokens": BUDGET + 10, "logit_bias": bias,
              "extra_body": {"thinking_token_budget": BUDGET}}
    out = client.chat.completions.create(model="tiny-harmony", **kwargs, logprobs=True)
    ids = list(budget_reference[BUDGET].outputs[0].token_ids)
    encoding = harmony_encoding()
    # each token's text (whole characters here: the greedy reply repeats one ordinary token)
    assert [bytes(p.bytes) for p in out.choices[0].logprobs.content] == [encoding.decode([t]).encode() for t in ids]
    assert [p.token for p in out.choices[0].logprobs.content[BUDGET : BUDGET + 6]] == [
        "<|end|>", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>"]
    message = out.choices[0].message
    assert message.reasoning_content == encoding.decode(ids[:BUDGET])
    assert message.content == encoding.decode(ids[BUDGET + 6 :])
    assert out.usage.prompt_tokens == len(budget_reference[BUDGET].prompt_token_ids)
    streamed = _stream(client, **kwargs)
    assert (streamed["reasoning"], streamed["content"]) == (message.reasoning_content, message.content)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-harmony", **{**kwargs, "extra_body": {"thinking_token_budget": 2,
                                                                   "structured_outputs": {"regex": "a"}}})
    assert e.value.body["param"] == "thinking_token_budget"
    assert wait_kv_free(harmony_server["url"]) == 0.0


@contextlib.contextmanager
def _biased_engine(server: dict, bias: dict[int, float]) -> Iterator[None]:
    """Every request the engine takes meanwhile is greedy with ``bias`` (the Messages API has no such fields)."""
    engine = server["engine"]
    add_request = engine.add_request

    def biased(request_id, prompt, params):  # noqa: ANN001, ANN202
        params.logit_bias = bias
        params.temperature = 0.0
        return add_request(request_id, prompt, params)

    engine.add_request = biased
    try:
        yield
    finally:
        del engine.add_request


def test_messages_budget_tokens_on_harmony(harmony_server, budget_reference: dict) -> None:  # noqa: ANN001
    """``thinking.budget_tokens`` through the anthropic client: the thinking block is the N analysis tokens of
    ``LLM.chat``'s output, the text block what follows the forced final header, whole and streamed."""
    from pagedllm.harmony.vocab import harmony_encoding

    client = _anthropic(harmony_server)
    ids = list(budget_reference[BUDGET].outputs[0].token_ids)
    encoding = harmony_encoding()
    kwargs = {"model": "tiny-harmony", "max_tokens": BUDGET + 10, "system": ASK[0]["content"], "messages": ASK[1:],
              "thinking": {"type": "enabled", "budget_tokens": BUDGET}}
    with _biased_engine(harmony_server, _no_markers(harmony_server["angled"])):
        out = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
    expected = [("thinking", encoding.decode(ids[:BUDGET])), ("text", encoding.decode(ids[BUDGET + 6 :]))]
    for reply in (out, final):
        assert [(b.type, getattr(b, "thinking", None) or b.text) for b in reply.content] == expected
        assert reply.usage.output_tokens == len(ids) and reply.stop_reason == "max_tokens"
    counted = client.messages.count_tokens(model="tiny-harmony", system=ASK[0]["content"], messages=ASK[1:],
                                           thinking={"type": "enabled", "budget_tokens": BUDGET})
    assert counted.input_tokens == len(budget_reference[BUDGET].prompt_token_ids)
    assert wait_kv_free(harmony_server["url"]) == 0.0
