"""The tokens that end generation in a GGUF file: its EOS, its end-of-turn (EOT) and end-of-message (EOM)
tokens, and the end-of-turn control tokens of the common chat formats.

A Hugging Face folder lists them in ``generation_config.json``'s ``eos_token_id`` (Llama 3.1:
``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``; Gemma 3: ``<eos>``, ``<end_of_turn>``), which
``model_config.py`` reads. A GGUF file has one ``tokenizer.ggml.eos_token_id``, and llama.cpp's
converter writes ``eot_token_id`` / ``eom_token_id`` only for some families: a Gemma 3 file names
``<eos>`` alone, a Llama 3 base model's ``<|end_of_text|>`` alone, though their chat templates end
each turn with ``<end_of_turn>`` / ``<|eot_id|>``. llama.cpp ends generation at those by their text
as well (every control token spelt as a known end of turn); so does this module, so that a GGUF
file stops where the same file stops in llama.cpp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the metadata keys naming end tokens by id
END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# control tokens that end a turn or a message in the chat formats of the families people run: Llama 3
# (eot, eom, end_of_text), Gemma, ChatML (Qwen, SmolLM), GPT-2-style <|endoftext|>, Phi-3/4 (<|end|>),
# gpt-oss (<|return|>, <|call|>), CodeLlama infill (<EOT>), SmolVLM (<end_of_utterance>)
END_OF_TURN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>", "<|im_end|>",
                     "<|endoftext|>", "<|end|>", "<|return|>", "<|call|>", "<EOT>", "<end_of_utterance>")
# llama.cpp's token types of special tokens: control and user-defined (a "normal" token spelt so is text)
_SPECIAL_TYPES = (3, 4)


def gguf_end_token_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """Every token id that ends generation in a GGUF file with this metadata, ascending.

    The ids the metadata names (``END_TOKEN_KEYS``), and the special tokens
    (control or user-defined) of the vocabulary whose text is one of
    ``END_OF_TURN_TEXTS``.
    """
    ids = {int(metadata[k]) for k in END_TOKEN_KEYS if metadata.get(k) is not None}
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type")
    # which texts the vocabulary has, by hashing it once (C speed), then where each is
    for text in sorted(set(END_OF_TURN_TEXTS).intersection(tokens)):
        index = tokens.index(text)
        if types is None or types[index] in _SPECIAL_TYPES:
            ids.add(index)
    return tuple(sorted(ids))
