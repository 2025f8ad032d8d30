"""The tokenizer of a GGUF file: built from its metadata with ``tokenizers`` (byte-level BPE), or
converted by transformers once, then loaded from pagedllm's cache (the other tokenizer models).

The oracle is transformers' own conversion of the file's metadata
(``AutoTokenizer.from_pretrained(..., gguf_file=...)``): both must encode,
decode and render chats exactly as it does. The cache tests force the
conversion path (the bundled file's tokenizer is built natively).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.loader import gguf_loader
from pagedllm.loader import tokenizer as tokenizer_module
from pagedllm.loader.tokenizer import Tokenizer, gguf_tokenizer_cache

TEXTS = [
    "Hello world!",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "ünïcödé, 中文, emoji 🙂 and   runs of  spaces\t\ttabs\n\nnewlines",
    "def f(x):\n    return x ** 2  # code",
    "  two leading spaces, trailing ones   ",
    "Hello , world . ( a ) don't I'll",  # spaces before punctuation: no clean-up on decode
    "<|endoftext|><repo_name>x<filename>y<|im_end|>",
    "👨‍👩‍👧‍👦 日本語のテキスト 한국어    \r\n\r\n",
    "12345678 3.14159 0x1F",
    "",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
CHATS = [
    CHAT,
    [{"role": "user", "content": "中文 🙂\n\n  spaced  "}, {"role": "assistant", "content": "<|im_end|> ok"},
     {"role": "user", "content": "again"}],
    [{"role": "user", "content": "no system prompt"}],
]


@pytest.fixture
def converting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizer() takes transformers' conversion (and its cache) for the bundled file too."""
    monkeypatch.setattr(tokenizer_module, "_gguf_native", lambda path: None)


@pytest.fixture(scope="module")
def converted(smollm_tokenizer):  # noqa: ANN001, ANN201
    """transformers' conversion of the bundled file's metadata (the oracle): conftest's session-wide one."""
    return smollm_tokenizer


def _assert_same(tok: Tokenizer, converted) -> None:  # noqa: ANN001
    for text in TEXTS:
        for special in (True, False):
            ids = converted.encode(text, add_special_tokens=special)
            assert tok.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == converted.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for prompt in (True, False):
            assert tok.apply_chat_template(chat, add_generation_prompt=prompt) == converted.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=prompt)
    assert tok.vocab_size == len(converted) and tok.eos_token_id == converted.eos_token_id


def test_a_gguf_bpe_tokenizer_is_built_natively_as_transformers_converts_it(smollm_path: str, converted) -> None:  # noqa: ANN001
    tok = Tokenizer(smollm_path)
    assert tok._native is not None
    _assert_same(tok, converted)
    # the same backend, to the byte: model, added tokens, pre-tokenizer, post-processor, decoder
    assert json.loads(tok.backend.to_str()) == json.loads(converted.backend_tokenizer.to_str())
    # the transformers tokenizer it hands out on demand (LLM.get_tokenizer, xgrammar, the server) agrees too
    hf = tok.hf
    assert hf is tok.hf and len(hf) == len(converted) and hf.special_tokens_map == converted.special_tokens_map
    for text in TEXTS:
        assert hf.encode(text) == converted.encode(text)
    assert hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(CHAT)


def test_the_gguf_tokenizer_loads_without_transformers(smollm_path: str, tmp_path: Path) -> None:
    # an empty cache: nothing converted earlier can be read
    code = (
        "import sys\n"
        "from pagedllm.loader.tokenizer import Tokenizer\n"
        f"tok = Tokenizer({smollm_path!r})\n"
        "ids = tok.encode('Hello, world! 🙂')\n"
        "assert tok.decode(ids) == 'Hello, world! 🙂'\n"
        "print('transformers' in sys.modules)\n"
    )
    env = {**os.environ, "PAGEDLLM_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    assert not any(tmp_path.iterdir())  # and it wrote no cache


def test_the_metadata_parse_matches_gguf(smollm_path: str) -> None:
    from gguf import GGUFReader

    ours, theirs = gguf_loader._Reader(smollm_path), GGUFReader(smollm_path)
    mine, reference = gguf_loader.metadata(ours), {k: f.contents() for k, f in theirs.fields.items()}
    assert mine == reference
    assert {k: type(v) for k, v in mine.items()} == {k: type(v) for k, v in reference.items()}
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert [(t.name, t.data_offset, t.n_bytes, int(t.tensor_type)) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes, int(t.tensor_type)) for t in theirs.tensors]


def test_a_gguf_tokenizer_is_converted_once_then_loaded_from_the_cache(
    smollm_path: str, converted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, converting: None,  # noqa: ANN001
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
    caplog: pytest.LogCaptureFixture, converting: None,
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
