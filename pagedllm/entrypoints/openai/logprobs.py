"""Logprobs in OpenAI's two JSON shapes: completions' parallel lists and chat's ``content`` entries."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedllm.outputs import CompletionOutput, PositionLogprobs

# JSON has no -inf; vLLM reports impossible tokens at this logprob instead
_MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    """A logprob JSON can carry."""
    return max(value, _MIN_LOGPROB) if value == value else _MIN_LOGPROB  # NaN too


def completion_logprobs(
    c: CompletionOutput, start: int, end: int, offset: int
) -> tuple[dict[str, Any] | None, int]:
    """OpenAI's completions ``logprobs`` for tokens ``start:end``, and the next text offset.

    ``top_logprobs`` maps each alternative's text to its logprob and, as in
    vLLM, always holds the chosen token.
    """
    if c.logprobs is None:
        return None, offset
    return _completion_lists(zip(c.token_ids[start:end], c.logprobs[start:end]), offset)


def prompt_completion_logprobs(
    prompt_token_ids: list[int], prompt_logprobs: list[PositionLogprobs | None], first_token_text: str
) -> tuple[dict[str, Any], int]:
    """The prompt's part of an ``echo`` answer's ``logprobs``, and the text offset after it.

    The first token has nothing before it: its logprob and alternatives are
    null, as in vLLM (lm-eval skips it).
    """
    body, offset = _completion_lists(zip(prompt_token_ids[1:], prompt_logprobs[1:]), len(first_token_text))
    body["tokens"].insert(0, first_token_text)
    body["token_logprobs"].insert(0, None)
    body["top_logprobs"].insert(0, None)
    body["text_offset"].insert(0, 0)
    return body, offset


def join_completion_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Two ``logprobs`` bodies as one (an echoed prompt's, then the output's)."""
    if tail is None:
        return head
    return {key: head[key] + tail[key] for key in head}


def _completion_lists(
    entries: Iterable[tuple[int, PositionLogprobs]], offset: int
) -> tuple[dict[str, Any], int]:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, position in entries:
        chosen = position[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(_lp(chosen.logprob))
        ranked = sorted(position.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        top.append({(lp.decoded_token or ""): _lp(lp.logprob) for lp in ranked})
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
    return body, offset


def chat_logprobs(c: CompletionOutput, start: int, end: int, top_n: int) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if c.logprobs is None:
        return None

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, position in zip(c.token_ids[start:end], c.logprobs[start:end]):
        chosen = position[token_id]
        ranked = sorted(
            (lp for lp in position.values() if lp.rank is not None and lp.rank <= top_n), key=lambda lp: lp.rank
        )
        item = entry(chosen.decoded_token or "", chosen.logprob)
        item["top_logprobs"] = [entry(lp.decoded_token or "", lp.logprob) for lp in ranked]
        content.append(item)
    return {"content": content}
