"""The runner's lasting state of every sequence, kept from the incremental step records.

A ``StepRecord`` sends a sequence's tokens, block table and sampling settings
once (``NewSequence``), then only what each step adds (``ScheduledStep``).
``SequenceStates.apply`` folds a record into the state and returns the
step's full ``SequenceStep`` views, the same the engine sent whole before the
record was incremental, so the tensors built from them do not change.
Every tensor-parallel rank applies the same records in the same order, so
their states stay equal. Plain Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.step_record import NewSequence, SamplingSpec, ScheduledStep, SequenceStep, StepRecord


@dataclass(slots=True)
class SequenceState:
    """What the runner holds of one sequence between steps."""

    request_id: str
    token_ids: list[int]  # every token sent so far: prompt, then outputs
    num_prompt_tokens: int
    block_table: list[int]
    sampling: SamplingSpec
    state_slot: int = -1  # a hybrid model's state slot (-1: none)

    @classmethod
    def of(cls, new: NewSequence) -> SequenceState:
        return cls(new.request_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_table), new.sampling,
                   new.state_slot)


class SequenceStates:
    """Every sequence the engine has sent and not yet finished, by sequence id."""

    def __init__(self) -> None:
        self.states: dict[int, SequenceState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def apply(self, record: StepRecord) -> list[SequenceStep]:
        """Fold ``record`` into the state; the full view of each of its ``sequences``, in order.

        Finished sequences are dropped first, so a preempted sequence that is
        sent again in the same record starts afresh. ValueError for a step of
        a sequence never sent (the engine and the runner would disagree).
        """
        for seq_id in record.finished_seq_ids:
            self.states.pop(seq_id, None)
        for new in record.new_sequences:
            self.states[new.seq_id] = SequenceState.of(new)
        return [self._advance(s) for s in record.sequences]

    def _advance(self, s: ScheduledStep) -> SequenceStep:
        state = self.states.get(s.seq_id)
        if state is None:
            raise ValueError(f"step record schedules sequence {s.seq_id}, which the runner does not hold")
        if s.num_kept_tokens is not None:
            del state.token_ids[s.num_kept_tokens :]  # drafts the last verify step rejected
        state.token_ids.extend(s.new_token_ids)
        if s.block_table is not None:
            state.block_table = list(s.block_table)
        else:
            state.block_table.extend(s.new_block_ids)
        end = s.num_computed_tokens + s.num_new_tokens
        if end > len(state.token_ids):
            raise ValueError(f"sequence {s.seq_id}: the step runs to token {end}, the runner holds {len(state.token_ids)}")
        prompt_ids, output_ids = self._history(state, s)
        # positional (SequenceStep's field order): the fastest way to build one
        return SequenceStep(
            state.request_id, s.num_computed_tokens, tuple(state.token_ids[s.num_computed_tokens : end]),
            tuple(state.block_table), state.sampling, s.uniforms, s.prompt_logprobs, s.prompt_targets,
            prompt_ids, output_ids, s.token_bitmasks, s.num_draft_tokens, state.num_prompt_tokens,
            s.pooling, state.state_slot,
        )

    @staticmethod
    def _history(state: SequenceState, s: ScheduledStep) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """The prompt and each sampled row's output, when the rules need them.

        A sequence's forks ride only on the step that completes its prompt,
        right after they were forked from it, so their outputs are its own.
        A verify step's row j (it judges draft j) has the output up to its
        last real token plus drafts 0..j-1, as plain decoding would have had
        when it sampled that position (the penalties count the drafts before it).
        """
        rules = state.sampling.rules
        if rules is None or not s.uniforms:
            return (), ()
        prompt = tuple(state.token_ids[: state.num_prompt_tokens]) if rules.needs_prompt else ()
        if not rules.needs_output:
            return prompt, ()
        if s.num_draft_tokens:
            end = s.num_computed_tokens + s.num_new_tokens  # the drafts are the tokens before it
            first = end - s.num_draft_tokens
            return prompt, tuple(tuple(state.token_ids[state.num_prompt_tokens : first + j])
                                 for j in range(s.num_draft_tokens + 1))
        output = tuple(state.token_ids[state.num_prompt_tokens :])
        return prompt, (output,) * len(s.uniforms)
