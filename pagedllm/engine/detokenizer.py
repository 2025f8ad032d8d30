"""Incremental detokenization: text grows by the delta of each new token.

Decoding one token alone breaks multi-byte characters and the spaces that
some decoders strip from a sequence's first token, so text is decoded in a
short window that starts where the previous delta did. The window is kept by
``tokenizers.decoders.DecodeStream``, in Rust: it holds a token back while the
text ends in U+FFFD (an unfinished character) and returns the new suffix once
the character is whole.

The state a stream holds is also kept on the ``Sequence``, as token offsets
(``prefix_offset``: where the window starts, ``read_offset``: the output
tokens whose text has been emitted; negative offsets reach into the prompt),
so a stream can be rebuilt from the sequence alone, with the same text: a forked sequence,
or one seen for the first time, gets its own.
"""

from __future__ import annotations

import logging
from typing import Protocol

from tokenizers import Tokenizer as FastTokenizer
from tokenizers.decoders import DecodeStream

from pagedllm.engine.sequence import Sequence

logger = logging.getLogger(__name__)

# prompt tokens that give the first output token its context (a leading space
# that a Metaspace decoder would strip from a sequence's first token)
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer: ``decode`` (pagedllm's
    ``Tokenizer``, a transformers tokenizer and a ``tokenizers.Tokenizer`` all have it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


def fast_backend(tokenizer: Decoder) -> FastTokenizer | None:
    """The ``tokenizers.Tokenizer`` that decodes for ``tokenizer``, or None if it has none.

    Takes a ``tokenizers.Tokenizer`` as is, and the ``backend_tokenizer`` of a
    transformers tokenizer or of pagedllm's ``Tokenizer`` (else of the
    transformers tokenizer it wraps, ``.hf``). transformers' ``decode`` is this backend's
    decode followed by its optional clean-up of spaces before punctuation
    (which it skips for BPE models); the stream does not apply that clean-up.
    """
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' and pagedllm's tokenizers
    if isinstance(backend, FastTokenizer):
        return backend
    hf = getattr(tokenizer, "hf", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    return backend if isinstance(backend, FastTokenizer) else None


class _StreamState:
    """A sequence's ``DecodeStream`` and what it was built for (a mismatch rebuilds it)."""

    __slots__ = ("stream", "tokenizer", "backend", "skip_special_tokens", "num_fed", "read_offset")

    def __init__(self, stream: DecodeStream, tokenizer: Decoder, backend: FastTokenizer, skip_special_tokens: bool,
                 num_fed: int, read_offset: int) -> None:
        self.stream = stream
        self.tokenizer = tokenizer  # the object the caller passes, checked by identity
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.num_fed = num_fed  # output tokens given to the stream (the pending ones included)
        self.read_offset = read_offset  # the sequence's read_offset when last seen


def detokenize_incrementally(tokenizer: Decoder, seq: Sequence, skip_special_tokens: bool) -> str:
    """Append the text of ``seq``'s newest tokens to ``seq.output_text``; return the delta.

    The delta is empty while the newest tokens end in an unfinished character
    (or add no text, as a skipped special token); the text comes with the token
    that completes it. Concatenated, the deltas are the decode of the output
    tokens in the context of the prompt's last tokens. A tokenizer without a
    Rust (``tokenizers``) backend is decoded in Python instead (``_decode_window``).
    """
    num_out = len(seq.token_ids) - seq.num_prompt_tokens
    state = seq.detok_state  # a fork starts with None and builds its own
    if (state is None or state.tokenizer is not tokenizer or state.skip_special_tokens != skip_special_tokens
            or state.read_offset != seq.read_offset or state.num_fed > num_out):
        backend = fast_backend(tokenizer)
        if backend is None:
            return _decode_window(tokenizer, seq, skip_special_tokens)
        state = _open_stream(tokenizer, backend, seq, skip_special_tokens)
        seq.detok_state = state
    if state.num_fed == num_out:
        return ""
    # one new token is the usual case: no list to build
    if num_out - state.num_fed == 1:
        new: int | list[int] = seq.token_ids[-1]
    else:
        new = seq.token_ids[seq.num_prompt_tokens + state.num_fed :]
    try:
        delta = state.stream.step(state.backend, new)
    except Exception as e:
        # tokenizers raises a bare Exception when the window's text no longer
        # starts with what it emitted (a decoder that rewrites earlier text);
        # start over from the emitted point, without context, as vLLM does
        if "Invalid prefix" not in str(e):
            raise
        logger.warning("detokenizing sequence %s: %s; restarting its stream", seq.seq_id, e)
        seq.prefix_offset = seq.read_offset
        state = _open_stream(tokenizer, state.backend, seq, skip_special_tokens, with_context=False)
        seq.detok_state = state
        delta = state.stream.step(state.backend, seq.token_ids[seq.num_prompt_tokens + seq.read_offset :])
    state.num_fed = num_out
    if not delta:
        return ""
    seq.output_text += delta
    # the stream's window now starts where this delta did
    seq.prefix_offset = seq.read_offset
    seq.read_offset = state.read_offset = num_out
    return delta


def _open_stream(
    tokenizer: Decoder, backend: FastTokenizer, seq: Sequence, skip_special_tokens: bool, with_context: bool = True
) -> _StreamState:
    """A stream in the state ``seq``'s offsets describe: primed with the window's tokens up to ``read_offset``.

    Its first step decodes the window (the text already emitted) as the
    prefix, as a stream that had run all along would hold it. The tokens past
    ``read_offset`` are left for the caller to feed. Before any text, the window
    is the prompt's last tokens unless ``with_context`` is false.
    """
    start = seq.num_prompt_tokens
    if with_context and seq.read_offset == 0 and seq.prefix_offset == 0:
        seq.prefix_offset = -min(_CONTEXT_TOKENS, start)
    prime = seq.token_ids[start + seq.prefix_offset : start + seq.read_offset]
    if prime and backend.decode(prime, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        # a prompt cut inside a character (or one ending in U+FFFD itself):
        # DecodeStream would count the primed text as not yet emitted and
        # return it with the first delta, so the output goes without context
        seq.prefix_offset = seq.read_offset
        prime = []
    stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
    return _StreamState(stream, tokenizer, backend, skip_special_tokens, seq.read_offset, seq.read_offset)


def _decode_window(tokenizer: Decoder, seq: Sequence, skip_special_tokens: bool) -> str:
    """The fallback for a tokenizer with no ``tokenizers`` backend (transformers' Python
    or SentencePiece ones): the window is decoded twice per step, with and without
    the tokens past ``read_offset``, and the new suffix kept unless it ends in U+FFFD."""
    num_out = len(seq.token_ids) - seq.num_prompt_tokens
    if seq.read_offset == 0 and seq.prefix_offset == 0:
        seq.prefix_offset = -min(_CONTEXT_TOKENS, seq.num_prompt_tokens)
    ids = seq.token_ids[seq.num_prompt_tokens + seq.prefix_offset :]
    read = seq.read_offset - seq.prefix_offset
    prefix_text = tokenizer.decode(ids[:read], skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    delta = full_text[len(prefix_text) :]
    seq.output_text += delta
    seq.prefix_offset = seq.read_offset
    seq.read_offset = num_out
    return delta
