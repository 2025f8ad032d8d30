"""Turning logits into next tokens: greedy, temperature, top-k, top-p, min-p.

Randomness comes in from outside as one uniform number per row, drawn by the
sequence's own ``random.Random``; sampling is the inverse CDF at that number.
So a request's seed fully decides its tokens, whatever else is in the batch,
and a preempted sequence keeps its random stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels import load_kernels
from pagedllm.step_result import TokenLogprobs


@dataclass(frozen=True)
class LogitStats:
    """Per-row reductions of the logits that sampling and logprobs both need."""

    argmax: torch.Tensor  # [R] int64: the greedy token
    lse: torch.Tensor  # [R] float32: logsumexp, so log p(token) = logit - lse


def logit_stats(logits: torch.Tensor) -> LogitStats:
    """Argmax and logsumexp of each row of ``logits`` ``[R, vocab]``.

    One native pass for float32 CPU logits (``kernels/elementwise/logit_stats.cpp``, about
    a tenth of torch's two reductions at 40 x 49152), torch otherwise. Rows
    holding NaN are redone in torch, which ranks NaN highest.
    """
    ops = load_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if ops is None or logits.dim() != 2 or logits.shape[0] == 0:
        return LogitStats(logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1))
    argmax, lse = ops.logit_stats(logits.contiguous())  # [rows] int64, [rows] float32
    bad = torch.isnan(lse)
    if bool(bad.any()):
        argmax[bad] = logits[bad].argmax(dim=-1)
        lse[bad] = torch.logsumexp(logits[bad], dim=-1)
    return LogitStats(argmax, lse)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings, one entry per sampled sequence."""

    temperatures: torch.Tensor  # [B] float32; 0 means greedy
    top_ks: torch.Tensor  # [B] int64; vocab size when disabled
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    uniforms: torch.Tensor  # [B] float64 in [0, 1)
    any_random: bool


class Sampler:
    """Picks one token per row of ``logits``."""

    def __call__(self, logits: torch.Tensor, t: SamplingTensors, argmax: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [B, vocab] float32 -> [B] int64; ``argmax``: the rows' argmax when already known."""
        tokens = logits.argmax(dim=-1) if argmax is None else argmax.clone()
        if not t.any_random:
            return tokens
        vocab = logits.shape[1]
        random_rows = t.temperatures > 0
        # rows with top-k/top-p walk their CDF in probability order, the others
        # in vocabulary order; each row's order depends on its own settings
        # only, so its token never depends on what else is in the batch
        truncated = (t.top_ks < vocab) | (t.top_ps < 1.0)
        for needs_sort in (False, True):
            rows = (random_rows & (truncated == needs_sort)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            scaled = logits[rows] / t.temperatures[rows].unsqueeze(1)
            tokens[rows] = _sample_rows(
                scaled, t.top_ks[rows], t.top_ps[rows], t.min_ps[rows], t.uniforms[rows], needs_sort
            )
        return tokens


def _sample_rows(
    logits: torch.Tensor,  # [R, vocab]
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    uniforms: torch.Tensor,
    needs_sort: bool,
) -> torch.Tensor:
    vocab = logits.shape[1]
    if needs_sort:
        logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        logits = logits.masked_fill(ranks >= top_ks.unsqueeze(1), float("-inf"))
        probs = logits.softmax(dim=-1)
        # keep a token while the mass before it is still below top_p; the
        # most likely token is always kept
        mass_before = probs.cumsum(dim=-1) - probs
        logits = logits.masked_fill(mass_before >= top_ps.unsqueeze(1), float("-inf"))
    else:
        order = None
    probs = logits.softmax(dim=-1)
    if bool((min_ps > 0).any()):
        threshold = min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    cdf = probs.double().cumsum(dim=-1)  # [R, vocab]
    targets = uniforms.unsqueeze(1) * cdf[:, -1:]
    picks = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=vocab - 1)
    # a pick can land on a zero-probability tail token only by rounding;
    # step back to the last token with mass
    picks = torch.minimum(picks, (probs > 0).cumsum(dim=-1).argmax(dim=-1))
    if order is not None:
        picks = order.gather(1, picks.unsqueeze(1)).squeeze(1)
    return picks


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int | None], lse: torch.Tensor | None = None
) -> list[TokenLogprobs]:
    """Logprobs of ``tokens`` under the raw model distribution (before temperature and filters).

    logits: [R, vocab] float32; tokens: [R]; num_top[r]: alternatives to list
    for row r, or None when the row's request did not ask for logprobs: it
    then gets its token's logprob only (for the cumulative logprob) and no rank,
    which saves a full pass over the vocabulary for rank and top-k. ``lse``:
    the rows' logsumexp when already known (``logit_stats``).
    """
    # log p(token) = logit - logsumexp(logits): one reduction, no [R, vocab] output
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)  # [R]
    chosen_logits = logits.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [R]
    chosen = (chosen_logits - lse).tolist()
    ranks: list[int | None] = [None] * len(num_top)
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(num_top)
    asked = [r for r, k in enumerate(num_top) if k is not None]
    if asked:
        rows = torch.tensor(asked, dtype=torch.int64)
        sub = logits[rows]  # [A, vocab]
        # rank among raw logits: the same order as among logprobs
        for r, rank in zip(asked, ((sub > chosen_logits[rows].unsqueeze(1)).sum(dim=-1) + 1).tolist()):
            ranks[r] = rank
        k = max(num_top[r] for r in asked)
        if k > 0:
            top_vals, top_ids = sub.topk(k, dim=-1)
            top_vals = (top_vals - lse[rows].unsqueeze(1)).tolist()
            top_ids = top_ids.tolist()
            for i, r in enumerate(asked):
                tops[r] = tuple(zip(top_ids[i][: num_top[r]], top_vals[i][: num_top[r]]))
    return [
        TokenLogprobs(tok, lp, rank, top)
        for tok, lp, rank, top in zip(tokens.tolist(), chosen, ranks, tops)
    ]
