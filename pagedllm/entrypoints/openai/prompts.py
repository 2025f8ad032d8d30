"""Request prompts turned into (text, token ids), off the engine thread.

Text goes to the server's tokenizer process (``tokenizer_worker.py``), so
no prompt's size delays another request's next token; chat templates
render on a worker thread of this process.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedllm.engine.inputs import check_prompt_text, truncate_prompt
from pagedllm.engine.protocol import EngineView, Prompt
from pagedllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from pagedllm.sampling_params import SamplingParams


class PromptEncoder:
    """Turns request prompts into (text, token ids) off the engine thread.

    Text goes to the tokenizer process (``tokenizer_worker.py``); a prompt
    that cannot fit in the context is refused from its token count. The
    rules are the engine's own (``engine/inputs.py``), applied here before a
    request is queued. Chat
    templates render on a worker thread of this process.
    """

    def __init__(self, engine: EngineView, worker: TokenizerWorker) -> None:
        self.engine = engine  # only its configuration and chat template are read here
        self.worker = worker

    async def text(self, text: str, params: SamplingParams | None, add_special_tokens: bool = True) -> Prompt:
        """A text prompt, tokenized; ValueError (ContextLengthError) when it is empty or too long.

        With ``truncate_prompt_tokens`` the whole text is tokenized and its
        last k tokens kept, so a longer text may still fit.
        """
        check_prompt_text(text)
        keep = params.truncate_prompt_tokens if params is not None else None
        limit = self.engine.config.max_model_len if keep is None else None
        count, ids = await self.worker.encode(text, add_special_tokens, limit=limit)
        if keep is not None and ids is not None:
            ids = truncate_prompt(ids, params)
            count = len(ids)
        self.engine.check_prompt_len(count, params)
        if not ids:
            raise ValueError("the prompt is empty")
        return text, ids

    async def token_ids(self, ids: list[int], params: SamplingParams) -> Prompt:
        """A prompt given as token ids (checked against the vocabulary on the engine thread)."""
        ids = truncate_prompt(list(ids), params)
        self.engine.check_prompt_len(len(ids), params)
        return None, ids

    async def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation (and the tools the model may call) through the model's chat template, with the
        request's ``chat_template_kwargs`` as more template variables."""
        render = self.engine.tokenizer.apply_chat_template
        return await asyncio.to_thread(render, messages, add_generation_prompt, tools=tools,
                                       chat_template_kwargs=chat_template_kwargs)

    async def chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, params: SamplingParams,
        tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        """A conversation, rendered and tokenized (the template holds its own special tokens)."""
        text = await self.render_chat(messages, add_generation_prompt, tools, chat_template_kwargs)
        return await self.text(text, params, add_special_tokens=False)
