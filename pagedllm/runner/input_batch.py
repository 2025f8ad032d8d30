"""A step's input tensors and attention metadata, built with numpy in reused buffers.

Per scheduled sequence only a few integers are read in Python (where its new
tokens start and end, its block table); everything per token is computed in
numpy over the whole step, into int64 buffers that live as long as the runner
and grow when a step needs more room:

    query_start_loc  [0, 5, 6, 7]              (a 5-token prefill, two decodes)
    seq_index        [0 0 0 0 0 1 2]           np.repeat(arange(num_seqs), num_new)
    positions        [0 1 2 3 4 9 4]           num_computed[seq_index] + (j - query_start_loc[seq_index])
    slots            block_tables[seq_index, positions // B] * B + positions % B
    state slots      a hybrid model's: each sequence's slot, and whether it starts from a state
                     (num_computed > 0) or from zero (``_state_fields``)
    RoPE rows        positions; a longrope model's: + original length where the token takes the long
                     factors (``rope_rows``, ``layers/rotary.py``'s ``longrope_rows``)

The slot formula is ``block_table.batch_slot_mapping``, the one place it is
written. The tensors handed out share memory with the buffers (on the CPU),
so they are valid until the next ``build``: the runner uses them within one
step.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.block_table import batch_slot_mapping
from pagedllm.layers.attention import AttentionMetadata
from pagedllm.layers.rotary import longrope_rows
from pagedllm.step_record import SequenceStep


class InputBatch:
    """Builds ``(input_ids, positions, AttentionMetadata)`` for one step at a time.

    Args:
        block_size: tokens per KV block.
        device: where the tensors go (CPU: views of the buffers; other devices: copies).
        longrope_switch_len: the model's RoPE tables hold longrope's short and long rows, the long ones
            for sequences past this length (``RotaryTables.switch_len``); None: a token's row is its position.
    """

    def __init__(self, block_size: int, device: torch.device, longrope_switch_len: int | None = None) -> None:
        self.block_size = block_size
        self.device = device
        self.longrope_switch_len = longrope_switch_len
        # flat int64 buffers, grown on demand: [token ids | positions | slots | RoPE rows] per token,
        # block tables (num_seqs x max_blocks, contiguous) and sequence lengths per sequence
        self._tokens = np.zeros((4, 0), dtype=np.int64)
        self._tables = np.zeros(0, dtype=np.int64)
        self._seq_lens = np.zeros(0, dtype=np.int64)

    def _room(self, num_tokens: int, num_seqs: int, num_table_entries: int) -> None:
        if self._tokens.shape[1] < num_tokens:
            self._tokens = np.zeros((4, max(num_tokens, 2 * self._tokens.shape[1])), dtype=np.int64)
        if self._tables.shape[0] < num_table_entries:
            self._tables = np.zeros(max(num_table_entries, 2 * self._tables.shape[0]), dtype=np.int64)
        if self._seq_lens.shape[0] < num_seqs:
            self._seq_lens = np.zeros(max(num_seqs, 2 * self._seq_lens.shape[0]), dtype=np.int64)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device)

    def build(self, steps: list[SequenceStep]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids and positions ``[num_tokens]`` and the step's metadata.

        ``steps`` must list prefills (more than one new token) first, as
        the attention backends expect.
        """
        if not steps:
            raise ValueError("a step needs at least one scheduled sequence")
        bs = self.block_size
        num_seqs = len(steps)
        num_computed = [s.num_computed_tokens for s in steps]
        num_new = [s.num_new_tokens for s in steps]
        seq_lens = [s.seq_len for s in steps]
        max_blocks = max(len(s.block_table) for s in steps)
        for s in steps:
            if s.num_computed_tokens < 0 or s.seq_len > len(s.block_table) * bs:
                raise ValueError(
                    f"token range [{s.num_computed_tokens}, {s.seq_len}) does not fit "
                    f"{len(s.block_table)} blocks of {bs}"
                )
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        self._room(num_tokens, num_seqs, num_seqs * max_blocks)

        input_ids, positions, slots, _ = self._tokens[:, :num_tokens]
        # [num_seqs, max_blocks], padded with block 0 (never read: lengths bound every read)
        tables = self._tables[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
        tables.fill(0)
        for i, s in enumerate(steps):
            tables[i, : len(s.block_table)] = s.block_table
        input_ids[:] = np.fromiter((t for s in steps for t in s.token_ids), dtype=np.int64, count=num_tokens)
        seq_index = np.repeat(np.arange(num_seqs), num_new)  # [num_tokens]
        np.add(np.arange(num_tokens), np.repeat(np.asarray(num_computed) - query_start_loc[:-1], num_new), out=positions)
        slots[:] = batch_slot_mapping(tables, seq_index, positions, bs)
        lens = self._seq_lens[:num_seqs]
        lens[:] = seq_lens

        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            block_tables=self._tensor(tables),
            seq_lens_tensor=self._tensor(lens),
            query_start_loc=query_start_loc.tolist(),
            seq_lens=seq_lens,
            num_computed=num_computed,
            num_prefills=sum(1 for n in num_new if n > 1),
            block_size=bs,
            **self._state_fields(steps),
        )
        return self._tensor(input_ids), self._tensor(positions), meta

    def _state_fields(self, steps: list[SequenceStep]) -> dict[str, torch.Tensor]:
        """A hybrid model's ``state_slots`` and ``has_initial_state`` (docs/hybrid-models.md); none for a model
        without state layers (its sequences hold slot -1). A sequence that computes from position 0 starts
        from a zero state; any other continues the state its slot holds after its computed tokens."""
        if steps[0].state_slot < 0:
            return {}
        slots = [s.state_slot for s in steps]
        if min(slots) < 0:
            raise ValueError("a hybrid model's step needs a state slot for every sequence")
        return {
            "state_slots": torch.tensor(slots, dtype=torch.int64, device=self.device),
            "has_initial_state": torch.tensor([s.num_computed_tokens > 0 for s in steps], dtype=torch.bool,
                                              device=self.device),
        }

    def rope_rows(self, steps: list[SequenceStep], positions: torch.Tensor) -> torch.Tensor:
        """The RoPE table row of each token of the step ``build`` just built: ``positions`` itself, but for a
        longrope model, whose tokens take the short or the long rows by their sequence's length
        (``layers/rotary.py``'s ``longrope_rows``). Valid until the next ``build``."""
        if self.longrope_switch_len is None:
            return positions
        num_tokens = positions.shape[0]
        _, pos, _, rows = self._tokens[:, :num_tokens]
        num_prompt = np.repeat([s.num_prompt_tokens for s in steps], [s.num_new_tokens for s in steps])
        rows[:] = longrope_rows(pos, num_prompt, self.longrope_switch_len)
        return self._tensor(rows)


def as_decode_rows(meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
    """The same step with every new token a decode row of its own: the form a captured decode step reads.

    For a speculative verify step (a sequence's last token and its drafts):
    each token attends to the cache up to and including itself, through its
    sequence's block table, as a decode of that length would. The layers
    write every row's K/V before any row attends, so a draft sees the
    tokens before it that this same step computes::

        sequence at 9 cached tokens, verifying 3:   rows   positions  seq_lens  table
          tokens t9 t10 t11                          0       9         10       T
                                                     1       10        11       T
                                                     2       11        12       T

    ``positions`` is the step's ``[num_tokens]`` tensor; the slots are the step's own.
    """
    num_new = torch.tensor([b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])])  # [num_seqs]
    tables = meta.block_tables.repeat_interleave(num_new.to(meta.block_tables.device), dim=0)  # [num_tokens, width]
    seq_lens_tensor = positions + 1  # [num_tokens]
    seq_lens = seq_lens_tensor.tolist()
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=tables,
        seq_lens_tensor=seq_lens_tensor,
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens=seq_lens,
        num_computed=[n - 1 for n in seq_lens],
        num_prefills=0,
        block_size=meta.block_size,
    )
