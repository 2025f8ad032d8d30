"""From a prompt's pooled hidden state to what a request returns: an embedding, class probabilities, a score."""

from __future__ import annotations

import torch

from pagedllm.pooling.model_pooling import PoolingModel


def embedding(pooled: torch.Tensor, model: PoolingModel, normalize: bool | None, dimensions: int | None) -> list[float]:
    """The embedding of ``pooled`` ``[hidden]``: cut to ``dimensions`` (Matryoshka), then L2-normalised
    where ``normalize`` (None: the model's default) says; a cut vector is normalised again whenever the model
    normalises, as sentence-transformers' ``truncate_dim`` does."""
    check_dimensions(model, dimensions)
    vec = pooled.float()
    if dimensions is not None:
        vec = vec[:dimensions]
    if model.normalize if normalize is None else normalize:
        vec = torch.nn.functional.normalize(vec, dim=-1)
    return vec.tolist()


def check_dimensions(model: PoolingModel, dimensions: int | None) -> None:
    """ValueError unless ``dimensions`` is None or a size the model's embeddings may be cut to."""
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")
    if dimensions > model.max_dimensions:
        raise ValueError(f"dimensions={dimensions} exceeds the model's embedding size {model.max_dimensions}")


def class_logits(pooled: torch.Tensor, model: PoolingModel) -> torch.Tensor:
    """A sequence classifier's logits ``[num_labels]`` (its ``score.weight`` over the pooled state)."""
    if model.classifier is None:
        raise ValueError("this model has no classification head (convert='classify')")
    return model.classifier @ pooled.float()


def class_probs(pooled: torch.Tensor, model: PoolingModel) -> list[float]:
    """Softmax over the classifier's labels (vLLM's classify output)."""
    return torch.softmax(class_logits(pooled, model), dim=-1).tolist()


def cross_encoder_score(pooled: torch.Tensor, model: PoolingModel) -> float:
    """A classifier's relevance score: sigmoid of its one logit, or the last label's probability."""
    logits = class_logits(pooled, model)
    if logits.numel() == 1:
        return float(torch.sigmoid(logits[0]))
    return float(torch.softmax(logits, dim=-1)[-1])


def yes_no_score(no_yes_logits: torch.Tensor) -> float:
    """Qwen3-Reranker's score from the last token's ``[no, yes]`` logits (the engine's pooled share of a
    request with ``pooled_logit_ids``): softmax over the two, yes's share."""
    if no_yes_logits.shape != (2,):
        raise ValueError(f"a yes/no score needs the [no, yes] logits, got shape {tuple(no_yes_logits.shape)}")
    return float(torch.softmax(no_yes_logits.float(), dim=-1)[1])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two vectors (a bi-encoder's score)."""
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))
