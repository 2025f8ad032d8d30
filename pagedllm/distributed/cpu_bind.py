"""The cores of each tensor-parallel rank, from a list like vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` (torch-free)."""

from __future__ import annotations


def parse_cpu_bind(spec: str | None, size: int) -> list[list[int]] | None:
    """``"0-3|4-7"`` -> ``[[0, 1, 2, 3], [4, 5, 6, 7]]``: the cores of each rank; None: no binding.

    ValueError for a malformed list or one whose rank count is not ``size``.
    """
    if spec is None:
        return None
    ranks: list[list[int]] = []
    for part in spec.split("|"):
        cores: list[int] = []
        for item in part.split(","):
            lo, _, hi = item.strip().partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
                raise ValueError(f"cpu_bind {spec!r}: {item!r} is not a core or a range of cores like 0-3")
            cores += range(int(lo), int(hi or lo) + 1)
        ranks.append(cores)
    if len(ranks) != size:
        raise ValueError(f"cpu_bind {spec!r} lists cores for {len(ranks)} ranks; tensor_parallel_size is {size}")
    return ranks
