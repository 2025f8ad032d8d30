"""vLLM's logits processors (penalties, bias, allowed ids, bad words, min_tokens) over a step's rows.

Every processor is a few tensor ops over all the rows that use it: the
per-row settings and token lists of the step are flattened once into index
tensors (numpy, no per-token Python in torch), then one scatter or one masked
op applies them. Rows without rules are never touched, and a step in which
no row has any skips all of it (``apply_logits_rules`` returns None).

The order is vLLM's (``step_record.LogitsRules``): allowed ids, bad words and
min_tokens bans, logit bias, then the repetition, frequency and presence
penalties; a thinking budget that ran out then forces its token. A structured-output mask (``apply_token_bitmasks``) comes before
all of them, as vLLM applies its grammar bitmask before the sampler.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.step_record import LogitsRules


def _flat(row_tokens: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of every row, as two int64 tensors ``[total]``."""
    counts = np.fromiter((len(t) for t in row_tokens), dtype=np.int64, count=len(row_tokens))
    total = int(counts.sum())
    rows = np.repeat(np.arange(len(row_tokens), dtype=np.int64), counts)  # [total]
    tokens = np.fromiter((t for toks in row_tokens for t in toks), dtype=np.int64, count=total)  # [total]
    return torch.from_numpy(rows), torch.from_numpy(tokens)


def _keep_allowed(logits: torch.Tensor, rows: list[int], allowed: list[tuple[int, ...]]) -> None:
    """Set every logit of ``rows`` outside that row's allowed ids to -inf, in place."""
    index = torch.tensor(rows, dtype=torch.int64)
    r, t = _flat(allowed)
    keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool)  # [A, vocab]
    keep[r, t] = True
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


def _banned(rules: list[LogitsRules], outputs: list[tuple[int, ...]], row: int) -> list[int]:
    """Tokens row ``row`` must not sample: bad-word endings the output leads into, min_tokens bans."""
    rule, out = rules[row], outputs[row]
    banned = []
    for word in rule.bad_words:
        # a word's last token is banned when its other tokens end the output (always for one token);
        # a loop over the request's few bad words, not over tokens or the vocabulary
        prefix = len(word) - 1
        if prefix == 0 or (len(out) >= prefix and out[len(out) - prefix :] == word[:-1]):
            banned.append(word[-1])
    if len(out) < rule.min_tokens:
        banned.extend(rule.min_tokens_banned)
    return banned


def _penalize(
    logits: torch.Tensor,
    rows: list[int],
    rules: list[LogitsRules],
    prompts: list[tuple[int, ...]],
    outputs: list[tuple[int, ...]],
) -> None:
    """Repetition, frequency and presence penalties of ``rows``, in place, as vLLM applies them."""
    num_rows, vocab = len(rows), logits.shape[1]
    index = torch.tensor(rows, dtype=torch.int64)
    r, t = _flat([outputs[i] for i in rows])
    dtype = logits.dtype
    counts = torch.zeros(num_rows * vocab, dtype=dtype)  # [P * vocab], viewed as [P, vocab]
    counts.scatter_add_(0, r * vocab + t, torch.ones(t.shape[0], dtype=dtype))
    counts = counts.view(num_rows, vocab)
    sub = logits[index]  # [P, vocab]
    repetition = torch.tensor([rules[i].repetition_penalty for i in rows], dtype=dtype).unsqueeze(1)
    if bool((repetition != 1.0).any()):
        seen = counts > 0  # [P, vocab]
        pr, pt = _flat([prompts[i] for i in rows])
        seen[pr, pt] = True
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    frequency = torch.tensor([rules[i].frequency_penalty for i in rows], dtype=dtype).unsqueeze(1)
    presence = torch.tensor([rules[i].presence_penalty for i in rows], dtype=dtype).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).to(dtype)
    logits[index] = sub


def apply_logits_rules(
    logits: torch.Tensor,
    rules: list[LogitsRules | None],
    prompts: list[tuple[int, ...]],
    outputs: list[tuple[int, ...]],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's logits processors; None when no row has any.

    logits: [R, vocab] float32 (left unchanged); ``rules[r]``, ``prompts[r]``,
    ``outputs[r]``: row r's rules (None: none), prompt and output token ids
    (empty unless the rules need them). Returns the processed copy ``[R,
    vocab]`` and the indices ``[C]`` of the rows it changed.
    """
    changed = [r for r, rule in enumerate(rules) if rule is not None]
    if not changed:
        return None
    logits = logits.clone()
    active: list[LogitsRules] = [rule if rule is not None else LogitsRules() for rule in rules]
    allowed = [r for r in changed if active[r].allowed_token_ids]
    if allowed:
        _keep_allowed(logits, allowed, [active[r].allowed_token_ids for r in allowed])
    bans = [(r, t) for r in changed for t in _banned(active, outputs, r)]
    if bans:
        ban_rows, ban_tokens = zip(*bans)
        logits[torch.tensor(ban_rows), torch.tensor(ban_tokens)] = float("-inf")
    biases = [(r, t, b) for r in changed for t, b in active[r].logit_bias]
    if biases:
        bias_rows, bias_tokens, values = zip(*biases)
        # one token appears once per row (a dict), so the adds never collide
        logits.index_put_(
            (torch.tensor(bias_rows), torch.tensor(bias_tokens)), torch.tensor(values, dtype=logits.dtype), accumulate=True
        )
    penalized = [r for r in changed if active[r].has_penalties]
    if penalized:
        _penalize(logits, penalized, active, prompts, outputs)
    _force_thinking_end(logits, changed, active, outputs)
    return logits, torch.tensor(changed, dtype=torch.int64)


def _force_thinking_end(
    logits: torch.Tensor, changed: list[int], rules: list[LogitsRules], outputs: list[tuple[int, ...]]
) -> None:
    """Rows whose thinking budget ran out may sample only the token it forces (``thinking_budget.py``), in place.

    Last, so that no bias, ban or allowed-id list can keep the block from closing.
    """
    for r in changed:
        budget = rules[r].thinking
        forced = budget.forced_token(outputs[r]) if budget is not None else None
        if forced is not None:
            logits[r] = float("-inf")
            logits[r, forced] = 0.0


def apply_token_bitmasks(logits: torch.Tensor, bitmasks: list[bytes]) -> None:
    """Set every logit a row's structured-output mask forbids to -inf, in place.

    logits: [R, vocab] float32 on the CPU; ``bitmasks[r]``: row r's packed
    mask (``SequenceStep.token_bitmasks``), b"" for a row without one, which
    is left untouched. One call of xgrammar's CPU kernel over the masked rows.
    """
    rows = [r for r, mask in enumerate(bitmasks) if mask]
    if not rows:
        return
    # imported here, on the first constrained step: it pulls in triton (~25 MiB, 0.1 s) that no other step needs
    import xgrammar as xgr

    words = xgr.get_bitmask_shape(1, logits.shape[1])[1]
    # xgrammar indexes logits and mask with the same row ids: unmasked rows get all bits set
    packed = np.full((logits.shape[0], words), -1, dtype=np.int32)  # [R, ceil(vocab / 32)]
    for r in rows:
        packed[r] = np.frombuffer(bitmasks[r], dtype=np.int32)
    xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(packed), vocab_size=logits.shape[1], indices=rows)
