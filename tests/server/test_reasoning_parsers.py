"""Reasoning parsers: harmony channels (gpt_oss), <think> blocks (qwen3, deepseek_r1), granite, streamed and whole.

The harmony outputs are rendered by openai-harmony's own encoder from
messages built here (what gpt-oss writes after ``<|start|>assistant``), or
written out in the format's documented text; the expected reasoning,
content and calls are the pieces those messages were made of. Each output is
also fed cut in two at every split point (tokens for harmony, characters for
``<think>``) and one piece per token/character: the reassembled stream must
equal the whole answer.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from pagedllm.entrypoints.openai.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    GptOssReasoningParser,
    GraniteReasoningParser,
    ReplyParser,
    ThinkReasoningParser,
    detect_reasoning_parser,
    get_reasoning_parser,
)
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, assemble_deltas
from pagedllm.harmony.detect import is_harmony_model
from pagedllm.harmony.prompt import render_prompt
from pagedllm.harmony.vocab import (
    VOCAB_SHA256,
    harmony_encoding,
    ranks_from_quicktok,
    tiktoken_text,
    write_vocab,
)


@pytest.fixture(scope="module")
def enc():  # noqa: ANN201
    return harmony_encoding()


def _assistant(enc, *parts: tuple[str, str, str | None]) -> list[int]:  # noqa: ANN001
    """Tokens of assistant messages (channel, text, recipient) as the model writes them after ``<|start|>assistant``."""
    from openai_harmony import Conversation, Message, RenderConversationConfig, Role

    messages = []
    for channel, text, recipient in parts:
        m = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
        if recipient is not None:
            m = m.with_recipient(recipient).with_content_type("<|constrain|>json")
        messages.append(m)
    # keep the analysis: the renderer drops it from earlier turns of a prompt, not from a reply
    config = RenderConversationConfig(auto_drop_analysis=False)
    tokens = enc.render_conversation(Conversation.from_messages(messages), config)
    prefix = enc.encode("<|start|>assistant", allowed_special="all")
    assert tokens[: len(prefix)] == prefix
    end, done = enc.encode("<|end|><|return|>", allowed_special="all")
    if parts[-1][0] == "final" and tokens[-1] == end:
        tokens[-1] = done  # a reply's last message ends with <|return|> (the renderer closes prompt turns)
    return tokens[len(prefix) :]  # the prompt ends with <|start|>assistant


def _harmony(tokens: list[int], **kwargs):  # noqa: ANN003, ANN202
    """The whole answer, and the answers of every two-way split and of one token per feed."""
    whole = ReplyParser(GptOssReasoningParser(**kwargs), None).extract("", tokens)
    splits = [[tokens[:i], tokens[i:]] for i in range(len(tokens) + 1)] + [[[t] for t in tokens]]
    for pieces in splits:
        parser = ReplyParser(GptOssReasoningParser(**kwargs), None)
        got = assemble_deltas([parser.feed("", p) for p in pieces] + [parser.finish()])
        assert _plain(got) == _plain(whole), pieces
    return whole


def _plain(found) -> tuple:  # noqa: ANN001
    return found.reasoning_content, found.content, [(c.name, c.arguments) for c in found.tool_calls]


def test_vocab_is_the_published_file(tmp_path) -> None:  # noqa: ANN001
    path = write_vocab(tmp_path)
    text = path.read_bytes()
    assert hashlib.sha256(text).hexdigest() == VOCAB_SHA256
    assert text.splitlines()[:2] == [b"IQ== 0", b"Ig== 1"]  # "!" and '"', o200k_base's first ranks
    assert len(text.splitlines()) == 199998


def test_vocab_source_layout_is_checked() -> None:
    data = (2).to_bytes(4, "little") + b"\x01\x00b" + (1).to_bytes(4, "little") + b"\x01\x00a" + (0).to_bytes(4, "little")
    assert ranks_from_quicktok(data) == [(0, b"a"), (1, b"b")]
    assert tiktoken_text(ranks_from_quicktok(data)) == b"YQ== 0\nYg== 1\n"
    with pytest.raises(ValueError, match="truncated"):
        ranks_from_quicktok(data[:-2])
    with pytest.raises(ValueError, match="past its last token"):
        ranks_from_quicktok(data + b"x")


def test_prompt_carries_effort_instructions_tools_and_calls(enc) -> None:  # noqa: ANN001
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
    ]
    text = enc.decode_utf8(render_prompt(messages, tools, "high"))
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: high" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert "namespace functions {" in text and "type get_weather = (_: {\ncity: string,\n}) => any;" in text
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
            '<|message|>{"city": "Paris"}<|call|>') in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
    assert text.endswith("<|end|><|start|>assistant")
    plain = enc.decode_utf8(render_prompt([{"role": "user", "content": "Hi"}]))
    assert "Reasoning: medium" in plain and "developer" not in plain
    assert plain.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    with pytest.raises(ValueError, match="reasoning_effort"):
        render_prompt([{"role": "user", "content": "Hi"}], reasoning_effort="max")


def test_analysis_then_final(enc) -> None:  # noqa: ANN001
    tokens = _assistant(enc, ("analysis", "Think about it.", None), ("final", "The answer is 4.", None))
    assert _plain(_harmony(tokens)) == ("Think about it.", "The answer is 4.", [])
    # the engine stops at <|return|>, which closes the final message
    assert tokens[-1] == enc.encode("<|return|>", allowed_special="all")[0]


def test_analysis_then_call(enc) -> None:  # noqa: ANN001
    tokens = _assistant(enc, ("analysis", "Need the weather.", None),
                        ("commentary", '{"city": "Paris"}', "functions.get_weather"))
    found = _harmony(tokens, calls_allowed=True)
    assert _plain(found) == ("Need the weather.", None, [("get_weather", '{"city": "Paris"}')])
    assert found.tool_calls[0].id.startswith("call_")
    # as gpt-oss writes it: the recipient after the channel, in the documented text form
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    again = _harmony(enc.encode(text, allowed_special="all"), calls_allowed=True)
    assert _plain(again) == _plain(found)


def test_preamble_and_parallel_calls(enc) -> None:  # noqa: ANN001
    tokens = _assistant(enc, ("commentary", "Checking both.", None),
                        ("commentary", '{"city": "Paris"}', "functions.get_weather"),
                        ("commentary", '{"zone": "CET"}', "functions.get_time"))
    both = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]
    assert _plain(_harmony(tokens, calls_allowed=True)) == (None, "Checking both.", both)
    # parallel_tool_calls: false keeps the first call only
    assert _plain(_harmony(tokens, calls_allowed=True, max_calls=1)) == (None, "Checking both.", both[:1])
    # no tools in the request: a call's text is not hidden, it is content
    assert _plain(_harmony(tokens)) == (None, 'Checking both.{"city": "Paris"}{"zone": "CET"}', [])


def test_builtin_recipient_is_reasoning(enc) -> None:  # noqa: ANN001
    tokens = _assistant(enc, ("analysis", '{"query": "x"}', "browser.search"), ("final", "Done.", None))
    assert _plain(_harmony(tokens, calls_allowed=True)) == ('{"query": "x"}', "Done.", [])


def test_cut_and_broken_outputs_never_raise(enc) -> None:  # noqa: ANN001
    tokens = _assistant(enc, ("analysis", "Long thought", None), ("final", "Reply", None))
    cut_in_header = tokens[: tokens.index(enc.encode("<|start|>", allowed_special="all")[0]) + 2]
    assert _plain(_harmony(cut_in_header)) == ("Long thought", "", [])
    cut_in_text = _assistant(enc, ("final", "Reply that goes on", None))[:-2]
    reasoning, content, calls = _plain(_harmony(cut_in_text))
    assert reasoning is None and "Reply that goes" in content and not calls
    # text where the next message's <|start|> belongs: the rest is sent as content, not lost
    broken = enc.encode("<|channel|>final<|message|>x<|end|>oops<|end|>", allowed_special="all")
    assert _plain(_harmony(broken)) == (None, "xoops<|end|>", [])


def _think(text: str, prompt: str | None = None, parser=ThinkReasoningParser, tools: bool = False):  # noqa: ANN001, ANN202
    def make() -> ReplyParser:
        return ReplyParser(parser(prompt_text=prompt), HermesToolParser(buffered=False) if tools else None)

    whole = ReplyParser(parser(prompt_text=prompt), HermesToolParser(buffered=True) if tools else None)
    whole = whole.extract(text, [])
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        p = make()
        got = assemble_deltas([p.feed(piece, []) for piece in pieces] + [p.finish()])
        assert _plain(got) == _plain(whole), pieces
    return _plain(whole)


def test_think_block_with_a_call_after_it() -> None:
    text = ('<think>\nIs <b> a </thin tag? <tool_call>{"name": "x", "arguments": {}}</tool_call>\n</think>\n\n'
            'Sure.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    reasoning, content, calls = _think(text, tools=True)
    assert reasoning == '\nIs <b> a </thin tag? <tool_call>{"name": "x", "arguments": {}}</tool_call>\n'
    assert content == "Sure." and calls == [("get_time", '{"zone": "UTC"}')]


def test_think_opened_by_the_prompt() -> None:
    prompt = "<|im_start|>assistant\n<think>\n"
    assert _think("Hmm.\n</think>\n\nHello.", prompt) == ("Hmm.\n", "Hello.", [])
    assert _think("Hmm, still", prompt) == ("Hmm, still", "", [])
    assert _think("<think>\nHmm.</think>Hi", prompt) == ("\nHmm.", "Hi", [])  # opened twice: once counts
    assert _think("</think>Hi", prompt) == (None, "Hi", [])
    assert _think(" <thi", prompt) == (" <thi", "", [])
    # deepseek_r1 assumes the prompt opened it; qwen3 that it did not
    assert _think("Hmm.</think>Hi", parser=DeepSeekR1ReasoningParser) == ("Hmm.", "Hi", [])
    assert _think("Hmm.</think>Hi") == (None, "Hmm.</think>Hi", [])


def test_think_absent_or_cut() -> None:
    assert _think("  Just an answer <thinking>") == (None, "  Just an answer <thinking>", [])
    assert _think("<think>cut off</thi") == ("cut off</thi", "", [])
    assert _think("") == (None, "", [])


def test_parser_choice_and_delta_shape() -> None:
    assert get_reasoning_parser("auto", harmony_model=True) is GptOssReasoningParser
    assert get_reasoning_parser("auto", harmony_model=False) is None
    assert get_reasoning_parser("none", harmony_model=True) is None
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match="known: auto, none"):
        get_reasoning_parser("granite2")
    assert is_harmony_model("gpt-oss") and is_harmony_model("llama", ["GptOssForCausalLM"])
    assert is_harmony_model("llama", [], "{{ '<|start|>assistant<|channel|>' }}")
    assert not is_harmony_model("llama", ["LlamaForCausalLM"], "{{ '<think>' }}")
    parser = ThinkReasoningParser()
    delta = parser.feed("<think>a", [])
    assert delta.to_dict() == {"reasoning_content": "a"}
    assert json.loads(json.dumps(parser.feed("</think>b", []).to_dict())) == {"content": "b"}


# --- granite -----------------------------------------------------------------------------------

# as Granite 3.2's chat template tells the model to answer with thinking on
GRANITE_DOC = ("Here is my thought process:\nThe user asks 2+2. Here is my thinking, not a response.\n"
               "\nHere is my response:\n2 + 2 = 4.")


def test_granite_thought_and_response() -> None:
    reasoning = "The user asks 2+2. Here is my thinking, not a response."
    assert _think(GRANITE_DOC, parser=GraniteReasoningParser) == (reasoning, "2 + 2 = 4.", [])
    contracted = GRANITE_DOC.replace("Here is my thought", "Here's my thought").replace("Here is my resp", "Here's my resp")
    assert _think(contracted, parser=GraniteReasoningParser) == (reasoning, "2 + 2 = 4.", [])
    # a call after the response goes to the tool parser; one inside the thought does not
    text = ("Here is my thought process:\n<tool_call>{\"name\": \"x\"}</tool_call>\nHere is my response:\n"
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert _think(text, parser=GraniteReasoningParser, tools=True) == (
        '<tool_call>{"name": "x"}</tool_call>', None, [("get_time", "{}")])


def test_granite_without_markers_or_cut() -> None:
    assert _think("  Just the answer.", parser=GraniteReasoningParser) == (None, "  Just the answer.", [])
    assert _think("Here is my thou", parser=GraniteReasoningParser) == (None, "Here is my thou", [])
    assert _think("Here is my thought process:\nStill thinking  \nHere is my resp",
                  parser=GraniteReasoningParser) == ("Still thinking  \nHere is my resp", "", [])
    assert _think("", parser=GraniteReasoningParser) == (None, "", [])


def test_auto_choice_from_the_chat_template() -> None:
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    granite = "{%- if thinking %}{{- 'Respond with Here is my thought process: then Here is my response:' }}"
    assert get_reasoning_parser("auto", chat_template=qwen3) is ThinkReasoningParser
    assert get_reasoning_parser(None, chat_template=granite) is GraniteReasoningParser
    assert get_reasoning_parser("auto", harmony_model=True, chat_template=qwen3) is GptOssReasoningParser
    assert get_reasoning_parser("none", chat_template=qwen3) is None  # the override
    assert get_reasoning_parser("auto", chat_template="{{ '<think>' }}") is None  # opens, never closes: unsure
    assert detect_reasoning_parser(False, None) == (None, "the chat template shows no reasoning format")
    assert "<think>" in detect_reasoning_parser(False, qwen3)[1]
