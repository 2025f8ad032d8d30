"""The tokenizer, its EOS ids and its chat template."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm.cache_dir import cache_root
from pagedllm.sampling_params import check_text

logger = logging.getLogger(__name__)


def gguf_tokenizer_cache(path: str) -> Path:
    """Where the tokenizer converted from GGUF file ``path`` is kept: a folder named by the file's path, size,
    modification time and the transformers version that converted it (any change is a miss)."""
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer stored in a GGUF file's metadata (vocabulary, merges, chat template).

    transformers converts it in seconds (3.8 s for a 49k vocabulary); the
    converted tokenizer is saved once (``gguf_tokenizer_cache``) and loaded
    from there in a quarter of a second afterwards. A cache that cannot be
    written or read is skipped: the file is converted again.
    """
    cached = gguf_tokenizer_cache(path)
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError) as e:
            logger.warning("tokenizer cache %s unreadable (%s); converting %s again", cached, e, path)
            shutil.rmtree(cached, ignore_errors=True)  # replaced below
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=cached.parent)  # written whole, then renamed: readers never see a part
        tok.save_pretrained(staging)
        try:
            os.rename(staging, cached)
        except OSError:  # another process put it there first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:
        logger.debug("tokenizer of %s not cached: %s", path, e)
    return tok


class Tokenizer:
    """A Hugging Face tokenizer with what the engine needs from it.

    Loads from a model folder or, for a ``.gguf`` file, from the vocabulary,
    merges and chat template stored in the GGUF metadata.
    """

    def __init__(self, path: str, extra_eos_token_ids: tuple[int, ...] = ()) -> None:
        if path.endswith(".gguf"):
            self.hf = load_gguf_tokenizer(path)
        else:
            self.hf = AutoTokenizer.from_pretrained(path)
        eos = set(extra_eos_token_ids)
        if self.hf.eos_token_id is not None:
            eos.add(self.hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the BOS (etc.) a prompt starts with."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render a conversation to the prompt text the model was tuned on.

        ``tools``: function tools in OpenAI's form (``{"type": "function",
        "function": {...}}``), for templates that list them; messages may
        then carry ``tool_calls`` and ``tool_call_id`` as
        ``entrypoints.openai.tool_messages.to_template_messages`` makes them.
        """
        if chat_template is None and not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
        if not messages:
            raise ValueError("messages must not be empty")
        for i, m in enumerate(messages):
            check_text(f"messages[{i}].content", m["content"])
        return self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
        )
