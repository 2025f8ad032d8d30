"""Pooling inputs: validation and the (query, document) pair prompts of the two cross-encoder kinds."""

from __future__ import annotations

from typing import Any

# Qwen3-Reranker's prompt format, as its model card writes it: a system turn that asks for "yes" or "no",
# the pair in the user turn, an empty thinking block, and the answer's logits read at the next token
RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def embedding_query(task: str, query: str) -> str:
    """Qwen3-Embedding's query with its task instruction, as its model card builds it (documents go without one).

    Queries that share ``task`` share a token prefix: the prefix cache computes it once (docs/pooling.md).
    """
    if not isinstance(task, str) or not task or not isinstance(query, str):
        raise ValueError("embedding_query needs a non-empty task string and a query string")
    return f"Instruct: {task}\nQuery:{query}"


def reranker_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """The Qwen3-Reranker prompt of one (query, document) pair."""
    task = instruction if instruction is not None else RERANKER_INSTRUCTION
    return f"{RERANKER_PREFIX}<Instruct>: {task}\n<Query>: {query}\n<Document>: {document}{RERANKER_SUFFIX}"


def pooling_prompts(prompts: Any, what: str = "prompts") -> list[str | dict[str, Any]]:  # noqa: ANN401
    """``prompts`` as a non-empty list of strings / ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``;
    ValueError for anything else."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"{what} must be a prompt or a non-empty list of prompts")
    for i, p in enumerate(prompts):
        if not isinstance(p, (str, dict)):
            raise ValueError(f"{what}[{i}] must be a string or a prompt dict, got {type(p).__name__}")
    return list(prompts)


def score_pairs(queries: Any, documents: Any) -> list[tuple[str, str]]:  # noqa: ANN401
    """vLLM's ``score`` pairing: one query with N documents, or N queries with N documents."""
    queries = [queries] if isinstance(queries, str) else queries
    documents = [documents] if isinstance(documents, str) else documents
    for name, texts in (("queries", queries), ("documents", documents)):
        if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name} must be a string or a non-empty list of strings")
    if len(queries) == 1:
        return [(queries[0], d) for d in documents]
    if len(queries) != len(documents):
        raise ValueError(f"{len(queries)} queries for {len(documents)} documents: give one query or as many")
    return list(zip(queries, documents))
