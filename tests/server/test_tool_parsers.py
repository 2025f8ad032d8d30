"""Tool-call parsers: hand-written model outputs, malformed ones, and streams cut anywhere.

No model runs here. The central property: a stream fed in arbitrary pieces
reassembles (as a client does) into exactly the non-streamed answer, the
arguments included character for character, and its content never shows
markup that the final content does not hold.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    DeltaMessage,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedFunctionParser,
    RequiredToolsParser,
    ToolParser,
    assemble_deltas,
    detect_tool_parser,
    get_tool_parser,
)
from pagedllm.entrypoints.openai.tool_parsers.json_scan import JsonLexer, JsonSyntaxError

TRICKY_ARGS = '{"q": "a } b ]\\" </tool_call> <tool_call> {", "n": [1, -2.5e-3, 0, {"x": {"y": [true, false, null]}}], "u": "caf\u00e9 \\u00e9 \\n"}'


def _calls(result) -> list[tuple[str, str]]:  # noqa: ANN001
    return [(c.name, c.arguments) for c in result.tool_calls]


def _stream(cls: type[ToolParser], pieces: list[str], **kwargs) -> list[DeltaMessage | None]:
    return _stream_with(cls(**kwargs), pieces)


def _stream_with(parser: ToolParser, pieces: list[str]) -> list[DeltaMessage | None]:
    return [parser.feed(p) for p in pieces] + [parser.finish()]


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({min(c, len(text)) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _assert_stream_matches(
    cls: type[ToolParser], text: str, cuts: list[int], allow_divergence: bool = False, **kwargs
) -> None:
    """The stream cut at ``cuts`` reassembles into extract(text); content so far is always a prefix of the final one.

    A stream whose call broke after it went out (malformed or cut-short
    output) cannot match; it must say so, and only then may it differ.
    """
    whole = cls.extract(text, **kwargs)
    parser = cls(**kwargs)
    deltas = _stream_with(parser, _split(text, cuts))
    streamed = assemble_deltas(deltas)
    if parser.diverged:
        assert allow_divergence, text
        assert len(streamed.tool_calls) > len(whole.tool_calls)
        return
    assert streamed.content == whole.content
    assert _calls(streamed) == _calls(whole)
    so_far = ""
    for d in deltas:
        if d is not None and d.content is not None:
            so_far += d.content
            assert (whole.content or "").startswith(so_far)


# --- Hermes ------------------------------------------------------------------------------------


def test_hermes_one_call_with_text_before():
    text = 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = HermesToolParser.extract(text)
    assert r.content == "Let me look that up.\n"
    assert _calls(r) == [("get_weather", '{"city": "Paris"}')]
    assert r.tool_calls[0].id.startswith("call_") and len(r.tool_calls[0].id) == 29
    assert r.tool_calls[0].to_dict() == {
        "id": r.tool_calls[0].id, "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


def test_hermes_several_calls_drop_the_whitespace_between_them():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n'
        '<tool_call>{"arguments": {"z": [1, {"w": "}"}]}, "name": "c"}</tool_call>\n'
    )
    r = HermesToolParser.extract(text)
    assert r.content is None
    assert _calls(r) == [("a", '{"x": 1}'), ("b", "{}"), ("c", '{"z": [1, {"w": "}"}]}')]
    assert len({c.id for c in r.tool_calls}) == 3


def test_hermes_strings_with_braces_and_tags_inside_the_arguments():
    text = f"<tool_call>{{\"name\": \"search\", \"arguments\": {TRICKY_ARGS}}}</tool_call>"
    r = HermesToolParser.extract(text)
    assert _calls(r) == [("search", TRICKY_ARGS)]
    assert json.loads(r.tool_calls[0].arguments)["q"] == 'a } b ]" </tool_call> <tool_call> {'


def test_hermes_text_between_and_after_calls_is_content():
    text = 'A<tool_call>{"name": "f", "arguments": {}}</tool_call> and B <tool_call>{"name": "g"}</tool_call> done'
    r = HermesToolParser.extract(text)
    assert r.content == "A and B  done"
    assert _calls(r) == [("f", "{}"), ("g", "{}")]  # no arguments: an empty object


def test_hermes_last_call_may_lack_its_closing_tag():
    r = HermesToolParser.extract('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool')
    assert r.content is None and _calls(r) == [("f", '{"a": 1}')]
    r = HermesToolParser.extract('<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert _calls(r) == [("f", '{"a": 1}')]
    # or when the next call follows its JSON
    r = HermesToolParser.extract('<tool_call>{"name": "f", "arguments": {}}\n<tool_call>{"name": "g"}</tool_call>')
    assert r.content is None and _calls(r) == [("f", "{}"), ("g", "{}")]


@pytest.mark.parametrize("block", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',  # trailing comma
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments as a string
    '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 01}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": "unterminated}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut short
    "<tool_call>",
    "<tool_call></tool_call>",
])
def test_hermes_malformed_calls_stay_content(block):
    text = "Before. " + block
    r = HermesToolParser.extract(text)
    assert r.tool_calls == []
    assert r.content == text


def test_hermes_a_broken_block_does_not_hide_a_good_one_after_it():
    text = '<tool_call>{oops <tool_call>{"name": "f", "arguments": {"k": "v"}}</tool_call>'
    r = HermesToolParser.extract(text)
    assert r.content == "<tool_call>{oops "
    assert _calls(r) == [("f", '{"k": "v"}')]


def test_hermes_without_calls_returns_the_text_as_is():
    for text in ["", "   \n", "Plain answer with < and <tool and </tool_call>.", "<tool_cal"]:
        r = HermesToolParser.extract(text)
        assert r.content == text and r.tool_calls == []


def test_hermes_max_calls_keeps_the_first():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    r = HermesToolParser.extract(text, max_calls=1)
    assert _calls(r) == [("a", "{}")] and r.content is None
    with pytest.raises(ValueError, match="max_calls"):
        HermesToolParser(max_calls=0)


def test_hermes_stream_never_shows_partial_markup():
    text = 'Sure <tool_call>{"name": "f", "arguments": {"a": [1, 2]}}</tool_call>'
    deltas = _stream(HermesToolParser, list(text))
    content = "".join(d.content for d in deltas if d is not None and d.content is not None)
    assert content == "Sure "
    pieces = [tc for d in deltas if d is not None for tc in d.tool_calls]
    first = pieces[0].to_dict()
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "f"
    assert all(p.to_dict() == {"index": 0, "function": {"arguments": p.arguments}} for p in pieces[1:])
    assert len(pieces) > 3  # the arguments arrive in pieces
    assert "".join(p.arguments for p in pieces) == '{"a": [1, 2]}'


def test_hermes_stream_holds_a_possible_tag_until_it_is_not_one():
    parser = HermesToolParser()
    assert parser.feed("x <tool_").content == "x "
    assert parser.feed("cat>").content == "<tool_cat>"
    assert parser.feed(" <").content == " "  # "<" may begin a tag
    assert parser.finish().content == "<"
    # before any text, whitespace waits: it is dropped if only a call follows
    parser = HermesToolParser()
    assert parser.feed("\n\n") is None
    assert parser.feed("<tool_call>") is None
    assert parser.feed('{"name": "f", "arguments": {').tool_calls[0].name == "f"


def test_a_stream_that_breaks_after_its_call_began_keeps_the_call():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}} junk</tool_call> after'
    parser = HermesToolParser()
    streamed = assemble_deltas([parser.feed(text), parser.finish()])
    assert parser.diverged
    assert _calls(streamed) == [("f", '{"a": 1}')] and streamed.content == " after"
    assert HermesToolParser.extract(text).tool_calls == []  # whole, it is content


# --- Llama 3 JSON ------------------------------------------------------------------------------


def test_llama3_one_call_with_or_without_the_python_tag():
    for prefix in ["", "<|python_tag|>", "  \n<|python_tag|> "]:
        r = Llama3JsonToolParser.extract(prefix + '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
        assert r.content is None
        assert _calls(r) == [("get_weather", '{"city": "Oslo"}')]


def test_llama3_several_calls_separated_by_semicolons():
    text = f'{{"name": "a", "parameters": {TRICKY_ARGS}}}; {{"name": "b", "arguments": {{}}}};\n'
    r = Llama3JsonToolParser.extract(text)
    assert _calls(r) == [("a", TRICKY_ARGS), ("b", "{}")]
    assert _calls(Llama3JsonToolParser.extract(text, max_calls=1)) == [("a", TRICKY_ARGS)]


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"answer": 42}',  # a JSON object that is no call
    '{"name": "f", "parameters": {"a": 1}} and some text',
    '{"name": "f", "parameters": {"a": 1}}; oops',
    '{"name": "f", "parameters": [1]}',
    '{"name": "f", "parameters": {"a": 1}',
    "<|python_tag|>print('hi')",
    "<|python_",
    "",
    "  ",
])
def test_llama3_anything_but_calls_is_content_whole(text):
    r = Llama3JsonToolParser.extract(text)
    assert r.content == text and r.tool_calls == []


# --- outputs forced by tool_choice ----------------------------------------------------------


def test_named_function_output_is_one_call():
    r = NamedFunctionParser.extract('{"a": 1, "b": "x"}', function_name="add")
    assert r.content is None and _calls(r) == [("add", '{"a": 1, "b": "x"}')]
    assert _calls(NamedFunctionParser.extract("", function_name="add")) == [("add", "")]
    with pytest.raises(ValueError):
        NamedFunctionParser()


def test_required_output_is_a_list_of_calls():
    text = f'[{{"name": "a", "parameters": {TRICKY_ARGS}}}, {{"name": "b", "parameters": {{}}}}]'
    r = RequiredToolsParser.extract(text)
    assert r.content is None and _calls(r) == [("a", TRICKY_ARGS), ("b", "{}")]
    # cut by max_tokens: the calls begun are kept, the last with what it had
    r = RequiredToolsParser.extract('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y"')
    assert _calls(r) == [("a", '{"x": 1}'), ("b", '{"y"')]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 400), max_size=8))
def test_constrained_streams_match_at_any_split(cuts):
    text = f'[{{"name": "a", "parameters": {TRICKY_ARGS}}}, {{"name": "b", "parameters": {{}}}}]'
    _assert_stream_matches(RequiredToolsParser, text, cuts)
    _assert_stream_matches(NamedFunctionParser, TRICKY_ARGS, cuts, function_name="f")


# --- streams cut anywhere -------------------------------------------------------------------

HERMES_SAMPLES = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    f'<tool_call>\n{{"name": "s", "arguments": {TRICKY_ARGS}}}\n</tool_call>\n<tool_call>{{"name": "t"}}</tool_call>\n',
    'A<tool_call>{"name": "f", "arguments": {}}</tool_call> and B <tool_call>{"name": "g"}</tool_call> done',
    '<tool_call>{oops <tool_call>{"name": "f", "arguments": {"k": "v"}}</tool_call> tail <tool',
    "No calls at all, just < and <tool_ and </tool_call>.",
    "  \n ",
    "Before. <tool_call>not json</tool_call> after",
    '<tool_call>{"name": "f", "arguments": {}} <tool_call>{"name": "g"} <tool_cat> x',
    '<tool_call>{"name": "f", "arguments": {}} </tool_call><tool_call>{"name": "g"}\n</tool_c',
    'x <tool_call>{"name": "f", "arguments": {"a": "cut',
]
LLAMA_SAMPLES = [
    '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2, {"y": "}"}]}}; {"name": "b", "parameters": {}}',
    f' {{"parameters": {TRICKY_ARGS}, "name": "late_name"}}',
    "Just text { with braces }",
    '{"answer": 42}',
    '{"name": "f", "parameters": {"a": 1',
]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(HERMES_SAMPLES), st.lists(st.integers(0, 300), max_size=12))
def test_hermes_stream_matches_whole_at_any_split(text, cuts):
    # broken after a call went out: cut short, or junk where </tool_call> belongs
    broken = text.endswith('"cut') or "<tool_cat>" in text
    _assert_stream_matches(HermesToolParser, text, cuts, allow_divergence=broken)
    _assert_stream_matches(HermesToolParser, text, cuts, allow_divergence=broken, max_calls=1)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(LLAMA_SAMPLES), st.lists(st.integers(0, 300), max_size=12))
def test_llama3_stream_matches_whole_at_any_split(text, cuts):
    _assert_stream_matches(Llama3JsonToolParser, text, cuts, allow_divergence=text.endswith('"a": 1'))


# generated calls: arguments any JSON object, serialized in several styles, strings with markup in them
_text = st.text(st.sampled_from(list('ab }{][":,\\</>_tool_call\n\u00e9\U0001f600')), max_size=12)
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_styles = st.sampled_from([
    {}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}, {"indent": "\t", "ensure_ascii": False},
])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,10}", fullmatch=True),
                       st.dictionaries(_text, _json_values, max_size=4), _styles), min_size=1, max_size=3),
    st.text(st.sampled_from(list("Hi, <tool> _\n")), max_size=10),
    st.lists(st.integers(0, 2000), max_size=10),
)
def test_generated_calls_are_returned_exactly_in_both_formats(calls, before, cuts):
    before = before.replace("<tool>", "")
    written = [(name, json.dumps(args, **style)) for name, args, style in calls]
    hermes = before + "".join(
        f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>\n' for name, args in written
    )
    r = HermesToolParser.extract(hermes)
    assert _calls(r) == written
    assert r.content == (before if before.strip() else None)
    _assert_stream_matches(HermesToolParser, hermes, cuts)

    llama = "<|python_tag|>" + "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in written)
    assert _calls(Llama3JsonToolParser.extract(llama)) == written
    _assert_stream_matches(Llama3JsonToolParser, llama, cuts)


# --- the JSON scanner against json.loads -----------------------------------------------------


def _strict_loads(text: str) -> object:
    def no_constants(name: str) -> object:
        raise ValueError(name)

    return json.loads(text, parse_constant=no_constants)


def _lexer_accepts(text: str) -> bool:
    lexer = JsonLexer()
    try:
        for ch in text:
            lexer.feed(ch)
    except JsonSyntaxError:
        return False
    return lexer.done


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_text, _json_values, max_size=4), _styles,
       st.lists(st.tuples(st.integers(0, 500), st.sampled_from(list('{}[]",:0-.e+ \\atfnu\x01'))), max_size=3),
       st.lists(st.integers(0, 500), max_size=2))
def test_the_scanner_accepts_exactly_what_json_loads_does(value, style, inserts, deletes):
    text = json.dumps(value, **style)
    for pos, ch in inserts:
        text = text[:pos] + ch + text[pos:]
    for pos in deletes:
        text = text[:pos] + text[pos + 1 :]
    try:
        # JSON allows whitespace before the value; the scanner is done at the closing brace, so none after
        expected = isinstance(_strict_loads(text), dict) and text == text.rstrip() and text.lstrip().startswith("{")
    except ValueError:
        expected = False
    assert _lexer_accepts(text) == expected, text


# --- choosing a parser ----------------------------------------------------------------------


def test_parsers_by_name_and_from_the_template(smollm_tokenizer):
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "qwen3_coder", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="unknown tool call parser 'jamba'.*hermes, llama3_json, mistral"):
        get_tool_parser("jamba")
    qwen = "{{- '<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"
    llama = ('{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name '
             "and its value}.' }}{%- if builtin_tools %}<|python_tag|>{%- endif %}")
    assert get_tool_parser("auto", qwen) is HermesToolParser
    assert get_tool_parser(None, llama) is Llama3JsonToolParser
    assert detect_tool_parser(smollm_tokenizer.chat_template) is HermesToolParser  # no tool support: the default
    assert detect_tool_parser(None) is HermesToolParser


def test_delta_shapes_and_feed_after_finish():
    parser = HermesToolParser()
    d = parser.feed('ok <tool_call>{"name": "f", "arguments": {"a"')
    assert d.to_dict()["content"] == "ok "
    assert d.to_dict()["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert parser.num_calls == 1
    parser.finish()
    with pytest.raises(ValueError):
        parser.feed("x")
    with pytest.raises(ValueError):
        parser.finish()


def test_the_tool_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import pagedllm.entrypoints.openai.tool_parsers, pagedllm.entrypoints.openai.tool_messages\n"
        "import pagedllm.entrypoints.openai.tool_choice\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
