"""A GGUF file's byte-level BPE tokenizer built with ``tokenizers`` alone, from the metadata already parsed.

transformers builds the same tokenizer (``AutoTokenizer.from_pretrained(...,
gguf_file=...)``) but parses the file again and imports itself to do it:
seconds of a cold start. For ``tokenizer.ggml.model == "gpt2"`` (SmolLM2,
Llama 3, Qwen2/3 files) this module builds what its conversion builds
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``): a BPE over
the vocabulary in GPT-2's byte alphabet with the file's merges, the
pre-tokenizer split its ``tokenizer.ggml.pre`` names (GPT-2's ByteLevel
regex otherwise), the ByteLevel decoder, control tokens (type 3) added as
special and user-defined ones (type 4) as plain added tokens, and BOS/EOS
added as ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say. Other
tokenizer models (SentencePiece ``llama``, ``t5``, ...) return None: the
caller converts them with transformers. ``tests/engine/test_tokenizer_cache.py``
checks ids, text and chats against transformers' conversion.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

# tokenizer.ggml.pre -> the split regex transformers' conversion applies before the byte-level mapping
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

_SPECIAL_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                 "pad_token": "padding_token_id"}


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (``bytes_to_unicode``)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@dataclass
class GGUFTokenizer:
    """What a GGUF file's tokenizer is: the backend and what transformers would hold beside it."""

    backend: Tokenizer
    special_tokens: dict[str, str]  # bos_token, eos_token, unk_token, pad_token: those the file names
    eos_token_id: int | None
    chat_template: str | None
    add_bos_token: bool
    add_eos_token: bool


def build_gguf_tokenizer(metadata: Any) -> GGUFTokenizer | None:  # noqa: ANN401 (a mapping key -> value)
    """The tokenizer of a GGUF file's ``metadata`` (``key -> value``, as ``gguf_loader.metadata`` gives it).

    None when its tokenizer model is not byte-level BPE (``gpt2``) with merges.
    """
    if metadata.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.merges" not in metadata:
        return None
    pre = metadata.get("tokenizer.ggml.pre")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or ())
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:  # a token written as plain text: respelled in the byte alphabet
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()

    special = {name: tokens[int(metadata[f"tokenizer.ggml.{key}"])] for name, key in _SPECIAL_KEYS.items()
               if metadata.get(f"tokenizer.ggml.{key}") is not None}
    # the named special tokens first (transformers adds them when the tokenizer is made), then the control ones
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
               if kind == _CONTROL and set(t) <= alphabet]  # a control token outside the alphabet is a mislabel
    if control:
        backend.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
            if kind == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)

    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    ids = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
    eos_id = None if eos is None else backend.token_to_id(eos)
    return GGUFTokenizer(backend, special, eos_id, metadata.get("tokenizer.chat_template"), add_bos, add_eos)
