"""Alternated before/after runs of the refactor benchmarks on two checkouts of this repository.

    .venv/bin/python benchmarks/before_after.py /tmp/base .  [--rounds 2]

Each round runs, for BASE then NEW (each a repository root, imported through
PYTHONPATH so the same virtualenv serves both): the 64-request offline
workload (``bench throughput``), one-sequence decode (``bench latency``) and
32-sequence decode (``bench latency --batch-size 32``), and prints one line
per run and a summary of medians with the NEW/BASE ratio. Runs alternate so
that a shared host's drift hits both checkouts alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# (label, bench arguments, the JSON field reported)
BENCHES: list[tuple[str, list[str], str]] = [
    ("64-request workload, output tok/s", ["throughput"], "output_tokens_per_s"),
    ("1-sequence decode, tok/s", ["latency", "--num-iters", "3"], "decode_tokens_per_s"),
    ("32-sequence decode, tok/s", ["latency", "--batch-size", "32", "--num-iters", "2"], "decode_tokens_per_s"),
]


def run_bench(root: Path, args: list[str]) -> dict:
    """One ``pagedllm bench ... --json`` run in ``root``'s code; its JSON result."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", *args, "--json"]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def find(result: dict, field: str) -> float:
    """``field`` in a bench result (top level, or one level down)."""
    if field in result:
        return float(result[field])
    for value in result.values():
        if isinstance(value, dict) and field in value:
            return float(value[field])
    raise KeyError(f"{field} not in {sorted(result)}")


def main() -> None:
    """Run the rounds and print every figure, then medians and ratios."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", type=int, default=None, help="run only BENCHES[i]")
    a = p.parse_args()
    benches = BENCHES if a.only is None else [BENCHES[a.only]]
    figures: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        for label, args, field in benches:
            for name, root in (("base", a.base.resolve()), ("new", a.new.resolve())):
                value = find(run_bench(root, args), field)
                figures.setdefault((label, name), []).append(value)
                print(f"round {r + 1}  {name:4}  {label}: {value:.1f}", flush=True)
    print()
    for label, _, _ in benches:
        base = statistics.median(figures[(label, "base")])
        new = statistics.median(figures[(label, "new")])
        print(f"{label}: base {base:.1f}, new {new:.1f}, new/base {new / base:.2f}")


if __name__ == "__main__":
    main()
