"""``RequestOutputKind``: with DELTA the engine's outputs carry only what is new, held back before a stop string,
and add up to the cumulative outputs exactly; FINAL_ONLY gives one output."""

from __future__ import annotations

import pytest

from pagedllm import LLM, RequestOutput, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.output_deltas import DeltaCursor
from pagedllm.sampling_params import RequestOutputKind

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=128, max_model_len=512)


def _run(engine: LLMEngine, params: SamplingParams) -> list[RequestOutput]:
    """Every output of one request, step by step."""
    rid = engine.new_request_id()
    engine.add_request(rid, PROMPT, params)
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_deltas_add_up_to_the_cumulative_outputs(llm: LLM) -> None:
    """Each choice's texts, token ids and logprobs, concatenated, are its cumulative output; only its last
    delta has a finish reason; a finished choice is not sent again."""
    engine = llm.llm_engine
    settings = {"n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 24, "logprobs": 1}
    whole = _run(engine, SamplingParams(**settings))[-1]
    deltas = _run(engine, SamplingParams(**settings, output_kind=RequestOutputKind.DELTA))
    assert deltas[-1].finished
    for c in whole.outputs:
        mine = [d for out in deltas for d in out.outputs if d.index == c.index]
        assert len(mine) > 1
        assert "".join(d.text for d in mine) == c.text
        assert [t for d in mine for t in d.token_ids] == c.token_ids
        assert [p for d in mine for p in d.logprobs] == c.logprobs
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + [c.finish_reason]
        assert mine[-1].cumulative_logprob == pytest.approx(c.cumulative_logprob)


def _stop_across_steps(texts: list[str]) -> tuple[str, int]:
    """A stop string that starts in one step's text and ends two steps later, found first where it starts:
    (the string, where it starts in the whole text)."""
    whole = texts[-1]
    for i in range(2, len(texts) - 1):
        start, end = len(texts[i - 1]) - 1, len(texts[i]) + 1
        if len(texts[i - 1]) > len(texts[i - 2]) and len(texts[i + 1]) > len(texts[i]) and start > 0:
            stop = whole[start:end]
            if whole.find(stop) == start and stop.strip():
                return stop, start
    raise AssertionError(f"no stop string spans three steps of {whole!r}")


def test_text_a_stop_string_may_cut_is_held_back(llm: LLM) -> None:
    """With a stop string that starts one step before it is complete, no delta ever sends text the stop then
    cuts: at every output the text sent so far is a prefix of the final text."""
    engine = llm.llm_engine
    greedy = {"temperature": 0.0, "max_tokens": 32, "ignore_eos": True}
    texts = [out.outputs[0].text for out in _run(engine, SamplingParams(**greedy))]
    stop, start = _stop_across_steps(texts)
    expected = texts[-1][:start]
    cut = _run(engine, SamplingParams(**greedy, stop=stop))[-1].outputs[0]
    assert (cut.text, cut.stop_reason) == (expected, stop)
    sent = ""
    for out in _run(engine, SamplingParams(**greedy, stop=stop, output_kind=RequestOutputKind.DELTA)):
        for d in out.outputs:
            sent += d.text
            assert expected.startswith(sent), (sent, expected)
    assert sent == expected


def test_final_only_gives_one_output(llm: LLM) -> None:
    engine = llm.llm_engine
    settings = {"temperature": 0.0, "max_tokens": 12}
    whole = _run(engine, SamplingParams(**settings))[-1]
    final = _run(engine, SamplingParams(**settings, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].text == whole.outputs[0].text
    assert final[0].outputs[0].token_ids == whole.outputs[0].token_ids


def test_generate_refuses_deltas_and_a_bad_kind(llm: LLM) -> None:
    with pytest.raises(ValueError, match="output_kind DELTA is for streaming clients"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, output_kind=RequestOutputKind.DELTA))
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_cursor_holds_back_and_sends_tokens_with_text() -> None:
    """The cursor alone: held characters wait, tokens go with the next text, the finish flushes all once."""
    cursor = DeltaCursor()
    assert cursor.advance("ab", 1, False, 3) is None  # all of it could start a 4-character stop
    assert cursor.advance("abcde", 3, False, 3) == ("ab", 0, 3)
    assert cursor.advance("abcde", 4, False, 3) is None
    assert cursor.advance("abc", 5, True, 3) == ("c", 3, 5)  # a stop cut "de": never sent
    assert cursor.advance("abc", 5, True, 3) is None
