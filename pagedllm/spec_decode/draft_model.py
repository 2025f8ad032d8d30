"""Draft tokens from a smaller model with the same tokenizer (``speculative_config`` method "draft_model").

The draft model runs as an engine of its own, with its own KV pool, block
manager and prefix cache. Each step, before the target's schedule, every
sequence that may draft is sent to it as a request: its tokens so far as
the prompt, ``k`` greedy tokens to generate. The draft engine runs those
requests together (a prefill of what its cache lacks, then ``k - 1`` batched
decodes) and their outputs are the drafts::

    target step t:   seq = p0 .. p9 t0 t1          (t1 not yet computed)
    draft request:   prompt p0 .. p9 t0 t1  ->  prefix cache hit on the full blocks
                     of the previous request, prefill of the rest, k greedy tokens d1 .. dk
    target verifies  t1 d1 .. dk in one step

Greedy drafts are deterministic, so the verifier's q is one-hot on each
draft, as for n-gram proposals: rejection sampling stays exact
(``runner/draft_verifier.py``) whatever the draft model's distribution.
The draft engine's blocks return to its free list when each request ends;
its prefix cache keeps what the next step's request starts with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from pagedllm.config import EngineConfig
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class DraftEngine(Protocol):
    """What the proposer drives of the draft model's engine (an ``LLMEngine``)."""

    def new_request_id(self) -> str: ...

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> None: ...

    def abort_request(self, request_id: str | list[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


class Sequence(Protocol):
    """What the proposer reads of a target sequence."""

    token_ids: list[int]


def draft_engine_config(target: EngineConfig, model: str) -> EngineConfig:
    """The draft engine's config: the target's, for another model, without speculation, tensor parallelism
    or the target's quantization choices (the draft file's own format holds). The draft samples nothing of
    its own (drafts are greedy), so its model's sampling defaults are not read (``generation_config``)."""
    return replace(
        target, model=model, tokenizer=None, speculative_config=None, tensor_parallel_size=1,
        quantization=None, quantization_group_size=None, num_kv_blocks=None, kv_cache_memory_bytes=None,
        enable_prefix_caching=True, cpu_bind=None, batch_invariant=None, generation_config="vllm",
        kv_cache_dir=None, kv_cache_dir_max_bytes=None,  # the target's blocks only (a draft recomputes cheaply)
        state_snapshot_interval=None,  # set for the target model: the draft keeps its default
        # the draft runs every target sequence: it must hold the target's (possibly fitted) length
        fit_max_model_len=False,
    )


class DraftModelProposer:
    """Drafts ``k`` tokens for each of several sequences with one batched run of the draft engine.

    Args:
        engine: the draft model's engine.
    """

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine

    @classmethod
    def build(
        cls, target: EngineConfig, model: str, target_vocab: dict[str, int],
        make_engine: Callable[[EngineConfig], DraftEngine],
    ) -> DraftModelProposer:
        """A proposer over a new engine for ``model``; ValueError where its tokenizer is not the target's."""
        engine = make_engine(draft_engine_config(target, model))
        vocab = engine.tokenizer.hf.get_vocab()  # type: ignore[attr-defined]
        if vocab != target_vocab:
            raise ValueError(
                f"the draft model {model!r} has another tokenizer than the target model "
                f"({len(vocab)} vs {len(target_vocab)} tokens, or other ids): its drafts would be other tokens"
            )
        return cls(engine)

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to ``k`` greedy draft tokens after each ``(sequence, k)``'s tokens, in order."""
        params = {k: SamplingParams(temperature=0, max_tokens=k) for _, k in requests}
        ids = []
        for seq, k in requests:
            request_id = self.engine.new_request_id()
            self.engine.add_request(request_id, {"prompt_token_ids": list(seq.token_ids)}, params[k])
            ids.append(request_id)
        drafts: dict[str, list[int]] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        drafts[out.request_id] = list(out.outputs[0].token_ids)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in drafts])
            raise
        return [drafts.get(i, []) for i in ids]
