"""Incremental detokenization: text grows by the delta of each new token.

Decoding one token alone breaks multi-byte characters and the spaces that
BPE tokenizers attach to the next word, so each step decodes a short window
of recent tokens twice (with and without the new ones) and keeps the new
suffix. A window ending in U+FFFD is an incomplete character: wait.
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.engine.sequence import Sequence

# tokens before the window that give the decoder its context
_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


def detokenize_incrementally(tokenizer: Decoder, seq: Sequence, skip_special_tokens: bool) -> str:
    """Append the text of ``seq``'s newest tokens to ``seq.output_text``; return the delta."""
    out = seq.output_token_ids
    if seq.read_offset == 0 and seq.prefix_offset == 0 and len(out) == 1:
        # start the window on the prompt's last tokens for the leading-space context
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
    seq.read_offset = len(out)
    return delta
