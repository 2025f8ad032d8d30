"""The incremental detokenizer (``tokenizers``' DecodeStream) against decoding the whole output at once.

Fed token by token, the deltas must add up to ``decode(output_ids)``: for text
with multi-byte characters split over byte-level tokens, for random ids (bytes
that form no character), with and without a prompt before them, with special
tokens kept or skipped. The one allowed difference: an output that ends inside
a character keeps that unfinished character back, as it would mid-stream.

Tokenizers: the bundled GGUF's (as the engine loads it), the same saved as a
Hugging Face folder, its bare ``tokenizers.Tokenizer``, one with no Rust
backend (the Python fallback), and a small SentencePiece-style one (byte
fallback, a decoder that strips the first token's leading space) trained here.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pagedllm.engine.detokenizer import detokenize_incrementally, fast_backend
from pagedllm.engine.sequence import Sequence
from pagedllm.loader import bundled_model_path
from pagedllm.loader.tokenizer import Tokenizer

TEXTS = [
    "héllo wörld 你好 🙂🎉 done",
    "日本語のテキスト",
    " 🙂x",
    "👩‍👩‍👧 family, 🇫🇷 flag",
    "Ærøskøbing, São Paulo, Kraków, naïve café",
    "  spaces\n\n tabs\t x",
    "a<|im_end|>b<|im_start|> c",
]
PROMPTS = ["", "Say:", "<|im_start|>assistant\n", "数字"]
# the bundled tokenizer's added tokens (<|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>...)
NUM_ADDED = 17

Decode = Callable[[list[int], bool], str]


class PythonOnly:
    """A tokenizer with ``decode`` and nothing the detokenizer can take a Rust backend from."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def gguf_tok() -> Tokenizer:
    return Tokenizer(bundled_model_path())


