"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, vLLM's extra routes.

The first two run in the tokenizer process. The third describes the
tokenizer (special tokens, chat template), so a client such as
lm-evaluation-harness (``tokenizer_backend=remote``) can tokenize through
this server without a copy of the tokenizer.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response

from pagedllm.entrypoints.openai.engine_errors import to_api_error
from pagedllm.entrypoints.openai.prompts import PromptEncoder
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    template_messages,
)
from pagedllm.entrypoints.openai.serving_engine import check_model
from pagedllm.entrypoints.openai.tokenizer_worker import TokenizerWorker
from pagedllm.sampling_params import check_text


class OpenAIServingTokenization:
    """Tokenize a prompt or a rendered conversation; detokenize ids.

    Args:
        prompts: the prompt encoder (for the chat template).
        tokenizer: the tokenizer process.
        model_name: the served model's name.
        max_model_len: the context length, reported with every count.
        vocab_size: ids at or past it are refused.
    """

    def __init__(
        self, prompts: PromptEncoder, tokenizer: TokenizerWorker, model_name: str, max_model_len: int,
        vocab_size: int,
    ) -> None:
        hf = prompts.engine.tokenizer.hf
        template = getattr(hf, "chat_template", None)
        self.info = {
            "tokenizer_class": type(hf).__name__,
            "eos_token": hf.eos_token, "bos_token": hf.bos_token, "pad_token": hf.pad_token,
            "chat_template": template if isinstance(template, str) else None,
            "model_max_length": max_model_len, "vocab_size": vocab_size,
        }
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.served_names: tuple[str, ...] = (model_name,)  # the app adds --served-model-name's others
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    async def tokenize(self, req: TokenizeRequest) -> Response:
        """The token ids (and, if asked, their strings) of a prompt or conversation."""
        check_model(req.model, self.served_names)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        try:
            if req.messages is not None:  # never empty: the model says minItems 1
                messages = template_messages(req.messages)
                text = await self.prompts.render_chat(messages, req.add_generation_prompt,
                                                      chat_template_kwargs=req.chat_template_kwargs)
                add_special = bool(req.add_special_tokens)  # the template holds its own
            else:
                text = req.prompt or ""
                add_special = req.add_special_tokens is not False
            check_text("the prompt", text)
            count, ids_json, strs_json = await self.tokenizer.tokenize_json(text, add_special, req.return_token_strs)
        except Exception as e:
            raise to_api_error(e, "messages" if req.messages is not None else "prompt") from e
        # the id list is serialised in the tokenizer process: no long JSON encode here
        body = b'{"count": %d, "max_model_len": %d, "tokens": %s, "token_strs": %s}' % (
            count, self.max_model_len, ids_json, strs_json
        )
        return Response(body, media_type="application/json")

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's class, special tokens, chat template and the context length."""
        return self.info

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """The text of a list of token ids."""
        check_model(req.model, self.served_names)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "tokens")
        try:
            text = await self.tokenizer.decode(req.tokens)
        except Exception as e:
            raise to_api_error(e, "tokens") from e
        return {"prompt": text}
