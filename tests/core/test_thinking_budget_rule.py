"""The thinking budget's rule (``pagedllm/thinking_budget.py``) on a hand-made vocabulary.

The markers are text, and a marker may be spelled by tokens in several ways
(``<`` ``think`` ``>``, ``<th`` ``ink>``, a ``>`` glued to the newline after
it): every spelling opens or closes the block, and a prompt whose end glued
the marker to its neighbours still leaves the block open.
"""

from __future__ import annotations

import pytest

from pagedllm.thinking_budget import ThinkingBudget, marker_pieces

TEXTS = ["a", "b", "<", "think", ">", "</", "\n", ">\n", "<th", "ink>", "\n\n", "</think>", " x", " <", "k"]
A, B, LT, THINK, GT, LTS, NL, GTNL, LTTH, INKGT, NLNL, CLOSE, X, SPLT, K = range(len(TEXTS))
FORCED = (CLOSE, NLNL)


def _budget(n: int) -> ThinkingBudget:
    return ThinkingBudget(n, "<think>", "</think>", FORCED, marker_pieces(TEXTS, ("<think>", "</think>")))


def test_the_pieces_are_the_tokens_that_can_spell_a_marker() -> None:
    pieces = marker_pieces(TEXTS, ("<think>", "</think>"))
    # a token is kept when it holds a marker, lies inside one, or begins / ends one; "a", "\n", " x" cannot
    assert set(pieces) == {LT, THINK, GT, LTS, GTNL, LTTH, INKGT, CLOSE, SPLT, K}
    assert pieces[GTNL] == ">\n"
    with pytest.raises(ValueError, match="non-empty"):
        marker_pieces(TEXTS, ("", "</think>"))


def test_every_spelling_of_the_opening_marker_starts_the_count() -> None:
    b = _budget(3)
    assert b.forced_token([A, B, A, B]) is None  # no block opened
    for opening in ([LT, THINK, GT], [LTTH, INKGT], [SPLT, THINK, GTNL], [LT, THINK, GTNL]):
        out = [A, *opening]
        assert b.forced_token(out + [A, A]) is None  # two reasoning tokens: within the budget
        assert b.forced_token(out + [A, A, A]) == CLOSE  # three: the close is forced
        assert b.forced_token(out + [A, A, A, CLOSE]) == NLNL  # then the blank line
        assert b.forced_token(out + [A, A, A, CLOSE, NLNL]) is None  # then the model is free again
    assert b.forced_token([LT, A, THINK, GT, A, A, A]) is None  # "<a think>" is no marker
    assert b.forced_token([LT, LT, K, A, A, A]) is None  # "<<k" neither


def test_a_block_the_model_closes_itself_in_any_spelling() -> None:
    b = _budget(4)
    for closing in ([CLOSE], [LTS, THINK, GT], [LTS, THINK, GTNL]):
        out = [LT, THINK, GT, A, *closing]
        assert b.forced_token(out + [A] * 8) is None
    assert _budget(0).forced_token([LT, THINK, GT]) == CLOSE  # budget 0: closed at once


def test_the_prompt_leaves_the_block_open_however_its_end_tokenized() -> None:
    b = _budget(2)
    for prompt in ([A, LT, THINK, GT], [A, LT, THINK, GTNL], [A, SPLT, THINK, GT, NLNL], [LTTH, INKGT, NL]):
        opened = b.with_prompt(prompt)
        assert opened.opened
        assert opened.forced_token([A]) is None and opened.forced_token([A, A]) == CLOSE  # counted from the output
    assert not b.with_prompt([LT, THINK, GT, A, LTS, THINK, GT, A]).opened  # closed again
    assert not b.with_prompt([A, B]).opened and not b.with_prompt([]).opened