@pytest.fixture(scope="module")
def folder_tok(gguf_tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The bundled tokenizer saved as a Hugging Face folder (as tests/conftest.py saves it beside tiny models)."""
    path = tmp_path_factory.mktemp("hf-tokenizer")
    gguf_tok.hf.save_pretrained(path)
    return Tokenizer(str(path))


@pytest.fixture(scope="module")
def tokenizers(gguf_tok: Tokenizer, folder_tok: Tokenizer) -> dict[str, object]:
    return {"gguf": gguf_tok, "folder": folder_tok, "bare": gguf_tok.hf.backend_tokenizer,
            "python": PythonOnly(gguf_tok)}


@pytest.fixture(scope="module")
def spm_tok() -> FastTokenizer:
    """A Llama-2-style tokenizer: BPE on "▁"-marked words, byte fallback, the decoder strips one leading space."""
    tok = FastTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, say something", "done and done"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    # the byte tokens are ordinary vocabulary, as in Llama's (not special: skip_special_tokens keeps them)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    first = len(vocab)
    vocab.update({f"<0x{b:02X}>": first + b for b in range(256)})
    return FastTokenizer.from_str(json.dumps(spec))


def stream(tokenizer: object, prompt_ids: list[int], output_ids: list[int], skip: bool) -> tuple[list[str], Sequence]:
    """The deltas of ``output_ids`` fed one at a time after ``prompt_ids``, and the sequence."""
    seq = Sequence(prompt_ids, block_size=16)
    deltas = []
    for t in output_ids:
        seq.append_token(t)
        deltas.append(detokenize_incrementally(tokenizer, seq, skip))
    return deltas, seq


def assert_streams_whole_text(tokenizer: object, decode: Decode, prompt_ids: list[int], output_ids: list[int],
                              skip: bool) -> None:
    deltas, seq = stream(tokenizer, prompt_ids, output_ids, skip)
    text = "".join(deltas)
    assert text == seq.output_text
    whole = decode(output_ids, skip)
    if not whole.endswith("\ufffd"):
        assert text == whole
    else:
        # the unfinished character at the end is held back: the tokens after
        # read_offset decode to it, and everything before was streamed
        held = decode(output_ids[seq.read_offset :], skip)
        assert held.endswith("\ufffd")
        assert text + held == whole


def decode_of(tokenizer: object) -> Decode:
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("kind", ["gguf", "folder", "bare", "python"])
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_multibyte_text_streams_as_decoded(tokenizers: dict, gguf_tok: Tokenizer, kind: str, skip: bool,
                                           prompt: str) -> None:
    tokenizer = tokenizers[kind]
    prompt_ids = gguf_tok.encode(prompt, add_special_tokens=False)
    for text in TEXTS:
        ids = gguf_tok.encode(text, add_special_tokens=False)
        deltas, seq = stream(tokenizer, prompt_ids, ids, skip)
        # never half a character
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == seq.output_text == gguf_tok.decode(ids, skip_special_tokens=skip)
        assert seq.read_offset == len(ids)


def test_byte_tokens_wait_for_the_whole_character(gguf_tok: Tokenizer) -> None:
    ids = gguf_tok.encode(" 你好", add_special_tokens=False)
    assert len(ids) > 2, "the characters should be split over byte tokens"
    deltas, _ = stream(gguf_tok, gguf_tok.encode("Say:"), ids, True)
    assert "" in deltas  # a token that ends inside a character adds nothing yet
    assert [d for d in deltas if d] == [" ", "你", "好"]


@pytest.mark.parametrize("kind", ["gguf", "bare"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 49151), max_size=8),
    output=st.lists(st.one_of(st.integers(0, 49151), st.integers(0, NUM_ADDED - 1)), max_size=40),
    skip=st.booleans(),
)
def test_random_ids_stream_as_decoded(tokenizers: dict, kind: str, prompt: list[int], output: list[int],
                                      skip: bool) -> None:
    # byte-level BPE: random ids cut characters anywhere, or form none at all
    tokenizer = tokenizers[kind]
    assert_streams_whole_text(tokenizer, decode_of(tokenizer), prompt, output, skip)


def test_the_python_fallback_streams_random_ids_as_decoded(tokenizers: dict) -> None:
    # a fixed sample: the fallback decodes twice per token in Python, too slow to fuzz here
    rng = random.Random(7)
    tokenizer = tokenizers["python"]
    for _ in range(30):
        prompt = [rng.randrange(49152) for _ in range(rng.randrange(6))]
        output = [rng.randrange(49152) if rng.random() < 0.9 else rng.randrange(NUM_ADDED) for _ in range(30)]
        assert_streams_whole_text(tokenizer, decode_of(tokenizer), prompt, output, rng.random() < 0.5)


def test_backends_are_found(tokenizers: dict) -> None:
    for kind in ("gguf", "folder", "bare"):
        assert isinstance(fast_backend(tokenizers[kind]), FastTokenizer), kind
    assert fast_backend(tokenizers["python"]) is None


def test_a_fork_continues_its_parents_text(gguf_tok: Tokenizer) -> None:
    # forked while a character is unfinished: the child rebuilds its stream from the offsets
    ids = gguf_tok.encode(" 你好 🙂 world", add_special_tokens=False)
    prompt = gguf_tok.encode("Say:")
    for cut in range(1, len(ids)):
        _, parent = stream(gguf_tok, prompt, ids[:cut], True)
        child = parent.fork(1)
        for seq in (parent, child):
            for t in ids[cut:]:
                seq.append_token(t)
                detokenize_incrementally(gguf_tok, seq, True)
            assert seq.output_text == gguf_tok.decode(ids), cut


def test_several_new_tokens_at_once(gguf_tok: Tokenizer) -> None:
    ids = gguf_tok.encode("héllo 你好 🙂🎉 done", add_special_tokens=False)
    seq = Sequence(gguf_tok.encode("Say:"), block_size=16)
    for start in range(0, len(ids), 3):
        for t in ids[start : start + 3]:
            seq.append_token(t)
        detokenize_incrementally(gguf_tok, seq, True)
    assert seq.output_text == gguf_tok.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_style_keeps_the_leading_space_after_a_prompt(spm_tok: FastTokenizer, skip: bool) -> None:
    prompt = spm_tok.encode("<s>say").ids
    for text in ("hello world", "the fox 你好 🙂 done", "ünïcode fox"):
        ids = spm_tok.encode(text).ids
        assert any(spm_tok.id_to_token(i).startswith("<0x") for i in ids) == (not text.isascii())
        # alone, the decoder strips the first token's leading space
        deltas, _ = stream(spm_tok, [], ids, skip)
        assert "".join(deltas) == spm_tok.decode(ids, skip_special_tokens=skip) == text
        # after a prompt the space belongs to the output: the text the prompt's decode grows by
        deltas, _ = stream(spm_tok, prompt, ids, skip)
        with_prompt = spm_tok.decode(prompt + ids, skip_special_tokens=skip)
        prompt_text = spm_tok.decode(prompt, skip_special_tokens=skip)
        assert "".join(deltas) == with_prompt[len(prompt_text) :] == " " + text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.one_of(st.integers(0, 10_000), st.characters(codec="utf-8")), max_size=20),
       skip=st.booleans())
def test_sentencepiece_style_byte_tokens_stream_as_decoded(spm_tok: FastTokenizer, pieces: list[int | str],
                                                           skip: bool) -> None:
    # random vocabulary tokens between whole characters spelled in byte tokens
    # (<0xE4><0xBD><0xA0>), as byte fallback encodes them. Not random byte
    # tokens: ByteFallback decodes a run of bytes that is not UTF-8 to one
    # U+FFFD per byte, valid ones before included, so a whole decode rewrites
    # text that a stream has already shown (the stream restarts, see below)
    num_words = spm_tok.token_to_id("<0x00>")
    output: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            output.append(piece % num_words)
        else:
            output.extend(spm_tok.token_to_id(f"<0x{b:02X}>") for b in piece.encode())
    assert_streams_whole_text(spm_tok, decode_of(spm_tok), [], output, skip)


def test_a_decoder_that_rewrites_earlier_text_restarts_the_stream() -> None:
    # "ab" decodes to "X": the stream emitted "a", then "Xc" no longer starts with it
    tok = FastTokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    deltas, seq = stream(tok, [], [1, 2, 3, 1], True)
    # restarted without context at the emitted point: "bc" decoded alone
    assert deltas == ["a", "", "bc", "a"]
    assert seq.output_text == "abca"


def test_a_stream_lives_on_its_sequence_and_a_fork_builds_its_own(gguf_tok: Tokenizer) -> None:
    _, seq = stream(gguf_tok, [], gguf_tok.encode("hello", add_special_tokens=False), True)
    assert seq.detok_state is not None  # dropped with the sequence: nothing else holds it
    assert seq.fork(1).detok_state is None


def test_an_invalid_byte_run_restarts_the_stream(spm_tok: FastTokenizer) -> None:
    # "\x00" is shown; <0x80> then makes the run invalid and ByteFallback
    # decodes both bytes to U+FFFD: the shown text is kept, the rest decoded anew
    nul, cont, word = spm_tok.token_to_id("<0x00>"), spm_tok.token_to_id("<0x80>"), spm_tok.token_to_id("▁the")
    deltas, seq = stream(spm_tok, [], [nul, cont, word], True)
    assert spm_tok.decode([nul, cont, word]) == "\ufffd\ufffd the"
    assert deltas[:2] == ["\x00", ""]
    assert seq.output_text == "\x00" + spm_tok.decode([cont, word])
