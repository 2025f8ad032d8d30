#!/usr/bin/env bash
# Alternate two checkouts of pagedllm on the same machine, one virtualenv: LLM() start-up, the 64-request
# workload and one-sequence latency, base then new in each round (BENCHMARKS.md: compare only alternated runs).
#   benchmarks/before_after.sh BASE_TREE NEW_TREE [ROUNDS]
# e.g. git worktree add --detach /tmp/base <commit>; benchmarks/before_after.sh /tmp/base "$PWD" 3
set -u
base=${1:?base tree}; new=${2:?new tree}; rounds=${3:-2}
py=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
for round in $(seq "$rounds"); do
  for tree in "$base" "$new"; do
    echo "== $tree round $round $(date -u +%H:%M:%S)"
    (cd "$tree" && PYTHONPATH="$tree" "$py" -c "
import time; t = time.perf_counter()
from pagedllm import LLM
LLM(); print('startup_s', round(time.perf_counter() - t, 2))" 2>/dev/null | tail -1)
    (cd "$tree" && PYTHONPATH="$tree" "$py" -m pagedllm.entrypoints.cli bench throughput --json 2>/dev/null | tail -1)
    (cd "$tree" && PYTHONPATH="$tree" "$py" -m pagedllm.entrypoints.cli bench latency --batch-size 1 \
        --input-len 128 --output-len 128 --num-iters 6 --json 2>/dev/null | tail -1)
  done
done