def test_where_a_grammar_begins() -> None:
    """After the block: the model's own close, or the forced tokens; nothing before; 0 when no block was opened."""
    opened = _budget(3).with_prompt([LT, THINK, GT])
    assert opened.grammar_start([A, A]) is None  # thinking
    # closed by the model within the budget (">\n" ends the marker)
    assert _budget(4).with_prompt([LT, THINK, GT]).grammar_start([A, LTS, THINK, GTNL, B]) == 4
    assert opened.grammar_start([A, A, A, CLOSE]) is None  # the forced end under way
    assert opened.grammar_start([A, A, A, CLOSE, NLNL]) == 5  # after the forced tokens
    assert _budget(3).grammar_start([A, B]) == 0  # the prompt opened no block: the grammar holds from the start


def test_bad_budgets() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        _budget(-1)
    with pytest.raises(ValueError, match="markers"):
        ThinkingBudget(1, "", "</think>", FORCED, {})


# harmony's markers as gpt-oss's vocabulary has them: special tokens, and the channel names as ordinary words
H_TEXTS = ["a", "<|start|>", "assistant", "<|channel|>", "analysis", "<|message|>", "<|end|>", "final", "commentary",
           "<|", "end", "|>"]
H_A, H_START, H_ASSISTANT, H_CHANNEL, H_ANALYSIS, H_MESSAGE, H_END, H_FINAL, H_COMMENTARY, H_LT, H_WORD_END, H_GT = (
    range(len(H_TEXTS)))


def _harmony_encode(text: str) -> list[int]:
    """The hand-made vocabulary's tokenization: its longest token at each place."""
    ids = []
    while text:
        token = max((i for i, t in enumerate(H_TEXTS) if text.startswith(t)), key=lambda i: len(H_TEXTS[i]))
        ids.append(token)
        text = text[len(H_TEXTS[token]) :]
    return ids


def test_harmony_markers_close_the_analysis_and_open_the_final_channel() -> None:
    """``think_close_str`` ``<|end|>``: the model may end its analysis itself (then write anything, a call); past
    the budget the whole ``think_end_str`` is forced, ``<|end|>`` and the final channel's header."""
    from pagedllm.engine.inputs import thinking_budget
    from pagedllm.harmony.thinking import ANALYSIS_OPEN, END, FINAL_OPEN
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(thinking_token_budget=2, think_start_str=ANALYSIS_OPEN, think_end_str=END + FINAL_OPEN,
                            think_close_str=END)
    budget = thinking_budget(params, _harmony_encode, len(H_TEXTS), lambda m: marker_pieces(H_TEXTS, m))
    assert budget.forced == (H_END, H_START, H_ASSISTANT, H_CHANNEL, H_FINAL, H_MESSAGE)
    opened = budget.with_prompt([H_START, H_ASSISTANT, H_CHANNEL, H_ANALYSIS, H_MESSAGE])
    assert opened.opened and not budget.with_prompt([H_START, H_ASSISTANT]).opened
    out = [H_A, H_A]
    for expected in budget.forced:
        assert opened.forced_token(out) == expected
        out.append(expected)
    assert opened.forced_token(out) is None  # the answer is the model's
    # ended by the model within the budget, then a commentary message: nothing forced
    own = [H_A, H_END, H_START, H_ASSISTANT, H_CHANNEL, H_COMMENTARY, H_MESSAGE]
    assert all(opened.forced_token(own[:k]) is None for k in range(len(own) + 1))
    # the analysis header written by the model (a prompt that opened none) starts the count too
    header = [H_CHANNEL, H_ANALYSIS, H_MESSAGE]
    assert budget.forced_token([*header, H_A]) is None and budget.forced_token([*header, H_A, H_A]) == H_END
    assert opened.grammar_start([H_A, H_A, *budget.forced]) == 8


def test_think_close_str_must_begin_think_end_str() -> None:
    from pagedllm.sampling_params import SamplingParams

    for close in ("<|call|>", "  "):
        with pytest.raises(ValueError, match="think_close_str"):
            SamplingParams(thinking_token_budget=1, think_end_str="<|end|><|start|>", think_close_str=close)
