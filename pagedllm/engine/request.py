"""A user request: one prompt, its sampling settings and its n sequences."""

from __future__ import annotations

import random
import time

from pagedllm.engine.sequence import Sequence
from pagedllm.sampling_params import SamplingParams


class Request:
    """Groups the ``n`` sequences sampled from one prompt.

    For now each sequence is independent (its own blocks; the prefix cache
    lets them share full prompt blocks). Each gets its own random stream:
    from ``(seed, index)`` when the request has a seed, else from the engine.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        engine_rng: random.Random,
        arrival: int,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = time.monotonic()
        self.seqs: list[Sequence] = []
        for i in range(params.n):
            rng = random.Random(f"{params.seed}:{i}") if params.seed is not None else random.Random(
                engine_rng.getrandbits(64)
            )
            self.seqs.append(Sequence(prompt_token_ids, block_size, request_id, i, rng, arrival))

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
