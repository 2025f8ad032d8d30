"""The tokenizer, its EOS ids and its chat template."""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoTokenizer

from pagedllm.sampling_params import check_text


class Tokenizer:
    """A Hugging Face tokenizer with what the engine needs from it.

    Loads from a model folder or, for a ``.gguf`` file, from the vocabulary,
    merges and chat template stored in the GGUF metadata.
    """

    def __init__(self, path: str, extra_eos_token_ids: tuple[int, ...] = ()) -> None:
        if path.endswith(".gguf"):
            self.hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
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
