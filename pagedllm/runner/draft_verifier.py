"""Verifying draft tokens against the model's own distribution (speculative decoding), lossless.

A verify step computes the sequence's last token and its k drafts and gives
k + 1 rows of logits: row j is the model's distribution p_j for the token
after position j, so draft j is judged by row j and row k gives the token
after the last draft. With n-gram drafts the proposal q is one-hot on the
draft x (the proposer is deterministic), and rejection sampling reduces to::

    accept x with probability min(1, p(x) / q(x)) = p(x)          (u_j < p_j(x))
    on rejection: sample from norm(max(p - q, 0)) = p with x removed, renormalised, and stop
    all k accepted: a bonus token sampled from p_k

which yields tokens distributed exactly as sampling from p one step at a
time (Leviathan et al. 2023, Chen et al. 2023). Greedy rows (temperature 0)
accept while the draft is the argmax and emit the argmax where they stop,
so the output is plain greedy decoding's token for token.

``p`` is the distribution the sampler draws from (temperature, then top-k,
top-p and min-p), so speculation changes nothing a request asked for.
"""

from __future__ import annotations

import torch

from pagedllm.step_record import SamplingSpec


def sampling_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """The distribution ``[R, vocab]`` float64 the sampler draws each row of ``logits`` from under ``spec``.

    The same filters, in the same order, as ``runner/sampler.py``'s
    ``_sample_rows``: temperature, top-k, top-p (the most likely token always
    kept), then min-p against the most likely token.
    """
    scaled = logits.float() / spec.temperature
    vocab = scaled.shape[1]
    top_k = min(spec.top_k, vocab) if spec.top_k > 0 else vocab
    if top_k < vocab or spec.top_p < 1.0:
        values, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).unsqueeze(0)
        values = values.masked_fill(ranks >= top_k, float("-inf"))
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        values = values.masked_fill(mass_before >= spec.top_p, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter_(1, order, values)
    probs = scaled.softmax(dim=-1)
    if spec.min_p > 0:
        probs = probs.masked_fill(probs < spec.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    probs = probs.double()
    return probs / probs.sum(dim=-1, keepdim=True)


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token at ``u`` (in [0, 1)) of ``probs`` ``[vocab]``'s CDF in vocabulary order; never a zero-mass one."""
    cdf = probs.cumsum(dim=0)
    pick = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)[0])
    # past the last token with mass only by rounding at the top of the CDF (as the sampler steps back)
    return min(pick, int(probs.nonzero()[-1, 0]))


def verify_drafts(logits: torch.Tensor, draft_ids: list[int], spec: SamplingSpec, uniforms: tuple[float, ...]) -> list[int]:
    """The tokens a verify step emits: the accepted drafts, then one sampled token.

    ``logits`` ``[k + 1, vocab]`` (rows as in the module docstring),
    ``draft_ids`` the k drafts, ``uniforms`` k + 1 numbers in [0, 1): one
    accept test per draft, the last for the token sampled after them.
    Returns between 1 and k + 1 tokens.
    """
    k = len(draft_ids)
    if logits.shape[0] != k + 1 or len(uniforms) != k + 1:
        raise ValueError(f"{k} drafts need {k + 1} logit rows and uniforms, got {logits.shape[0]} and {len(uniforms)}")
    if spec.temperature == 0.0:
        targets = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for j, draft in enumerate(draft_ids):
            if targets[j] != draft:
                return [*out, targets[j]]
            out.append(draft)
        return [*out, targets[k]]
    probs = sampling_probs(logits, spec)
    accept_p = probs[torch.arange(k), torch.tensor(draft_ids, dtype=torch.int64)].tolist() if k else []
    for j, draft in enumerate(draft_ids):
        if uniforms[j] < accept_p[j]:
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0  # max(p - q, 0) with q one-hot on the draft
        if float(residual.sum()) <= 0.0:  # p was one-hot on the draft itself: rejection had probability 0
            return [*draft_ids[:j], draft]
        return [*draft_ids[:j], _inverse_cdf(residual, uniforms[k])]
    return [*draft_ids, _inverse_cdf(probs[k], uniforms[k])]
