"""The qwen3_coder, mistral and pythonic tool parsers on outputs written as each format's documentation shows them.

The samples follow the formats' own documents (Qwen3-Coder's chat template
instructions, Mistral's function-calling docs for the list and the v11
``[ARGS]`` forms, the Llama 3.2 pythonic examples), not this server's output;
the expected calls are written out by hand. Each is fed whole, cut in two at
every split point, and one character per feed, with and without a ``<think>``
reasoning parser in front: every way must give the same reasoning, content
and calls. No model runs here.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.reasoning_parsers import ReplyParser, ThinkReasoningParser
from pagedllm.entrypoints.openai.tool_choice import FunctionTool, ToolSpec
from pagedllm.entrypoints.openai.tool_parsers import (
    MistralToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolParser,
    assemble_deltas,
    detect_tool_parser,
    get_tool_parser,
)
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import typed_value

WEATHER = FunctionTool("get_weather", "Weather in a city", {
    "type": "object",
    "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "where": {"type": "object"}, "ratio": {"type": "number"},
        "zip": {"type": "string"}, "note": {"type": ["string", "null"]},
    },
})
TOOLS = (WEATHER, FunctionTool("example_function_name"))
THOUGHT = "<think>\nThe user wants the weather; <tool_call> here is only thought.\n</think>\n\n"


def _plain(found) -> tuple:  # noqa: ANN001
    return found.content, [(c.name, json.loads(c.arguments)) for c in found.tool_calls]


def _pieces(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def _parse(cls: type[ToolParser], text: str, may_diverge: bool = False, **kwargs) -> tuple:  # noqa: ANN003
    """The whole answer; every split of the stream (alone and behind a reasoning parser) must equal it.

    ``may_diverge``: the output breaks after a call could have gone out (cut
    short), so a stream may keep that call; it must say so (``diverged``).
    """
    whole = cls.extract(text, **kwargs)
    for pieces in _pieces(text):
        parser = cls(**kwargs)
        streamed = assemble_deltas([parser.feed(p) for p in pieces] + [parser.finish()])
        if parser.diverged:
            assert may_diverge, pieces
            continue
        assert (streamed.content, [(c.name, c.arguments) for c in streamed.tool_calls]) == (
            whole.content, [(c.name, c.arguments) for c in whole.tool_calls]), pieces
    thought = THOUGHT + text
    for pieces in _pieces(thought)[:: max(1, len(thought) // 60)] + [list(thought)]:
        reply = ReplyParser(ThinkReasoningParser(), cls(**kwargs))
        streamed = assemble_deltas([reply.feed(p, []) for p in pieces] + [reply.finish()])
        if reply.tools.diverged:
            assert may_diverge, pieces
            continue
        assert streamed.reasoning_content == THOUGHT[len("<think>") : -len("</think>\n\n")]
        assert _plain(streamed) == _plain(whole), pieces
    return _plain(whole)


# --- qwen3_coder ----------------------------------------------------------------------------

# the example in Qwen3-Coder's chat template, which tells the model the format
QWEN3_CODER_DOC = """<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
<parameter=example_parameter_2>
This is the value for the second parameter
that can span
multiple lines
</parameter>
</function>
</tool_call>"""


def test_qwen3_coder_template_example() -> None:
    content, calls = _parse(Qwen3CoderToolParser, QWEN3_CODER_DOC, tools=TOOLS)
    assert content is None
    assert calls == [("example_function_name", {
        "example_parameter_1": "value_1",
        "example_parameter_2": "This is the value for the second parameter\nthat can span\nmultiple lines",
    })]


def test_qwen3_coder_values_typed_by_the_schema() -> None:
    text = ("Let me check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
            "<parameter=hours>\n[9, 12]\n</parameter>\n<parameter=where>\n{'lat': 1.5}\n</parameter>\n"
            "<parameter=ratio>\n2\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n"
            "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>")
    content, calls = _parse(Qwen3CoderToolParser, text, tools=TOOLS)
    assert content == "Let me check both.\n"
    assert calls == [
        ("get_weather", {"city": "New York", "days": 3, "metric": False, "hours": [9, 12], "where": {"lat": 1.5},
                         "ratio": 2, "zip": "01234", "note": None, "extra": "42"}),
        ("get_weather", {"days": "three"}),  # not an integer: the text, as written
    ]
    # without the tools every value is a string
    assert Qwen3CoderToolParser.extract(text).tool_calls[0].arguments.startswith('{"city": "New York", "days": "3"')


def test_qwen3_coder_typed_value_rules() -> None:
    assert typed_value("7", {"type": "integer"}) == 7 and typed_value("7.0", {"type": "integer"}) == 7
    assert typed_value("7.5", {"type": "integer"}) == "7.5"
    assert typed_value("True", {"type": "boolean"}) is True
    assert typed_value(" 1e3 ", {"type": "number"}) == 1000.0
    assert typed_value("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 7
    assert typed_value("null", {"type": "string"}) == "null"
    assert typed_value("{1, 2}", {"type": "array"}) == "{1, 2}"  # a set is no JSON value
    assert typed_value("x", None) == "x"


@pytest.mark.parametrize("block", [
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",  # Hermes JSON, not this format
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # unclosed value
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n"
    "</function>\n</tool_call>",
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut short
    "<tool_call>\n<function=get_weather>\n",
    "<tool_call>",
])
def test_qwen3_coder_malformed_blocks_stay_content(block: str) -> None:
    text = "Before. " + block
    r = Qwen3CoderToolParser.extract(text, tools=TOOLS)
    assert r.content == text and r.tool_calls == []
    assert _parse(Qwen3CoderToolParser, text, may_diverge=True, tools=TOOLS) == (text, [])


def test_qwen3_coder_edge_cases() -> None:
    # no parameters, no closing </tool_call> at the end, text after a call
    assert _parse(Qwen3CoderToolParser, "<tool_call>\n<function=example_function_name>\n</function>\n", tools=TOOLS) == (
        None, [("example_function_name", {})])
    assert _parse(Qwen3CoderToolParser, "A <tool_call><function=f></function></tool_call> B <tool_cal") == (
        "A  B <tool_cal", [("f", {})])
    # a value holding tags of the format is still the value
    text = "<tool_call>\n<function=f>\n<parameter=code>\n<tool_call></function>\n</paramete\n</parameter>\n</function>\n</tool_call>"
    assert _parse(Qwen3CoderToolParser, text) == (None, [("f", {"code": "<tool_call></function>\n</paramete"})])
    # parallel_tool_calls: false keeps the first call
    two = QWEN3_CODER_DOC + "\n" + QWEN3_CODER_DOC
    assert len(Qwen3CoderToolParser.extract(two, max_calls=1).tool_calls) == 1


def test_qwen3_coder_streams_the_name_first_then_parameters() -> None:
    parser = Qwen3CoderToolParser(tools=TOOLS)
    first = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert [d.to_dict()["function"] for d in first.tool_calls] == [{"name": "get_weather", "arguments": ""}]
    assert parser.feed("is\n</parameter>\n").tool_calls[0].to_dict() == {
        "index": 0, "function": {"arguments": '{"city": "Paris"'}}
    assert parser.feed("<parameter=days>\n2\n</parameter>\n</function>").tool_calls[0].arguments == ', "days": 2}'
    assert parser.finish() is None


def test_qwen3_coder_a_stream_that_breaks_after_its_name_keeps_the_call() -> None:
    text = "<tool_call>\n<function=f>\nbroken\n</function>\n</tool_call> after"
    parser = Qwen3CoderToolParser()
    streamed = assemble_deltas([parser.feed(text), parser.finish()])
    assert parser.diverged and [c.name for c in streamed.tool_calls] == ["f"] and streamed.content == " after"
    assert Qwen3CoderToolParser.extract(text).content == text


# --- mistral ---------------------------------------------------------------------------------

# Mistral's function-calling docs: the pre-v11 list form, and the v11 [ARGS] form
MISTRAL_LIST_DOC = ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                    '"format": "celsius"}}]')
MISTRAL_ARGS_DOC = '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}'
PARIS = {"location": "Paris, France", "format": "celsius"}


def test_mistral_documented_forms() -> None:
    assert _parse(MistralToolParser, MISTRAL_LIST_DOC) == (None, [("get_current_weather", PARIS)])
    assert _parse(MistralToolParser, MISTRAL_ARGS_DOC) == (None, [("get_current_weather", PARIS)])
    # the raw text of the arguments, as written
    assert MistralToolParser.extract(MISTRAL_ARGS_DOC).tool_calls[0].arguments == json.dumps(PARIS)


def test_mistral_several_calls_and_text() -> None:
    text = ('Checking.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}'
            '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}')
    assert _parse(MistralToolParser, text) == ("Checking.", [("get_current_weather", PARIS), ("get_time", {"zone": "CET"})])
    text = '[TOOL_CALLS] [{"name": "a", "arguments": {"x": [1, {"y": "]"}]}, "id": "abcdefghi"}, {"name": "b", "arguments": {}}]'
    assert _parse(MistralToolParser, text) == (None, [("a", {"x": [1, {"y": "]"}]}), ("b", {})])
    assert _parse(MistralToolParser, '[TOOL_CALLS] {"name": "a", "arguments": {}} then text') == (
        " then text", [("a", {})])


@pytest.mark.parametrize("block", [
    "[TOOL_CALLS] not json",
    '[TOOL_CALLS] [{"name": "f", "arguments": "{}"}]',
    '[TOOL_CALLS] [{"arguments": {}}]',
    '[TOOL_CALLS] [{"name": "f", "arguments": {}}',  # cut before ']'
    "[TOOL_CALLS]get weather[ARGS]{}",
    "[TOOL_CALLS]f[ARG]{}",
    "[TOOL_CALLS]f[ARGS][1]",
    '[TOOL_CALLS]f[ARGS]{"a": ',
    "[TOOL_CALLS]",
])
def test_mistral_malformed_blocks_stay_content(block: str) -> None:
    text = "Before. " + block
    r = MistralToolParser.extract(text)
    assert r.content == text and r.tool_calls == []
    assert _parse(MistralToolParser, text, may_diverge=True) == (text, [])


# --- pythonic --------------------------------------------------------------------------------

PYTHONIC_DOC = "[get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]"


def test_pythonic_documented_example() -> None:
    assert _parse(PythonicToolParser, PYTHONIC_DOC) == (None, [
        ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
        ("get_weather", {"city": "Seattle", "metric": "celsius"}),
    ])
    text = ("<|python_start|>[get_user_info(user_id=7890, special='black', tags=('a', \"b)\"), "
            "opts={'deep': [None, True, -1.5]})]<|python_end|>")
    assert _parse(PythonicToolParser, text) == (None, [
        ("get_user_info", {"user_id": 7890, "special": "black", "tags": ["a", "b)"],
                           "opts": {"deep": [None, True, -1.5]}})])
    assert _parse(PythonicToolParser, " [noargs()] ") == (None, [("noargs", {})])


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    "[get_weather('Paris')]",  # positional
    "[get_weather(city=paris)]",  # not a literal
    "[get_weather(city={1, 2})]",  # a set
    "[get_weather(city=float('nan'))]",
    "[get_weather(city='Paris')] and more",
    "[get_weather(city='Paris'",
    "[os.system(cmd='ls')]",
    "[]",
    "[1, 2]",
    "",
])
def test_pythonic_anything_but_calls_is_content(text: str) -> None:
    r = PythonicToolParser.extract(text)
    assert r.content == text and r.tool_calls == []
    assert _parse(PythonicToolParser, text, may_diverge=True) == (text, [])


def test_pythonic_stream_sends_each_call_when_it_closes() -> None:
    parser = PythonicToolParser()
    assert parser.feed("[get_weather(city='Par") is None
    first = parser.feed("is'), f(")
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert parser.feed("x=1)]").tool_calls[0].name == "f"
    assert parser.finish() is None
    broken = PythonicToolParser()
    assert assemble_deltas([broken.feed("[f(x=1)] trailing"), broken.finish()]).content is None
    assert broken.diverged


# --- choosing them ---------------------------------------------------------------------------


def test_chosen_by_name_and_from_the_template() -> None:
    assert get_tool_parser("qwen3_coder") is Qwen3CoderToolParser
    assert get_tool_parser("mistral") is MistralToolParser
    assert get_tool_parser("pythonic") is PythonicToolParser
    qwen3_coder = ("{{- 'If you choose to call a function ONLY reply in the following format:\\n<tool_call>\\n"
                   "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1' }}")
    mistral = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- endif %}"
    pythonic = "{{- 'you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=...)]' }}"
    assert detect_tool_parser(qwen3_coder) is Qwen3CoderToolParser
    assert detect_tool_parser(mistral) is MistralToolParser
    assert detect_tool_parser(pythonic) is PythonicToolParser


def test_the_request_tools_reach_the_qwen3_coder_parser() -> None:
    spec = ToolSpec.from_request([WEATHER.template_dict()], "auto", check_schemas=False)
    parser = spec.new_parser(Qwen3CoderToolParser, buffered=True)
    parser.feed("<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>")
    assert assemble_deltas([parser.finish()]).tool_calls == [] and parser.num_calls == 1
    found = spec.extract("<tool_call><function=get_weather><parameter=days>4</parameter></function>",
                         Qwen3CoderToolParser)
    assert found.tool_calls[0].arguments == '{"days": 4}'


# --- no crash on anything ----------------------------------------------------------------------

_PIECES = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "f", ">", "\n",
           "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "{", "}", "[", "]", '"a"', ":", ",", "1", "(", ")", "x=", "'s'",
           "<|python_start|>", " ", "days"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=30), st.lists(st.integers(0, 200), max_size=6))
def test_any_mix_of_markup_never_raises_and_streams_like_whole(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    for cls, kwargs in [(Qwen3CoderToolParser, {"tools": TOOLS}), (MistralToolParser, {}), (PythonicToolParser, {})]:
        whole = cls.extract(text, **kwargs)
        parser = cls(**kwargs)
        streamed = assemble_deltas([parser.feed(p) for p in pieces] + [parser.finish()])
        for call in whole.tool_calls:
            assert isinstance(json.loads(call.arguments), dict)
        if not parser.diverged:
            assert (streamed.content, [(c.name, c.arguments) for c in streamed.tool_calls]) == (
                whole.content, [(c.name, c.arguments) for c in whole.tool_calls]), (cls.name, pieces)
        if not whole.tool_calls:
            assert whole.content == text
