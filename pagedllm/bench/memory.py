"""``pagedllm bench memory``: paged vs contiguous KV allocation on one workload.

Same model, kernels and number of KV slots; only the allocation policy
differs. The workload was fixed before any result was seen:

- 48 requests, all arriving at once; prompts of 32-128 random tokens;
- output lengths long-tailed: lognormal (median 96 tokens, sigma 1.0),
  capped so that prompt + output fits max_model_len (1024); EOS ignored, so
  each request stops exactly at its length;
- 4096 KV slots (256 blocks of 16), max_num_seqs 64, prefix caching off
  for both (nothing is shared: the policy is the only difference);
- contiguous reserves max_model_len per request (the output length is not
  known up front, the case the seed describes); ``--contiguous-reserve
  max_tokens`` instead reserves prompt + the true output length, the
  baseline's best case.

Per step we record slots written (K/V present), reserved but empty, free,
and requests running. ``waste_fraction`` is reserved-but-empty over reserved
slots, averaged over steps. The KV pool is also bytes: ``kv_reserved_bytes``
(its address space, ``kv_bytes_per_block`` a block), ``kv_peak_resident_bytes``
(the most of it the OS held after a step, measured with ``mincore``) and
``kv_drained_resident_bytes`` (held once the run is over: the paged engine
gives back the pages of blocks that hold nothing, the contiguous baseline
keeps what it wrote). ``--html`` also records every block's fill per
step and writes both pools replayed side by side (``memory_report.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass

from pagedllm.bench.workload import TOKEN_ID_HIGH, TOKEN_ID_LOW
from pagedllm.engine.kv_snapshot import fill_levels


@dataclass(frozen=True)
class MemoryWorkload:
    num_requests: int = 48
    min_prompt: int = 32
    max_prompt: int = 128
    median_output: int = 96
    sigma: float = 1.0
    max_model_len: int = 1024
    block_size: int = 16
    num_kv_slots: int = 4096
    seed: int = 2024

    def requests(self) -> list[tuple[list[int], int]]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            prompt_len = rng.randint(self.min_prompt, self.max_prompt)
            output_len = int(rng.lognormvariate(math.log(self.median_output), self.sigma))
            output_len = max(1, min(output_len, self.max_model_len - prompt_len))
            ids = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(prompt_len)]
            out.append((ids, output_len))
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=MemoryWorkload.num_requests)
    p.add_argument("--num-kv-slots", type=int, default=MemoryWorkload.num_kv_slots)
    p.add_argument("--bench-max-model-len", type=int, default=MemoryWorkload.max_model_len)
    p.add_argument("--contiguous-reserve", default="max_model_len", choices=["max_model_len", "max_tokens"])
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    p.add_argument("--plot", default=None, help="write a PNG of slot use over time (matplotlib)")
    p.add_argument("--html", default=None,
                   help="write one self-contained page replaying both block pools over time, side by side")
    p.add_argument("--model", default=None)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--window-blocks", action="store_true",
                   help="print the KV blocks Gemma 3 (1B, 4B shapes) needs at 8k and 32k tokens with one KV cache "
                        "group and with window groups (no model run: bench/window_blocks.py)")


def run_allocator(model: str | None, workload: MemoryWorkload, allocator: str, reserve: str,
                  num_threads: int | None, frames: list[tuple[float, str, int]] | None = None) -> tuple[dict, dict]:
    """Run the workload under one allocator; return its summary and its timeline.

    With ``frames``, appends (seconds, per-block fill levels, requests running)
    after every step, and a last all-free frame.
    """
    from pagedllm.engine.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    bs = workload.block_size
    policy = {"kv_allocator": allocator}
    if allocator == "contiguous":
        policy["contiguous_reserve"] = reserve
    llm = LLM(
        model,
        **policy,
        enable_prefix_caching=False,
        num_kv_blocks=workload.num_kv_slots // bs,
        block_size=bs,
        max_model_len=workload.max_model_len,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        num_threads=num_threads,
    )
    engine = llm.llm_engine
    # warm-up outside the measurement
    llm.generate([{"prompt_token_ids": [TOKEN_ID_LOW] * 8}], SamplingParams(max_tokens=2), use_tqdm=False)
    requests = workload.requests()
    for i, (ids, out_len) in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(f"mem-{i}", {"prompt_token_ids": ids}, params)
    scheduler, pool, runner = engine.scheduler, engine.block_manager, engine.model_runner
    peak_resident = runner.kv_resident_bytes
    state_slots = getattr(pool, "state_slots", None)  # a hybrid model's (docs/hybrid-models.md)
    peak_slots = peak_snapshots = 0
    timeline = {"t": [], "written": [], "empty": [], "free": [], "running": []}
    wastes: list[float] = []
    # blocks held per KV cache group at the step that held the most (kv_groups.py; one group without windows)
    peak_group_blocks: list[int] = [0] * getattr(pool, "num_groups", 1)
    num_out = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                num_out += len(out.outputs[0].token_ids)
        written = sum(s.num_computed_tokens for s in scheduler.running)
        reserved = pool.num_used_blocks * bs
        if reserved:
            wastes.append((reserved - written) / reserved)
        timeline["t"].append(time.perf_counter() - start)
        timeline["written"].append(written)
        timeline["empty"].append(reserved - written)
        timeline["free"].append(pool.num_free_blocks * bs)
        timeline["running"].append(scheduler.num_running)
        if hasattr(pool, "num_used_blocks_per_group") and pool.num_used_blocks > sum(peak_group_blocks):
            peak_group_blocks = pool.num_used_blocks_per_group()
        # mincore over the pool: the OS's own count (the contiguous baseline keeps no bookkeeping of it)
        peak_resident = max(peak_resident, runner.kv_resident_bytes)
        if state_slots is not None:
            peak_slots = max(peak_slots, state_slots.num_used)
            peak_snapshots = max(peak_snapshots, 0 if pool.snapshots is None else len(pool.snapshots))
        if frames is not None:
            frames.append((timeline["t"][-1], fill_levels(pool.ref_counts, bs, scheduler.running),
                           scheduler.num_running))
    elapsed = time.perf_counter() - start
    if frames is not None:
        frames.append((elapsed, fill_levels(pool.ref_counts, bs, []), 0))
    if pool.num_free_blocks != pool.num_blocks:
        raise RuntimeError(f"{allocator}: {pool.num_used_blocks} blocks still held after the run")
    running = [r for r in timeline["running"]]
    summary = {
        "waste_fraction": round(sum(wastes) / len(wastes), 4),
        "peak_running": max(running),
        "mean_running": round(sum(running) / len(running), 2),
        "fragmentation_waits": getattr(pool, "num_fragmentation_waits", 0),
        "peak_blocks_per_group": peak_group_blocks,
        "kv_groups": kv_group_summary(runner, peak_group_blocks),
        "num_preemptions": scheduler.num_preemptions,
        "num_steps": len(running),
        "output_tokens": num_out,
        "output_tokens_per_s": round(num_out / elapsed, 2),
        "elapsed_s": round(elapsed, 2),
        "kv_bytes_per_block": runner.kv_bytes_per_block,
        "kv_reserved_bytes": runner.kv_cache_bytes,
        "kv_peak_resident_bytes": peak_resident,
        "kv_drained_resident_bytes": runner.kv_resident_bytes,
    }
    if allocator == "contiguous":
        summary["reserve"] = reserve
    if state_slots is not None:
        summary.update(state_summary(runner, peak_slots, peak_snapshots))
    return summary, timeline


def kv_group_summary(runner: object, peak_blocks: list[int]) -> list[dict]:
    """Each KV cache group of the runner's layout (kv_groups.py): kind, window, layers, and the blocks (and
    bytes: every block of the one pool has the same size) it held at the step that held the most."""
    layout = getattr(runner, "kv_layout", None)
    if layout is None or len(layout.groups) != len(peak_blocks):  # an allocator without groups
        return [{"group": 0, "kind": "full", "window": None, "layers": [], "peak_blocks": sum(peak_blocks),
                 "peak_bytes": sum(peak_blocks) * runner.kv_bytes_per_block}]
    return [
        {"group": g, "kind": "full" if group.window is None else "window", "window": group.window,
         "layers": list(group.layers), "peak_blocks": n, "peak_bytes": n * runner.kv_bytes_per_block}
        for g, (group, n) in enumerate(zip(layout.groups, peak_blocks))
    ]


def state_summary(runner: object, peak_slots: int, peak_snapshots: int) -> dict:
    """A hybrid model's state slots (docs/hybrid-models.md): running, snapshot and checkpoint slots, each
    with its bytes (rows of the same state tensors, ``state_bytes_per_slot`` each), and the peaks used."""
    per_slot = runner.state_bytes_per_slot
    return {
        "state_slots": runner.num_state_slots, "state_peak_used_slots": peak_slots,
        "state_snapshot_slots": runner.num_snapshot_slots, "state_peak_snapshots": peak_snapshots,
        "state_checkpoint_slots": runner.num_checkpoint_slots, "state_bytes_per_slot": per_slot,
        "state_slot_bytes": runner.num_state_slots * per_slot,
        "state_snapshot_bytes": runner.num_snapshot_slots * per_slot,
        "state_checkpoint_bytes": runner.num_checkpoint_slots * per_slot,
        "state_reserved_bytes": (runner.num_state_slots + runner.num_snapshot_slots
                                 + runner.num_checkpoint_slots) * per_slot,
    }


def print_groups_and_state(summary: dict) -> None:
    """The paged run's KV cache groups and state slots, for a terminal."""
    print("KV cache groups (peak: the step holding the most blocks)")
    print(f"{'group':>5}  {'kind':<10} {'layers':<24} {'peak blocks':>11} {'MiB':>9}")
    for g in summary["kv_groups"]:
        kind = "full" if g["window"] is None else f"window {g['window']}"
        layers = " ".join(map(str, g["layers"])) or "all"
        print(f"{g['group']:>5}  {kind:<10} {layers:<24} {g['peak_blocks']:>11} {g['peak_bytes'] / 2**20:>9.2f}")
    if "state_slots" not in summary:
        return
    mib = summary["state_bytes_per_slot"] / 2**20
    print(f"state slots ({mib:.3f} MiB each)   slots  peak used      MiB")
    for name, key, peak in (("running", "state_slots", "state_peak_used_slots"),
                            ("prefix snapshots", "state_snapshot_slots", "state_peak_snapshots"),
                            ("spec. checkpoints", "state_checkpoint_slots", None)):
        used = "-" if peak is None else summary[peak]
        print(f"  {name:<28} {summary[key]:>5}  {used:>9}  {summary[key] * mib:>7.2f}")
    print(f"  {'reserved':<28} {'':>5}  {'':>9}  {summary['state_reserved_bytes'] / 2**20:>7.2f}")


