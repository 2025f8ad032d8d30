"""What a pooling engine does with its checkpoint: its task, pooling type, normalisation and head.

Resolved once, when ``LLM(runner="pooling")`` starts: ``convert="auto"`` is
"classify" for a ``*ForSequenceClassification`` checkpoint and "embed"
otherwise; the pooling type and normalisation come from ``pooler_config``,
else the checkpoint's sentence-transformers files (``modules.json``,
``1_Pooling/config.json``), else "LAST" with normalisation (Qwen3-Embedding's).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors import safe_open

from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.pooler_config import PoolerConfig

Task = Literal["embed", "classify", "score"]
# sentence-transformers' 1_Pooling/config.json keys, by the pooling type each turns on
_ST_POOLING_KEYS = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


@dataclass(frozen=True)
class PoolingModel:
    """A pooling engine's resolved head.

    ``task``: "embed" (vectors), "classify" (a sequence-classification head:
    ``classifier`` ``[num_labels, hidden]``) or "score" (a causal LM read as a
    yes/no judge: the last token's logits of ``no_yes_ids``, Qwen3-Reranker's).
    ``max_dimensions``: the largest ``dimensions`` a request may ask for.
    """

    task: Task
    pooling_type: str
    normalize: bool
    max_dimensions: int
    classifier: torch.Tensor | None = None
    labels: tuple[str, ...] = ()


def _sentence_transformers(path: str) -> tuple[str | None, bool | None]:
    """(pooling type, normalise) from a sentence-transformers folder; (None, None) where it has none."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isdir(path) or not os.path.isfile(modules_file):
        return None, None
    with open(modules_file) as f:
        modules = json.load(f)
    normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    pooling = None
    for m in modules:
        if m.get("type", "").endswith("Pooling"):
            with open(os.path.join(path, m.get("path", ""), "config.json")) as f:
                st = json.load(f)
            chosen = [kind for key, kind in _ST_POOLING_KEYS.items() if st.get(key)]
            others = [k for k, v in st.items() if k.startswith("pooling_mode") and v and k not in _ST_POOLING_KEYS]
            if len(chosen) != 1 or others:
                raise ValueError(f"{path}: sentence-transformers pooling {st} is not one of last / mean / cls")
            pooling = chosen[0]
    return pooling, normalize


def _classifier(path: str) -> torch.Tensor:
    """The ``score.weight`` ``[num_labels, hidden]`` of a sequence-classification folder, in float32."""
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            if "score.weight" in f.keys():
                return f.get_tensor("score.weight").float()
    raise ValueError(f"{path}: a sequence-classification checkpoint without score.weight")


def _labels(path: str, num_labels: int) -> tuple[str, ...]:
    with open(os.path.join(path, "config.json")) as f:
        id2label = json.load(f).get("id2label") or {}
    return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num_labels))


def resolve_pooling_model(
    path: str, model_config: ModelArchConfig, convert: str, pooler_config: PoolerConfig | None
) -> PoolingModel:
    """The head of a pooling engine over the checkpoint at ``path`` (``convert``: EngineConfig's)."""
    is_seq_cls = any(a.endswith(SEQUENCE_CLASSIFICATION) for a in model_config.architectures)
    task = ("classify" if is_seq_cls else "embed") if convert == "auto" else convert
    if task == "classify" and not is_seq_cls:
        raise ValueError(f"convert='classify' needs a *{SEQUENCE_CLASSIFICATION} checkpoint, "
                         f"{path} is {list(model_config.architectures) or model_config.architecture}")
    st_pooling, st_normalize = _sentence_transformers(path)
    pc = pooler_config or PoolerConfig()
    pooling_type = pc.pooling_type or st_pooling or "LAST"
    normalize = pc.normalize if pc.normalize is not None else (st_normalize if st_normalize is not None else True)
    hidden = model_config.hidden_size
    if pc.dimensions is not None and pc.dimensions > hidden:
        raise ValueError(f"pooler_config.dimensions={pc.dimensions} exceeds the hidden size {hidden}")
    classifier, labels = None, ()
    if task == "classify":
        classifier = _classifier(path)
        if classifier.shape[1] != hidden:
            raise ValueError(f"score.weight is {tuple(classifier.shape)}, the hidden size {hidden}")
        labels = _labels(path, classifier.shape[0])
    return PoolingModel(task, pooling_type, bool(normalize), pc.dimensions or hidden, classifier, labels)
