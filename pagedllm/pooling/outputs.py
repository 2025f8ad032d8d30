"""The pooling outputs, in vLLM's shapes: ``LLM.embed()[i].outputs.embedding`` and the like."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass
class PoolingOutput:
    """``LLM.encode``'s raw output: the pooled final hidden state (before normalisation or a head)."""

    data: torch.Tensor


@dataclass
class EmbeddingOutput:
    """One embedding: a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """A sequence classifier's class probabilities (softmax over its labels)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """One (query, document) pair's relevance score."""

    score: float


@dataclass
class PoolingRequestOutput(Generic[T]):
    """One prompt's pooling result: ``outputs`` is a ``PoolingOutput``, ``EmbeddingOutput``, ... ."""

    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]
