"""Request bodies of the pooling routes (``serving_pooling.py``): OpenAI's embeddings, vLLM's ``/pooling``,
``/classify`` and ``/score``, Jina's ``/v1/rerank`` and Cohere's ``/v2/rerank``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import _Body

Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
EmbeddingInput = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
Texts = Text | Annotated[list[Text], Field(min_length=1)]
PositiveInt = Field(default=None, gt=0)


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings`` (OpenAI's): text, a list of texts, token ids or a list of token-id lists."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = PositiveInt
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = PositiveInt
    normalize: bool | None = None


class PoolingRequest(_Body):
    """``POST /pooling`` (vLLM's): the raw pooled hidden states, before normalisation or a head."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    truncate_prompt_tokens: int | None = PositiveInt


class ClassificationRequest(_Body):
    """``POST /classify`` (vLLM's): each input's class probabilities from a sequence-classification head."""

    model: str | None = None
    input: EmbeddingInput
    user: str | None = None
    truncate_prompt_tokens: int | None = PositiveInt


class ScoreRequest(_Body):
    """``POST /score`` (vLLM's): ``text_1`` (one query, or N) against ``text_2`` (N documents)."""

    model: str | None = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: int | None = PositiveInt


class RerankRequest(_Body):
    """``POST /v1/rerank`` (Jina's) and ``POST /v2/rerank`` (Cohere's): documents ordered by relevance."""

    model: str | None = None
    query: Text
    documents: Annotated[list[Text], Field(min_length=1)]
    top_n: int | None = PositiveInt
    return_documents: bool | None = None
    truncate_prompt_tokens: int | None = PositiveInt
