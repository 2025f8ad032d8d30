#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-batched-bench, llama-bench and llama-quantize from the copy of
# llama.cpp vendored in the PyPI sdist of llama-cpp-python (PyPI is the only source
# reachable here), CPU only, Release, native CPU flags, static binaries.
#
#   bash benchmarks/peers/llama_cpp/install.sh [PREFIX]       (default /work/peer-venvs/llamacpp)
#
# Result: PREFIX/bin/{llama-server,llama-batched-bench,llama-bench,llama-quantize}, plus PREFIX/VERSION.
# Only the binaries missing from PREFIX/bin are built.
# Env: LLAMA_CPP_PYTHON_VERSION (0.3.36), JOBS (2), WITH_PYTHON=1 to also pip-install
# llama-cpp-python into PREFIX/venv (a second full compile of llama.cpp; off by default),
# EXTRA_TARGETS: more llama.cpp targets, space-separated, built and installed the same way
# (e.g. EXTRA_TARGETS=llama-perplexity for benchmarks/peers/llama_cpp/perplexity.sh).
set -euo pipefail

PKG_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PREFIX="${1:-${LLAMACPP_PREFIX:-/work/peer-venvs/llamacpp}}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-python3}"
TARGETS=(llama-server llama-batched-bench llama-bench llama-quantize)
# shellcheck disable=SC2206  # word splitting of the space-separated list is wanted
TARGETS+=(${EXTRA_TARGETS:-})

have_all() {
    for t in "${TARGETS[@]}"; do [ -x "$PREFIX/bin/$t" ] || return 1; done
    [ "$(cat "$PREFIX/VERSION" 2>/dev/null)" = "llama-cpp-python==$PKG_VERSION" ]
}

mkdir -p "$PREFIX/bin" "$PREFIX/src"
if have_all; then
    echo "llama.cpp binaries (llama-cpp-python==$PKG_VERSION) already in $PREFIX/bin"
else
    SDIST="$PREFIX/src/llama_cpp_python-$PKG_VERSION.tar.gz"
    if [ ! -f "$SDIST" ]; then
        "$PY" -m pip download --no-binary llama-cpp-python --no-deps -d "$PREFIX/src" "llama-cpp-python==$PKG_VERSION"
    fi
    SRC="$PREFIX/src/llama_cpp_python-$PKG_VERSION"
    [ -d "$SRC" ] || tar -xzf "$SDIST" -C "$PREFIX/src"
    LLAMA="$SRC/vendor/llama.cpp"
    [ -f "$LLAMA/CMakeLists.txt" ] || { echo "no vendored llama.cpp in $SRC" >&2; exit 1; }

    # UI off and no prebuilt-UI download (that would fetch from the HF hub);
    # no OpenSSL/HTTPS client (models are local files).
    cmake -S "$LLAMA" -B "$SRC/build" \
        -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF
    MISSING=()
    for t in "${TARGETS[@]}"; do
        if [ ! -x "$PREFIX/bin/$t" ] || [ "$(cat "$PREFIX/VERSION" 2>/dev/null)" != "llama-cpp-python==$PKG_VERSION" ]; then
            MISSING+=("$t")
        fi
    done
    cmake --build "$SRC/build" --config Release -j "$JOBS" --target "${MISSING[@]}"
    for t in "${MISSING[@]}"; do
        install -m 755 "$SRC/build/bin/$t" "$PREFIX/bin/$t"
    done
    echo "llama-cpp-python==$PKG_VERSION" > "$PREFIX/VERSION"
    # keep the sources small: drop the object files, keep the tarball
    rm -rf "$SRC"
fi

if [ "${WITH_PYTHON:-0}" = "1" ]; then
    [ -x "$PREFIX/venv/bin/python" ] || "$PY" -m venv "$PREFIX/venv"
    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$PREFIX/venv/bin/python" -m pip install --no-binary llama-cpp-python \
        "llama-cpp-python==$PKG_VERSION"
fi

"$PREFIX/bin/llama-server" --version 2>&1 | grep -i version || true
du -sh "$PREFIX"
