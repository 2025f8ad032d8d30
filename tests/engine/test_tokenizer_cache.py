"""The tokenizer of a GGUF file: converted by transformers once, then loaded from pagedllm's cache.

The oracle is transformers' own conversion of the file's metadata
(``AutoTokenizer.from_pretrained(..., gguf_file=...)``): the cached tokenizer
must encode, decode and render chats exactly as it does.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedllm.loader.tokenizer import Tokenizer, gguf_tokenizer_cache

TEXTS = [
    "Hello world!",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "ünïcödé, 中文, emoji 🙂 and   runs of  spaces\t\ttabs\n\nnewlines",
    "def f(x):\n    return x ** 2  # code",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def converted(smollm_path: str):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))


def _assert_same(tok: Tokenizer, converted) -> None:  # noqa: ANN001
    for text in TEXTS:
        ids = converted.encode(text)
        assert tok.encode(text) == ids
        assert tok.decode(ids, skip_special_tokens=False) == converted.decode(ids, skip_special_tokens=False)
    assert tok.apply_chat_template(CHAT) == converted.apply_chat_template(CHAT, tokenize=False,
                                                                         add_generation_prompt=True)
    assert tok.vocab_size == len(converted) and tok.hf.eos_token_id == converted.eos_token_id


def test_a_gguf_tokenizer_is_converted_once_then_loaded_from_the_cache(
    smollm_path: str, converted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    cached = gguf_tokenizer_cache(smollm_path)
    assert cached.parent == tmp_path / "tokenizers" and not cached.exists()
    first = Tokenizer(smollm_path)
    assert (cached / "tokenizer.json").is_file()
    _assert_same(first, converted)
    second = Tokenizer(smollm_path)  # from the cache now
    assert second.hf is not first.hf
    _assert_same(second, converted)
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # no staging folder left behind


def test_a_changed_file_misses_the_cache(smollm_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copyfile(smollm_path, copy)
    before = gguf_tokenizer_cache(str(copy))
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))  # rewritten, as far as the cache can tell
    assert gguf_tokenizer_cache(str(copy)) != before
    assert gguf_tokenizer_cache(str(copy)) != gguf_tokenizer_cache(smollm_path)


@pytest.mark.slow
def test_an_unusable_cache_falls_back_to_converting(
    smollm_path: str, converted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a file where the cache folder would go: nothing can be written, the tokenizer still loads
    (tmp_path / "blocked").write_text("not a folder")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "blocked"))
    _assert_same(Tokenizer(smollm_path), converted)
    # a damaged cache entry: a warning, then the file is converted again
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    cached = gguf_tokenizer_cache(smollm_path)
    cached.mkdir(parents=True)
    (cached / "tokenizer_config.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="pagedllm.loader.tokenizer"):
        tok = Tokenizer(smollm_path)
    assert "unreadable" in caplog.text
    _assert_same(tok, converted)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm.loader.tokenizer"):
        tok = Tokenizer(smollm_path)  # the entry was replaced by the new conversion
    assert "unreadable" not in caplog.text
    _assert_same(tok, converted)
