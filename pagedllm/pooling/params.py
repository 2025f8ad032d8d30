"""What one pooling request asks for (``PoolingParams``, as vLLM's), and how it rides through the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request's own settings.

    Attributes:
        dimensions: truncate an embedding to its first ``dimensions`` values
            and normalise it again (Matryoshka); None: the whole vector.
            Larger than the model's size (or its Matryoshka limit) is a ValueError.
        normalize: L2-normalise the embedding; None: the model's default.
        truncate_prompt_tokens: keep only the last k prompt tokens; None:
            a prompt longer than the context is a ValueError, never cut silently.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}")


class PoolingSamplingParams(SamplingParams):
    """The engine's view of a pooling request: a prefill that samples nothing (vLLM's ``max_tokens=0``).

    ``pooling_type`` tells the step builder and the runner to pool the
    prompt's final hidden states instead of sampling (``runner/pooled_rows.py``),
    and the engine to end the request once its prompt is computed.
    ``pooled_logit_ids`` (LAST only): the runner returns the LM head's logits of
    these token ids at the last prompt token instead of its hidden state, so
    a yes/no reranker is scored inside the engine (its replica, its ranks).
    """

    pooling_type: Literal["LAST", "MEAN", "CLS"]
    pooled_logit_ids: tuple[int, ...] = ()

    def model_post_init(self, context: object) -> None:
        super().model_post_init(context)
        if self.pooled_logit_ids and self.pooling_type != "LAST":
            raise ValueError(f"pooled_logit_ids need pooling_type 'LAST', got {self.pooling_type!r}")


def engine_params(pooling_type: str, truncate_prompt_tokens: int | None = None,
                  pooled_logit_ids: tuple[int, ...] = ()) -> PoolingSamplingParams:
    """The engine params of a pooling request with ``pooling_type``; greedy, one token of room (never used)."""
    return PoolingSamplingParams(pooling_type=pooling_type, temperature=0.0, max_tokens=1,
                                 truncate_prompt_tokens=truncate_prompt_tokens, pooled_logit_ids=pooled_logit_ids)
