"""How a pooling model reduces a prompt's hidden states to one vector: the ``pooler_config`` engine field."""

from __future__ import annotations

import json
from typing import Any, Literal

from pagedllm.config_record import PositiveInt, config_record

PoolingType = Literal["LAST", "MEAN", "CLS"]


@config_record(prefix="pooler_config.")
class PoolerConfig:
    """Pooling settings that override what the checkpoint declares (vLLM's ``--pooler-config``).

    Attributes:
        pooling_type: "LAST" (the last prompt token's hidden state), "MEAN"
            (the mean over every prompt token) or "CLS" (the first token's);
            None: the checkpoint's sentence-transformers ``1_Pooling/config.json``,
            else "LAST".
        normalize: L2-normalise embeddings; None: normalise where the
            checkpoint's sentence-transformers modules hold a ``Normalize``
            module, or where it has no sentence-transformers config (as vLLM).
        dimensions: the embedding size the model was trained to be truncated
            to (Matryoshka) at most; None: any size up to the hidden size.
    """

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: PositiveInt | None = None

    @classmethod
    def parse(cls, value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig | None:
        """A config from itself, a dict of its fields, or their JSON text (the CLI's); None stays None."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"pooler_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a dict or JSON object, got {type(value).__name__}")
        value = dict(value)
        if isinstance(value.get("pooling_type"), str):
            value["pooling_type"] = value["pooling_type"].upper()
        return cls(**value)
