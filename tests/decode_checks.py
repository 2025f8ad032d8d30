"""A decode path checked against the eager model at every step (the captured-step tests)."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.attention import AttentionMetadata


class CheckedDecode:
    """Wraps a runner's decode path (captured steps): every step it runs is recomputed eagerly and compared.

    The path's K/V writes are kept (later steps read them), but first the
    slots are reset and the eager model writes them again, so both the
    hidden states and the K/V each path writes are compared.
    """

    def __init__(self, runner: Any, path: Any, tol: float, kv_tol: float) -> None:  # noqa: ANN401
        self.runner, self.path, self.tol, self.kv_tol = runner, path, tol, kv_tol
        self.num_calls = 0
        self.num_rows: list[int] = []

    def accepts(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return self.path.accepts(meta, num_tokens)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.num_calls += 1
        self.num_rows.append(input_ids.shape[0])
        slots = meta.slot_mapping
        caches = [c.flatten(0, 1) for pair in self.runner.kv_caches for c in pair]  # K and V of every layer
        before = [c[slots].clone() for c in caches]
        got = self.path(input_ids, positions, meta)
        path_kv = [c[slots].clone() for c in caches]
        for c, b in zip(caches, before):
            c[slots] = b
        want = self.runner.model(input_ids, positions, self.runner.kv_caches, meta)
        for c, f in zip(caches, path_kv):
            torch.testing.assert_close(f, c[slots], rtol=self.kv_tol, atol=self.kv_tol)
            c[slots] = f
        torch.testing.assert_close(got, want, rtol=self.tol, atol=self.tol)
        return got