def _allocators(model: str | None) -> tuple[str, ...]:
    """The allocators to compare: a hybrid model's state slots live in the paged block manager only."""
    if model is not None:
        from pagedllm.loader import load_model_config

        if load_model_config(model).has_state_layers:
            return ("paged",)
    return ("contiguous", "paged")


def plot(timelines: dict[str, dict], path: str, kv_slots: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 3.2 * len(timelines)), sharex=True)
    for ax, (name, tl) in zip(axes, timelines.items()):
        ax.stackplot(tl["t"], tl["written"], tl["empty"], tl["free"],
                     labels=["written", "reserved but empty", "free"],
                     colors=["#2a9d8f", "#e76f51", "#d9d9d9"])
        ax.set_ylim(0, kv_slots)
        ax.set_ylabel("KV slots")
        ax.set_title(name)
        twin = ax.twinx()
        twin.plot(tl["t"], tl["running"], color="black", linewidth=1.2, label="requests running")
        twin.set_ylabel("requests running")
        twin.set_ylim(0, max(max(t["running"]) for t in timelines.values()) * 1.1)
        if ax is axes[0]:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = twin.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> dict:
    if getattr(args, "window_blocks", False):
        from pagedllm.bench.window_blocks import print_window_blocks, window_block_rows

        rows = window_block_rows()
        print_window_blocks(rows)
        if args.json:
            print(json.dumps({"window_blocks": rows}))
        return {"window_blocks": rows}
    workload = MemoryWorkload(
        num_requests=args.num_requests, num_kv_slots=args.num_kv_slots, max_model_len=args.bench_max_model_len
    )
    results, timelines, replays = {}, {}, {}
    html = getattr(args, "html", None)
    for allocator in _allocators(args.model):
        frames: list[tuple[float, str, int]] | None = [] if html else None
        summary, timeline = run_allocator(
            args.model, workload, allocator, args.contiguous_reserve, args.num_threads, frames
        )
        results[allocator] = summary
        label = f"contiguous (reserve {args.contiguous_reserve})" if allocator == "contiguous" else "paged"
        timelines[label] = timeline
        if frames is not None:
            replays[label] = (frames, summary)
        print(f"{allocator:>10}: " + ", ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    print("KV pool (MiB)   reserved  peak resident  drained resident  bytes a block")
    for allocator, r in results.items():
        print(f"{allocator:>10}    {r['kv_reserved_bytes'] / 2**20:9.1f}  {r['kv_peak_resident_bytes'] / 2**20:13.1f}"
              f"  {r['kv_drained_resident_bytes'] / 2**20:16.1f}  {r['kv_bytes_per_block']:13d}")
    p = results["paged"]
    print_groups_and_state(p)
    ratios = None
    if "contiguous" in results:
        c = results["contiguous"]
        ratios = {
            "mean_running": round(p["mean_running"] / c["mean_running"], 2),
            "output_tokens_per_s": round(p["output_tokens_per_s"] / c["output_tokens_per_s"], 2),
        }
        print(f"paged / contiguous: mean concurrency x{ratios['mean_running']}, "
              f"throughput x{ratios['output_tokens_per_s']}")
    if args.plot:
        plot(timelines, args.plot, workload.num_kv_slots)
        print(f"plot written to {args.plot}")
    if html:
        from pagedllm.bench.memory_report import write_report

        write_report(html, replays, workload.block_size, workload.num_kv_slots // workload.block_size)
        print(f"report written to {html}")
    report = {
        "workload": {
            "num_requests": workload.num_requests,
            "prompt_len": [workload.min_prompt, workload.max_prompt],
            "output_len": f"lognormal(median={workload.median_output}, sigma={workload.sigma}), capped",
            "max_model_len": workload.max_model_len,
            "block_size": workload.block_size,
            "seed": workload.seed,
            "contiguous_reserve": args.contiguous_reserve,
        },
        "kv_slots": workload.num_kv_slots,
        "allocators": results,
        "ratios_paged_over_contiguous": ratios,
    }
    if args.json:
        print(json.dumps(report))
    return report
