"""The offline benchmark workload, shaped like nano-vLLM's.

Random token prompts, prompt and output lengths uniform in a range, EOS
ignored so every request produces exactly its output length. The draws come
from one ``random.Random(seed)`` in a fixed order, so any engine given the
same arguments runs the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOKEN_ID_LOW, TOKEN_ID_HIGH = 100, 49000


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_workload(num_requests: int, min_len: int, max_len: int, seed: int) -> list[BenchRequest]:
    """``num_requests`` requests; per request: prompt length, output length, then the prompt ids."""
    if num_requests < 1 or min_len < 1 or max_len < min_len:
        raise ValueError("need num_requests >= 1 and 1 <= min_len <= max_len")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(min_len, max_len)
        output_len = rng.randint(min_len, max_len)
        ids = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(prompt_len)]
        requests.append(BenchRequest(ids, output_len))
    return requests


def throughput_record(engine: str, workload: list[BenchRequest], elapsed: float, **extra: object) -> dict:
    """The result line every engine's throughput run prints: the same fields for ours and the peers'.

    Output tokens are the workload's (each request produces exactly its
    ``output_len``; runners check that before calling this).
    """
    num_out = sum(r.output_len for r in workload)
    num_prompt = sum(len(r.prompt_token_ids) for r in workload)
    return {
        "engine": engine,
        "num_requests": len(workload),
        "prompt_tokens": num_prompt,
        "output_tokens": num_out,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(workload) / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 2),
        "total_tokens_per_s": round((num_out + num_prompt) / elapsed, 2),
        **extra,
    }
