"""Embeddings, classification and scoring on the engine: a pooling head over the final hidden states.

``LLM(model, runner="pooling", convert=...)`` (docs/pooling.md). Pooling requests go through the same
scheduler and paged KV as generation, prefill only: the runner hands back the pooled final-norm hidden
states of each prompt (``runner/pooled_rows.py``), and the heads here turn them into vectors or scores.
"""
