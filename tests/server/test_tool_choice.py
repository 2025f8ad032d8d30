"""tool_choice and tool messages: request checks, the grammar that forces calls, and chat templates with tools.

The forced calls are sampled from the bundled model at temperature 1.0 with
the constraint ``ToolSpec`` builds, and checked by ``jsonschema`` against the
function's own parameters, never by xgrammar. The rendering tests use a tiny
Qwen3 whose chat template lists tools (tests/tool_models.py).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.tool_choice import FunctionTool, ToolRequestError, ToolSpec
from pagedllm.entrypoints.openai.tool_messages import (
    ToolMessageError,
    template_supports_tools,
    to_template_messages,
)
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, assemble_deltas
from pagedllm.loader.tokenizer import Tokenizer

NUM_SEEDS = 10
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
        "strict": True,
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100}, "b": {"$ref": "#/$defs/digit"}},
            "required": ["a", "b"],
            "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
        },
    },
}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, ADD, NO_ARGS]
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {},
                                                                       "additionalProperties": False})
              for t in TOOLS}
HISTORY = [
    {"role": "system", "content": "You help with the weather."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
]


def _fn(name: str, **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


# --- request checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(("tools", "choice", "parallel", "param", "match"), [
    (None, "required", None, "tool_choice", "'required' needs tools"),
    (None, {"type": "function", "function": {"name": "add"}}, None, "tool_choice", "not in tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice",
     "'nope', which is not in tools.*'get_weather', 'add', 'now'"),
    (TOOLS, "sometimes", None, "tool_choice", "one of none, auto, required"),
    (TOOLS, {"type": "function"}, None, "tool_choice", "must be a string or"),
    (TOOLS, {"type": "function", "function": {"name": 3}}, None, "tool_choice", "tool_choice.function"),
    ([ADD, ADD], "auto", None, "tools", "two functions named 'add'"),
    ([{"type": "code_interpreter"}], "auto", None, "tools", r"tools\[0\].type must be 'function'"),
    ([_fn("get weather")], "auto", None, "tools", "letters, digits"),
    ([{"type": "function", "function": {}}], "auto", None, "tools", "function.name"),
    ([_fn("f", parameter={})], "auto", None, "tools", "unknown field.*'parameter'"),
    ([_fn("f", description=3)], "auto", None, "tools", "description must be a string"),
    ([_fn("f", parameters=[1])], "auto", None, "tools", "must be a JSON schema"),
    ([_fn("f", parameters={"type": "string"})], "auto", None, "tools", "must describe an object"),
    ([ADD, _fn("f", parameters={"type": "object", "properties": {"a": 5}})], "auto", None, "tools",
     r"tools\[1\].function.parameters is not a valid JSON schema: Schema should be an object or bool"),
    ([_fn("f", parameters={"properties": {"a": {"type": "string", "pattern": "[a-z"}}})], "none", None, "tools",
     "Unclosed"),
    ("add", "auto", None, "tools", "must be a list"),
    (TOOLS, "auto", "yes", "parallel_tool_calls", "must be a boolean"),
])
def test_invalid_tool_fields_are_refused_naming_the_field(tools, choice, parallel, param, match):
    with pytest.raises(ToolRequestError, match=match) as e:
        ToolSpec.from_request(tools, choice, parallel)
    assert e.value.param == param
    assert isinstance(e.value, ValueError)


def test_defaults_and_what_goes_to_the_template():
    assert ToolSpec.from_request(None, None).tool_choice == "none"
    assert ToolSpec.from_request(None, "auto").tool_choice == "none"  # nothing to call
    assert ToolSpec.from_request([], None).template_tools() is None
    spec = ToolSpec.from_request(TOOLS, None)
    assert (spec.tool_choice, spec.parallel_tool_calls, spec.parses_calls) == ("auto", True, True)
    assert spec.structured_outputs() is None
    template_tools = spec.template_tools()
    assert template_tools[0] == {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather of a city",
        "parameters": WEATHER["function"]["parameters"]}}  # no 'strict': not for the model
    assert template_tools[2] == {"type": "function", "function": {"name": "now"}}
    none = ToolSpec.from_request(TOOLS, "none")
    assert not none.parses_calls and none.template_tools() == template_tools  # as vLLM: still shown
    assert ToolSpec.from_request(TOOLS, "none", False).parallel_tool_calls is False


def test_the_forcing_schemas_accept_calls_and_nothing_else():
    named = ToolSpec.from_request(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named.tool_choice == "function" and named.function_name == "add"
    assert named.constraint_schema() == ADD["function"]["parameters"]
    assert FunctionTool("now").arguments_schema() == {"type": "object", "properties": {}}
    so = named.structured_outputs()
    assert so.json == ADD["function"]["parameters"] and so.disable_any_whitespace

    good = [{"name": "add", "parameters": {"a": -3, "b": 7}}, {"name": "now", "parameters": {}},
            {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}]
    bad = [
        [],
        [{"name": "sub", "parameters": {"a": 1, "b": 1}}],
        [{"name": "add", "parameters": {"a": 1, "b": 10}}],  # b through the $ref: 0..9
        [{"name": "add", "parameters": {"a": 1}}],
        [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "kelvin"}}],
        [{"name": "add"}],
    ]
    required = ToolSpec.from_request(TOOLS, "required").constraint_schema()
    jsonschema.validate(good, required)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, required)
    single = ToolSpec.from_request(TOOLS, "required", False).constraint_schema()
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[:2], single)


def test_references_move_with_their_schema_and_data_stays_data():
    params = {
        "type": "object",
        "properties": {"enum": {"$ref": "#/$defs/e"}, "self": {"$ref": "#"}, "c": {"const": {"$ref": "#/x"}}},
        "$defs": {"e": {"enum": ["x", "y"]}},
    }
    spec = ToolSpec.from_request([ADD, _fn("g", parameters=params)], "required")
    moved = spec.constraint_schema()["$defs"]["tool_1"]
    assert moved["properties"]["enum"] == {"$ref": "#/$defs/tool_1/$defs/e"}
    assert moved["properties"]["self"] == {"$ref": "#/$defs/tool_1"}
    assert moved["properties"]["c"] == {"const": {"$ref": "#/x"}}
    assert spec.constraint_schema()["$defs"]["tool_0"]["properties"]["b"] == {"$ref": "#/$defs/tool_0/$defs/digit"}


def test_auto_and_none_read_the_text_and_the_finish_reason_follows():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    auto = ToolSpec.from_request(TOOLS, "auto")
    result = auto.extract(text, HermesToolParser)
    assert result.content == "Checking.\n"
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert auto.finish_reason("stop", result.tools_called) == "tool_calls"
    assert auto.finish_reason("length", True) == "length"
    assert auto.finish_reason("stop", False) == "stop"
    none = ToolSpec.from_request(TOOLS, "none")
    assert none.extract(text, HermesToolParser).content == text and none.new_parser(HermesToolParser) is None
    named = ToolSpec.from_request(TOOLS, {"type": "function", "function": {"name": "now"}})
    assert named.finish_reason("stop", True) == "stop"  # a forced call finishes with stop, as OpenAI's
    assert ToolSpec.from_request(TOOLS, "required").finish_reason("stop", True) == "tool_calls"
    single = ToolSpec.from_request(TOOLS, "auto", False)
    assert len(single.extract(text + "\n" + text[text.index("<"):], HermesToolParser).tool_calls) == 1


# --- forced calls sampled from the bundled model ------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def prompt(llm) -> str:
    messages = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
    return llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture(autouse=True)
def pool_is_whole_after_each_test(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").llm_engine
        assert not engine.requests
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _sample(llm: LLM, prompt: str, spec: ToolSpec, n: int = NUM_SEEDS) -> list:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=96, structured_outputs=spec.structured_outputs())
              for i in range(n)]
    return [out.outputs[0] for out in llm.generate([prompt] * n, params, use_tqdm=False)]


def _check_stream(spec: ToolSpec, text: str, expected: list[tuple[str, str]], rng: random.Random) -> None:
    """The same output streamed in random pieces gives the same calls."""
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
    bounds = [0, *cuts, len(text)]
    parser = spec.new_parser(HermesToolParser)
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    assert [(c.name, c.arguments) for c in assemble_deltas(deltas).tool_calls] == expected


@pytest.mark.parametrize("parallel", [pytest.param(True, marks=pytest.mark.slow), False])  # True: `make test`
def test_required_always_gives_calls_that_follow_their_schemas(llm, prompt, parallel):
    """Every output holds calls; with parallel calls the model may go on calling past max_tokens.

    Then (``length``) every call but the last is whole and valid, and the
    finish reason stays ``length``.
    """
    spec = ToolSpec.from_request(TOOLS, "required", parallel)
    rng = random.Random(0)
    counts, reasons = [], []
    for c in _sample(llm, prompt, spec):
        reasons.append(c.finish_reason)
        result = spec.extract(c.text, HermesToolParser)
        assert result.tools_called and result.content is None
        whole = result.tool_calls if c.finish_reason == "stop" else result.tool_calls[:-1]
        assert whole or c.finish_reason == "stop", c.text
        counts.append(len(result.tool_calls))
        for call in whole:
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
        expected = "tool_calls" if c.finish_reason == "stop" else "length"
        assert spec.finish_reason(c.finish_reason, result.tools_called) == expected
        _check_stream(spec, c.text, [(t.name, t.arguments) for t in result.tool_calls], rng)
    if not parallel:
        assert set(counts) == {1} and set(reasons) == {"stop"}
    assert reasons.count("stop") >= NUM_SEEDS // 2, reasons


def test_a_named_function_always_gives_one_valid_call_to_it(llm, prompt):
    spec = ToolSpec.from_request(TOOLS, {"type": "function", "function": {"name": "add"}})
    rng = random.Random(1)
    outputs = _sample(llm, prompt, spec)
    for c in outputs:
        assert c.finish_reason == "stop", c.text
        result = spec.extract(c.text, HermesToolParser)
        assert [call.name for call in result.tool_calls] == ["add"]
        jsonschema.validate(json.loads(result.tool_calls[0].arguments), ADD["function"]["parameters"])
        _check_stream(spec, c.text, [("add", c.text)], rng)
    assert len({c.text for c in outputs}) > 1  # sampled, not decided by the mask alone


# --- messages and templates ---------------------------------------------------------------------


def test_messages_with_calls_and_results_become_template_messages():
    out = to_template_messages(HISTORY)
    assert out[0] == {"role": "system", "content": "You help with the weather."}
    assert out[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
    ]}
    assert out[3] == {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C, sunny"}
    assert out[4]["content"] == "12:00" and out[4]["name"] == "now"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"}]
    assert to_template_messages(parts) == [{"role": "user", "content": "a\nb", "name": "u"}]


def _with(i: int, **fields) -> list[dict]:
    messages = [dict(m) for m in HISTORY]
    messages[i] = {k: v for k, v in {**messages[i], **fields}.items() if v is not ...}
    return messages


@pytest.mark.parametrize(("messages", "match"), [
    ([], "non-empty list"),
    (_with(3, tool_call_id="call_9"), r"messages\[3\].*no call has the id 'call_9'"),
    (_with(3, tool_call_id=...), r"messages\[3\].tool_call_id must be"),
    (_with(3, content=...), r"missing required parameter: 'messages\[3\].content'"),
    (_with(2, tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]),
     r"messages\[2\].tool_calls\[0\].function.arguments is not valid JSON"),
    (_with(2, tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]),
     "must be the JSON text of an object"),
    (_with(2, tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{}"}}]), r"\.id must be"),
    (_with(2, tool_calls=[{"id": "c", "function": {"arguments": "{}"}}]), r"\.function must be"),
    (_with(2, tool_calls=..., content=None), r"missing required parameter: 'messages\[2\].content'"),
    (_with(1, content=[{"type": "image_url", "image_url": {"url": "x"}}]), r"messages\[1\].content\[0\] is a .image_url. part: this model takes no images"),
    (_with(1, role="function"), "use role 'tool'"),
    (_with(1, content="bad \ud800"), "not valid UTF-8"),
])
def test_malformed_messages_are_refused(messages, match):
    with pytest.raises(ToolMessageError, match=match) as e:
        to_template_messages(messages)
    assert e.value.param == "messages"


def test_the_tool_template_renders_tools_calls_and_results(tiny_tool_model_dir):
    tokenizer = Tokenizer(tiny_tool_model_dir)
    assert template_supports_tools(tokenizer.hf.chat_template)
    spec = ToolSpec.from_request(TOOLS, "auto")
    text = tokenizer.apply_chat_template(to_template_messages(HISTORY), tools=spec.template_tools())
    assert text.startswith("<|im_start|>system\nYou help with the weather.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(spec.template_tools()[0], ensure_ascii=False) + "\n" in text
    assert '\n{"type": "function", "function": {"name": "now"}}\n</tools>' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}'
            "\n</tool_call><|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response>\n<tool_response>\n12:00\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<tools>" not in plain and plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_tiny_tool_model_answers_a_follow_up_with_a_forced_call(tiny_tool_model_dir):
    """The whole path offline: history with a tool result, rendered with tools, a named call enforced."""
    llm = LLM(tiny_tool_model_dir, num_kv_blocks=64, max_model_len=1024)
    tokenizer = llm.llm_engine.tokenizer
    spec = ToolSpec.from_request(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    text = tokenizer.apply_chat_template(to_template_messages(HISTORY), tools=spec.template_tools())
    prompt = {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=spec.structured_outputs())
              for i in range(3)]
    for out in llm.generate([prompt] * 3, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        (call,) = spec.extract(c.text, HermesToolParser).tool_calls
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


def test_llm_chat_lists_the_tools_in_the_prompt(tiny_tool_model_dir):
    """``LLM.chat(tools=...)``, as vLLM's: the template gets the tools (one prompt token count per way)."""
    llm = LLM(tiny_tool_model_dir, num_kv_blocks=64, max_model_len=1024)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    (with_tools,) = llm.chat(messages, params, use_tqdm=False, tools=TOOLS)
    (without,) = llm.chat(messages, params, use_tqdm=False)
    expected = llm.llm_engine.tokenizer.apply_chat_template(messages, tools=TOOLS)
    assert "<tools>" in expected
    assert with_tools.prompt_token_ids == llm.get_tokenizer().encode(expected, add_special_tokens=False)
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids)
