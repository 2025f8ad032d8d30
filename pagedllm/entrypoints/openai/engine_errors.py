"""What an engine client (``engine/protocol.py``) raises, as the server's HTTP answers (``APIError``).

The clients know no HTTP: they raise the protocol's errors (and the
engine's own ``ContextLengthError`` / ValueError for a prompt it rejects);
this module is the one place that turns them into statuses, OpenAI error
types and codes.
"""

from __future__ import annotations

import logging

import jinja2

from pagedllm.engine.inputs import ContextLengthError
from pagedllm.engine.protocol import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    TooManyPromptsError,
)
from pagedllm.entrypoints.openai.protocol import APIError, bad_request

logger = logging.getLogger(__name__)


def server_error(message: str) -> APIError:
    """A 500 ``server_error``."""
    return APIError(500, message, "server_error", "internal_error")


def engine_failure(e: EngineStepError | EngineDeadError) -> APIError:
    """500 for a failed step, 503 for a server that is stopping."""
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", "engine_unavailable")
    return server_error(str(e))


# sampling fields checked against the vocabulary and tokenizer when the engine adds the request;
# their errors start with the field's name
_ENGINE_CHECKED_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens")


def to_api_error(e: BaseException, param: str | None = None) -> APIError:
    """Map what adding a request (or tokenizing) can raise to the client's error.

    ``param`` names the request field that held the prompt.
    """
    if isinstance(e, APIError):
        return e
    if isinstance(e, TooManyPromptsError):
        return bad_request(str(e), param, "too_many_prompts")
    if isinstance(e, EngineOverloadedError):
        return APIError(
            429, str(e), "rate_limit_error", "too_many_waiting_requests",
            headers={"Retry-After": str(e.retry_after)},
        )
    if isinstance(e, ContextLengthError):
        return bad_request(str(e), param, "context_length_exceeded")
    if isinstance(e, ValueError) and str(e).split(" ", 1)[0] in _ENGINE_CHECKED_FIELDS:
        return bad_request(str(e), str(e).split(" ", 1)[0])
    if isinstance(e, (ValueError, jinja2.TemplateError)):
        return bad_request(str(e), param)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", "engine_unavailable")
    logger.error("request failed: %r", e)
    return server_error(f"the request failed: {type(e).__name__}: {e}")
