#!/usr/bin/env bash
# llama.cpp's own benchmark tools on the bundled GGUF (after prepare.py and install.sh):
#
#   bash benchmarks/peers/llama_cpp/run_bench.sh [--jsonl]
#
#   llama-batched-bench -npp 128 -ntg 128 -npl 8,16,32,64   (batched prefill + decode)
#   llama-bench         -p 128 -n 128                        (single sequence pp / tg)
#
# Default output: the tools' markdown tables. --jsonl: their JSON lines instead, one per
# measurement, each tagged with "tool". Env: THREADS (2), PEER_DATA (/work/peer-data),
# LLAMACPP_PREFIX (/work/peer-venvs/llamacpp), MODEL (default: PEER_DATA/model.txt),
# NPL (8,16,32,64), REPS (llama-bench repetitions, 3).
set -euo pipefail

FORMAT=md
[ "${1:-}" = "--jsonl" ] && FORMAT=jsonl
THREADS="${THREADS:-2}"
DATA="${PEER_DATA:-/work/peer-data}"
PREFIX="${LLAMACPP_PREFIX:-/work/peer-venvs/llamacpp}"
NPL="${NPL:-8,16,32,64}"
REPS="${REPS:-3}"
MODEL="${MODEL:-$(cat "$DATA/model.txt" 2>/dev/null || true)}"

for t in llama-batched-bench llama-bench; do
    [ -x "$PREFIX/bin/$t" ] || { echo "run_bench.sh: $PREFIX/bin/$t missing: run benchmarks/peers/llama_cpp/install.sh" >&2; exit 1; }
done
[ -f "$MODEL" ] || { echo "run_bench.sh: model '$MODEL' missing: run benchmarks/peers/prepare.py" >&2; exit 1; }

# enough KV for the largest batch: max(npl) * (128 + 128) tokens
MAX_NPL=$(tr ',' '\n' <<<"$NPL" | sort -n | tail -1)
CTX=$(( MAX_NPL * 256 ))

note() {  # section headers: on stdout with the tables, on stderr with --jsonl
    if [ "$FORMAT" = md ]; then printf '\n%s\n' "$*"; else printf '%s\n' "$*" >&2; fi
}

tag() {  # add "tool" to each JSON line, pass other lines to stderr
    local tool=$1
    while IFS= read -r line || [ -n "$line" ]; do
        case "$line" in
            \{*) printf '{"tool": "%s", %s\n' "$tool" "${line#\{}" ;;
            *) if [ -n "$line" ]; then printf '%s\n' "$line" >&2; fi ;;
        esac
    done
}

note "# llama-batched-bench: npp 128, ntg 128, npl $NPL, threads $THREADS, ctx $CTX"
if [ "$FORMAT" = md ]; then
    "$PREFIX/bin/llama-batched-bench" -m "$MODEL" -c "$CTX" -b 2048 -ub 512 \
        -npp 128 -ntg 128 -npl "$NPL" -t "$THREADS" -tb "$THREADS" --no-kv-unified \
        --output-format md 2>/dev/null
else
    "$PREFIX/bin/llama-batched-bench" -m "$MODEL" -c "$CTX" -b 2048 -ub 512 \
        -npp 128 -ntg 128 -npl "$NPL" -t "$THREADS" -tb "$THREADS" --no-kv-unified \
        --output-format jsonl 2>/dev/null | tag llama-batched-bench
fi

note "# llama-bench: -p 128 -n 128, threads $THREADS, $REPS repetitions"
"$PREFIX/bin/llama-bench" -m "$MODEL" -p 128 -n 128 -t "$THREADS" -r "$REPS" -o "$FORMAT" 2>/dev/null \
    | if [ "$FORMAT" = md ]; then cat; else tag llama-bench; fi
