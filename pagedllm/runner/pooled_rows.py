"""A pooling prefill's share of a step: the rows of the final hidden states its pooling type needs.

A prompt may be prefilled in chunks, so each step hands back its own share
(``StepResult.pooled``) and the engine combines them (``LLMEngine``): "LAST"
takes the last prompt token's row in the step that reaches it, "CLS" the
first token's row in the step that starts at position 0, "MEAN" the float32
sum of every row the step ran (the engine divides by the prompt length).
The hidden states are the model's output: after its final norm, before the LM head.
A "LAST" prefill with ``pooled_logit_ids`` (a yes/no reranker) gets the LM
head's logits of those ids at its last prompt token instead (``pooled_shares``):
the head runs where the model is, in the engine, once for every such row of the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.step_record import SequenceStep


def pooled_share(hidden: torch.Tensor, step: SequenceStep, start: int) -> list[float] | None:
    """``step``'s pooled share from ``hidden`` (the step's final hidden states; its rows from ``start``).

    None when this step holds no row the pooling type needs (a middle chunk of a "LAST" prompt).
    ValueError for an unknown pooling type (the engine and the runner would disagree).
    """
    stop = start + step.num_new_tokens
    if step.pooling == "LAST":
        if step.seq_len != step.num_prompt_tokens:
            return None
        return hidden[stop - 1].float().tolist()
    if step.pooling == "CLS":
        return hidden[start].float().tolist() if step.num_computed_tokens == 0 else None
    if step.pooling == "MEAN":
        return hidden[start:stop].float().sum(dim=0).tolist()
    raise ValueError(f"unknown pooling type {step.pooling!r}")


def pooled_shares(
    hidden: torch.Tensor, steps: list[SequenceStep], compute_logits: Callable[[torch.Tensor], torch.Tensor | None]
) -> dict[int, list[float] | None]:
    """Each pooling step entry's share (by its index in ``steps``, whose rows follow one another in ``hidden``).

    The entries that ask for ``pooled_logit_ids`` and reach their last prompt
    token share one ``compute_logits`` call (every tensor-parallel rank makes
    it; it returns None on ranks but 0, whose shares are then None).
    """
    shares: dict[int, list[float] | None] = {}
    logit_rows: list[tuple[int, int]] = []  # (step entry, its last token's row)
    start = 0
    for i, s in enumerate(steps):
        if s.pooling is not None:
            if not s.pooled_logit_ids:
                shares[i] = pooled_share(hidden, s, start)
            else:
                shares[i] = None
                if s.pooling != "LAST":
                    raise ValueError(f"pooled_logit_ids need LAST pooling, got {s.pooling!r}")
                if s.seq_len == s.num_prompt_tokens:
                    logit_rows.append((i, start + s.num_new_tokens - 1))
        start += s.num_new_tokens
    if logit_rows:
        index = torch.tensor([row for _, row in logit_rows], dtype=torch.int64, device=hidden.device)
        logits = compute_logits(hidden[index])
        if logits is not None:
            for (i, _), row in zip(logit_rows, logits.cpu()):
                shares[i] = row[list(steps[i].pooled_logit_ids)].tolist()
    return shares
