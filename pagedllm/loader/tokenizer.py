"""The tokenizer, its EOS ids and its chat template.

A GGUF file's byte-level BPE tokenizer is built with ``tokenizers`` from the
metadata the loader parsed (``gguf_tokenizer.py``), without importing
transformers; the transformers tokenizer that ``Tokenizer.hf`` hands out is
made from it on first use. Other GGUF tokenizers are converted by
transformers (cached on disk); a model folder's is loaded by transformers.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as FastTokenizer

from pagedllm.cache_dir import cache_root
from pagedllm.loader.gguf_tokenizer import GGUFTokenizer, build_gguf_tokenizer
from pagedllm.sampling_params import check_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def gguf_tokenizer_cache(path: str) -> Path:
    """Where the tokenizer converted from GGUF file ``path`` is kept: a folder named by the file's path, size,
    modification time and the transformers version that converted it (any change is a miss)."""
    import transformers

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
    from transformers import AutoTokenizer

    cached = gguf_tokenizer_cache(path)
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError) as e:
            logger.warning("tokenizer cache %s unreadable (%s); converting %s again", cached, e, path)
            shutil.rmtree(cached, ignore_errors=True)  # replaced below
    tok = _convert_gguf_tokenizer(path)
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


# GGUF architectures whose metadata transformers' AutoTokenizer cannot turn into a model config (it builds one
# before the tokenizer): Gemma 4's per-layer kv-head counts (26B-A4B) fail its config's validation
_TOKENIZER_WITHOUT_CONFIG = ("gemma4",)


def _convert_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """transformers' conversion of the file's tokenizer; for ``_TOKENIZER_WITHOUT_CONFIG`` architectures the
    same conversion without the model config AutoTokenizer would build first."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from pagedllm.loader import gguf_loader

    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    arch = gguf_loader.metadata(gguf_loader.open_reader(path)).get("general.architecture")
    if arch in _TOKENIZER_WITHOUT_CONFIG:
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _gguf_native(path: str) -> GGUFTokenizer | None:
    """The file's tokenizer built without transformers, or None where only transformers converts it."""
    from pagedllm.loader import gguf_loader

    return build_gguf_tokenizer(gguf_loader.metadata(gguf_loader.open_reader(path)))


def _hf_from_native(native: GGUFTokenizer) -> PreTrainedTokenizerBase:
    """A transformers tokenizer over (a copy of) the native backend, with the same specials and template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=native.backend, chat_template=native.chat_template, add_bos_token=native.add_bos_token,
        add_eos_token=native.add_eos_token, clean_up_tokenization_spaces=False, **native.special_tokens,
    )


# what the template renderer passes itself; chat_template_kwargs may not name them (nor the model's
# special tokens: TEMPLATE_RESERVED_NAMES adds transformers' names of them, for the server's schema)
_RENDERER_NAMES = frozenset({
    "messages", "conversation", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "return_assistant_tokens_mask", "tokenize", "return_dict", "tokenizer_kwargs",
})
TEMPLATE_RESERVED_NAMES = _RENDERER_NAMES | {
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
}


class Tokenizer:
    """A tokenizer with what the engine needs from it.

    Loads from a model folder or, for a ``.gguf`` file, from the vocabulary,
    merges and chat template stored in the GGUF metadata. ``backend`` is the
    ``tokenizers.Tokenizer`` that encodes and decodes; ``hf`` the
    transformers tokenizer (for a GGUF file's byte-level BPE tokenizer, made
    on first use: encoding, decoding and chat templates never need it).
    """

    def __init__(self, path: str, extra_eos_token_ids: tuple[int, ...] = ()) -> None:
        self._native = _gguf_native(path) if path.endswith(".gguf") else None
        if self._native is not None:
            self.backend: FastTokenizer | None = self._native.backend
            self.chat_template: str | None = self._native.chat_template
            self.special_tokens: dict[str, str] = dict(self._native.special_tokens)
            eos_id = self._native.eos_token_id
        else:
            from transformers import AutoTokenizer

            hf = load_gguf_tokenizer(path) if path.endswith(".gguf") else AutoTokenizer.from_pretrained(path)
            self.__dict__["hf"] = hf  # the cached_property's slot
            self.backend = getattr(hf, "backend_tokenizer", None)  # None for a tokenizer in Python
            self.chat_template = getattr(hf, "chat_template", None)
            self.special_tokens = dict(hf.special_tokens_map)
            eos_id = hf.eos_token_id
        eos = set(extra_eos_token_ids)
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.eos_token_id: int | None = eos_id
        self.vocab_size: int = (len(self.hf) if self._native is None
                                else self.backend.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def hf(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer (imports transformers; built once, on first use, for a GGUF file)."""
        if self._native is None:  # a model folder's (or a converted GGUF's) tokenizer is set in __init__
            raise RuntimeError("Tokenizer.hf: no transformers tokenizer was loaded and none can be built")
        return _hf_from_native(self._native)

    @property
    def backend_tokenizer(self) -> FastTokenizer | None:
        """The ``tokenizers.Tokenizer`` (the name transformers' fast tokenizers give it)."""
        return self.backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the BOS (etc.) a prompt starts with."""
        if self._native is None:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._native is None:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render a conversation to the prompt text the model was tuned on.

        ``chat_template_kwargs``: more variables for the template (Qwen3's
        ``enable_thinking``...), as vLLM's; one that names what the renderer
        sets itself (``messages``, ``tools``, a special token) is a ValueError.

        ``tools``: function tools in OpenAI's form (``{"type": "function",
        "function": {...}}``), for templates that list them; messages may
        then carry ``tool_calls`` and ``tool_call_id`` as
        ``entrypoints.openai.tool_messages.to_template_messages`` makes them.
        """
        if chat_template is None and not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template= (LLM.chat) or start "
                             "the server with --chat-template FILE")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
        if not messages:
            raise ValueError("messages must not be empty")
        for i, m in enumerate(messages):
            check_text(f"messages[{i}].content", m["content"])
        extra = self._template_kwargs(chat_template_kwargs)
        if self._native is None:
            return self.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, **extra,
            )
        # transformers' renderer (its sandboxed jinja environment and filters), without its tokenizer classes
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            conversations=[messages], tools=tools, documents=None, chat_template=chat_template or self.chat_template,
            add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra,
        )
        return rendered[0]

    def _template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """``chat_template_kwargs`` checked: a dict of variables with names the renderer does not set itself."""
        if kwargs is None:
            return {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise ValueError("chat_template_kwargs must be a dict of template variable names to values")
        taken = sorted(set(kwargs) & (TEMPLATE_RESERVED_NAMES | set(self.special_tokens)))
        if taken:
            # the renderer passes these itself; a second value would be a TypeError or silently win
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the chat template gets them "
                             "from the request itself")
        return dict(kwargs)

    def set_chat_template(self, chat_template: str) -> None:
        """Use ``chat_template`` (Jinja text) for every conversation from now on (``pagedllm serve --chat-template``)."""
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise ValueError("chat_template must be non-empty Jinja text")
        self.chat_template = chat_template
        if self._native is not None:
            self._native.chat_template = chat_template
        if self._native is None or "hf" in self.__dict__:
            self.hf.chat_template = chat_template
