"""A pooling prefill's share of a step: the rows of the final hidden states its pooling type needs.

A prompt may be prefilled in chunks, so each step hands back its own share
(``StepResult.pooled``) and the engine combines them (``LLMEngine``): "LAST"
takes the last prompt token's row in the step that reaches it, "CLS" the
first token's row in the step that starts at position 0, "MEAN" the float32
sum of every row the step ran (the engine divides by the prompt length).
The hidden states are the model's output: after its final norm, before the LM head.
"""

from __future__ import annotations

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
