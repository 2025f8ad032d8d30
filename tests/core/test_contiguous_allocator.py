"""The contiguous baseline: first fit, whole-run release, fragmentation waits; same tokens as paged."""

from __future__ import annotations

import random

import pytest

from pagedllm.engine.contiguous_allocator import ContiguousAllocator
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence


def _seq(prompt_len: int, reserve_len: int, block_size: int = 4) -> Sequence:
    seq = Sequence(list(range(100, 100 + prompt_len)), block_size)
    seq.reserve_len = reserve_len
    return seq


def test_reserves_the_maximum_length_as_one_first_fit_run() -> None:
    pool = ContiguousAllocator(num_blocks=10, block_size=4)
    a = _seq(3, reserve_len=9)  # ceil(9 / 4) = 3 blocks although 3 tokens need 1
    b = _seq(5, reserve_len=8)  # 2 blocks
    assert pool.allocate(a) and pool.allocate(b)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4]
    assert pool.num_free_blocks == 5
    # decode never needs another block: the reservation covers the maximum
    for t in range(6):
        a.append_token(t)
        assert pool.append_slot(a)
    assert a.block_table == [0, 1, 2]


def test_release_returns_the_run_and_first_fit_reuses_the_lowest_hole() -> None:
    pool = ContiguousAllocator(num_blocks=8, block_size=4)
    a, b, c = _seq(4, 8), _seq(4, 8), _seq(4, 8)
    for s in (a, b, c):
        assert pool.allocate(s)
    assert [a.block_table, b.block_table, c.block_table] == [[0, 1], [2, 3], [4, 5]]
    pool.free(a)
    assert pool.num_free_blocks == 4 and pool.is_free[:2] == [True, True]
    d = _seq(2, 4)  # one block: first fit takes block 0
    assert pool.allocate(d)
    assert d.block_table == [0]


def test_a_request_waits_when_no_run_fits_although_enough_blocks_are_free() -> None:
    pool = ContiguousAllocator(num_blocks=8, block_size=4)
    seqs = [_seq(4, 8) for _ in range(4)]  # 4 runs of 2 blocks fill the pool
    for s in seqs:
        assert pool.allocate(s)
    pool.free(seqs[0])
    pool.free(seqs[2])  # free: blocks 0-1 and 4-5, 4 in total but no run of 3
    big = _seq(4, 12)
    assert pool.num_free_blocks == 4
    assert pool.allocate(big) is False
    assert big.block_table == [] and pool.num_free_blocks == 4
    assert pool.num_fragmentation_waits == 1
    huge = _seq(4, 20)  # 5 blocks: more than is free at all, not fragmentation
    assert pool.allocate(huge) is False
    assert pool.num_fragmentation_waits == 1 and pool.num_capacity_waits == 1
    pool.free(seqs[1])  # blocks 0-5 now one run
    assert pool.allocate(big) and big.block_table == [0, 1, 2]


def test_scheduler_keeps_requests_waiting_until_a_run_is_free() -> None:
    pool = ContiguousAllocator(num_blocks=6, block_size=4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [_seq(4, 12) for _ in range(3)]  # 3 blocks each: two fit at a time
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert list(sched.waiting) == [seqs[2]]
    sched.update(out)
    sched.finish(seqs[0], seqs[0].status.FINISHED_LENGTH)
    out = sched.schedule()
    assert seqs[2] in [s.seq for s in out.scheduled]
    assert seqs[2].block_table == [0, 1, 2]


def test_sharing_is_refused() -> None:
    pool = ContiguousAllocator(num_blocks=4, block_size=4)
    a = _seq(4, 8)
    assert pool.allocate(a)
    with pytest.raises(ValueError):
        pool.fork(a, a.fork(1))


@pytest.mark.slow
def test_same_greedy_tokens_under_both_allocators(tiny_model_dirs) -> None:  # noqa: ANN001
    import torch

    from pagedllm import LLM, SamplingParams

    rng = random.Random(21)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(n)]} for n in (5, 17, 30, 9, 41, 12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # one thread for both (the tiny model gains nothing from more); the process's pool is put back after
    kwargs = dict(num_kv_blocks=48, max_model_len=128, block_size=8, num_threads=1)
    num_threads = torch.get_num_threads()
    try:
        paged = LLM(tiny_model_dirs["llama"], **kwargs)
        contiguous = LLM(tiny_model_dirs["llama"], kv_allocator="contiguous", contiguous_reserve="max_model_len",
                         **kwargs)
        want = [o.outputs[0].token_ids for o in paged.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in contiguous.generate(prompts, params, use_tqdm=False)]
    finally:
        torch.set_num_threads(num_threads)
    assert got == want
    pool = contiguous.llm_engine.block_manager
    assert isinstance(pool, ContiguousAllocator)
    assert pool.num_free_blocks == 48
    # 48 blocks hold three 16-block reservations at a time: the other requests waited
    assert pool.num_capacity_waits + pool.num_fragmentation_waits > 0
    with pytest.raises(ValueError):
        contiguous.generate(prompts[0], SamplingParams(n=2), use_tqdm=False)


# head_dim 32 and 2 KV heads: one block of one layer's K (or V) is a whole 4 KiB page in float32, so a freed
# block's pages can go back to the OS (the tiny Llama's 2 KiB blocks share pages with their neighbours)
MEMORY_BENCH_ARCH = "qwen3"


@pytest.mark.slow
def test_bench_memory_reports_both_allocators(tmp_path, tiny_model_dirs) -> None:  # noqa: ANN001
    import json
    import subprocess
    import sys

    plot, html = tmp_path / "memory.png", tmp_path / "memory.html"
    # the tiny model on one thread: what is checked (slots, reservations, pages, the report) depends on neither
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "memory", "--num-requests", "6",
           "--num-kv-slots", "512", "--bench-max-model-len", "128", "--json", "--plot", str(plot),
           "--html", str(html), "--model", tiny_model_dirs[MEMORY_BENCH_ARCH], "--num-threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["kv_slots"] == 512
    c, p = report["allocators"]["contiguous"], report["allocators"]["paged"]
    assert c["output_tokens"] == p["output_tokens"] > 0
    # 512 slots hold four 128-token reservations: contiguous never runs more than 4
    assert c["peak_running"] <= 4 < p["peak_running"]
    # paged wastes at most each request's last partial block
    assert p["waste_fraction"] < c["waste_fraction"]
    # the pool in bytes: the same reservation (32 blocks, the runner's padding block besides); the OS backs
    # what was written; drained, the paged engine gives its pages back, the contiguous baseline keeps them
    for r in (c, p):
        assert r["kv_reserved_bytes"] >= 32 * r["kv_bytes_per_block"] > 0
        assert 0 < r["kv_peak_resident_bytes"] <= r["kv_reserved_bytes"]
    assert c["kv_drained_resident_bytes"] == c["kv_peak_resident_bytes"]
    assert p["kv_drained_resident_bytes"] <= p["kv_peak_resident_bytes"] // 4
    assert "drained resident" in out.stdout
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    # the replay page: both runs, one fill character per block (32 blocks of 16) in every frame,
    # the contiguous run reserving blocks it has not written, both pools free at the end
    text = html.read_text()
    data = json.loads(text.split('type="application/json">', 1)[1].split("</script>", 1)[0])
    assert [r["label"] for r in data["runs"]] == ["contiguous (reserve max_model_len)", "paged"]
    for run in data["runs"]:
        assert all(len(f) == 32 for f in run["fill"]) and run["fill"][-1] == "." * 32
        assert run["t"] == sorted(run["t"])
    assert any("0" in f for f in data["runs"][0]["fill"])
