"""The ``pagedllm`` console script: each command (generate, chat, bench throughput, bench latency, env) and a
refused flag run for real in a subprocess; the other cases call the same entry point, ``cli.main(argv)``, in
this process (capturing what it prints), which saves each of them a Python start and torch's import.

Every model-loading command gets ``--num-threads 1``: on a small shared CPU
box two OpenMP threads stall each other when another process runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.bench.workload import make_workload
from pagedllm.entrypoints import cli

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

SCRIPT = Path(sys.executable).parent / "pagedllm"
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "pagedllm.entrypoints.cli"]
ENGINE = ["--num-kv-blocks", "128", "--max-model-len", "1024", "--num-threads", "1"]
TIMEOUT = 300


def run_cli(*args: str, stdin: str | None = None, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for name in unset:
        env.pop(name, None)
    return subprocess.run(
        [*COMMAND, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )


def run_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """``pagedllm ARGS`` through ``cli.main`` in this process, as ``run_cli`` reports a subprocess.

    ``--num-threads`` sizes torch's pool for the whole process: put back what later tests had.
    """
    capsys.readouterr()  # what earlier output the test printed is not this command's
    num_threads = torch.get_num_threads()
    try:
        code = cli.main(list(args))
    finally:
        torch.set_num_threads(num_threads)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["pagedllm", *args], code, out, err)


def assert_no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout, proc.stdout


# --- generate ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generate_run():
    return run_cli("generate", "The capital of France is", "--temperature", "0", "--max-tokens", "8", *ENGINE)


def test_generate_prints_prompt_text_and_stats(generate_run):
    proc = generate_run
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    lines = proc.stdout.splitlines()
    assert "=== prompt: 'The capital of France is'" in lines
    i = lines.index("=== prompt: 'The capital of France is'")
    text = lines[i + 1]
    assert text.strip()  # the continuation
    assert "Paris" in text  # greedy SmolLM2 knows this much
    # a one-line continuation is followed by its token count; a longer one spans lines
    assert "    (8 tokens, finish_reason=length)" in lines[i + 1 :]
    stats = lines[-1]
    # 5 prompt tokens + 8 output tokens fit in one block of 16
    m = re.fullmatch(
        r"1 prompts, 8 output tokens in ([\d.]+)s \(([\d.]+) tokens/s\); "
        r"KV blocks: peak (\d+) used of 128 \(block_size 16\), 0 held now",
        stats,
    )
    assert m, stats
    assert float(m.group(2)) > 0
    assert int(m.group(3)) == 1


def test_generate_with_speculation_prints_acceptance_and_mean_length(capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "cost_model": false}'
    prompt = "Repeat exactly: red green blue red green blue red green blue red green blue"
    proc = run_in_process(capsys, "generate", prompt, "--temperature", "0", "--max-tokens", "24", "--speculative-config", spec, *ENGINE)
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    m = re.fullmatch(
        r"speculative decoding: (\d+) of (\d+) draft tokens accepted \((\d+)%\) in (\d+) verify steps, "
        r"mean acceptance length ([\d.]+)",
        proc.stdout.splitlines()[-1],
    )
    assert m, proc.stdout
    accepted, drafted, percent, steps, length = (float(g) for g in m.groups())
    assert steps > 0 and drafted >= steps and accepted <= drafted  # a one-token n-gram recurs: drafts were verified
    assert percent == round(100 * accepted / drafted)
    assert length == pytest.approx(1 + accepted / steps, abs=0.005)


def test_generate_chat_many_prompts_in_order(capsys):
    proc = run_in_process(
        capsys, "generate", "--chat", "Hello", "What is the capital of France?",
        # float32 activations answer "The capital of France is Paris."; 8-bit ones take the first token's
        # near-tie the other way ("L" at -1.96 against "The" at -1.88 in float32) and answer "L'Etoile..."
        "--temperature", "0", "--max-tokens", "8", "--gguf-activations", "float32", *ENGINE,
    )
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    out = proc.stdout
    first = out.index("=== prompt: 'Hello'")
    second = out.index("=== prompt: 'What is the capital of France?'")
    assert first < second
    assert "Paris" in out[second:]
    # the chat template's markers are not echoed as text
    assert "<|im_start|>" not in out
    assert re.search(r"^2 prompts, \d+ output tokens in ", out.splitlines()[-1])


# --- errors ---------------------------------------------------------------------------


def test_invalid_flag_value_exits_nonzero_without_traceback():
    proc = run_cli("generate", "hello", "--top-p", "2", *ENGINE)
    assert proc.returncode != 0
    assert_no_traceback(proc)
    assert "top_p" in proc.stderr
    assert "2.0" in proc.stderr
    assert proc.stderr.strip().startswith("error:")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", "hi", "--temperature", "-1"], ["temperature"]),
        (["generate", "hi", "--max-tokens", "0"], ["max_tokens"]),
        (["generate", "hi", "--n", "0"], ["n must"]),
        (["generate", "hi", "--top-k", "-2"], ["top_k"]),
        (["generate", "hi", "--min-p", "1.5"], ["min_p"]),
        (["generate", "hi", "--stop", ""], ["empty"]),
        (["generate", "hi", "--num-kv-blocks", "4", "--max-model-len", "1024"], ["num_kv_blocks"]),
        (["generate", "hi", "--block-size", "0"], ["block_size"]),
        (["generate", "hi", "--model", "/no/such/model.gguf"], ["/no/such/model.gguf"]),
        (["chat", "--top-p", "0"], ["top_p"]),
        (["bench", "throughput", "--num-requests", "0"], ["num_requests"]),
        (["bench", "throughput", "--min-len", "9", "--max-len", "8"], ["min_len"]),
        (["bench", "latency", "--output-len", "1"], ["--output-len"]),
        (["bench", "latency", "--batch-size", "0"], ["--batch-size"]),
        (["generate", "hi", "--quantization", "int8", "--dtype", "bfloat16"], ["float32"]),
        (["generate", "hi", "--quantization", "int4", "--quantization-group-size", "48"], ["multiple of 32"]),
        (["generate", "hi", "--quantization-group-size", "64"], ["int8' or 'int4' only"]),
    ],
)
def test_bad_values_give_an_error_line_and_status_2(capsys, argv, words):
    # in-process: these fail before any model weights are read
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for w in words:
        assert w in err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["generate"],  # no prompt
        ["generate", "hi", "--max-tokens", "many"],
        ["generate", "hi", "--dtype", "int3"],
        ["bench"],
        ["nonsense"],
    ],
)
def test_usage_errors_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "chat", "bench"):
        assert cmd in out


# --- chat ----------------------------------------------------------------------------


def test_chat_replies_and_reset_forgets():
    proc = run_cli(
        # the second "Hello" hits the prefix cache, which by default sums in another order than the first's
        # whole prompt did, and on 8-bit activations a last-bit difference can move a rounding step and a
        # near-tie (seen on AVX2 kernels); --batch-invariant gives a request the same bits with or without
        # a prefix hit (docs/batch-invariance.md), so the two replies are equal by construction
        "chat", "--temperature", "0", "--max-tokens", "8", "--batch-invariant", *ENGINE,
        stdin="Hello\n/reset\nHello\n/exit\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    out = proc.stdout
    assert out.startswith("pagedllm chat:")
    # "> " is printed before each input line: Hello, /reset, Hello, /exit
    turns = out.split("> ")
    assert len(turns) == 5, out
    first, reset, second, last = turns[1], turns[2], turns[3], turns[4]
    assert first.strip(), out  # a reply was printed
    assert reset == ""  # /reset prints nothing
    # greedy, and the history was forgotten: the same question gets the same reply
    assert second == first
    assert last == ""


# --- bench --------------------------------------------------------------------------


def test_bench_throughput_json():
    proc = run_cli(
        "bench", "throughput", "--num-requests", "4", "--min-len", "8", "--max-len", "16",
        "--workload-seed", "7", "--json",
        "--num-kv-blocks", "128", "--max-model-len", "512", "--num-threads", "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    workload = make_workload(4, 8, 16, 7)
    assert result["num_requests"] == 4
    assert result["output_tokens"] == sum(r.output_len for r in workload)
    assert result["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in workload)
    assert result["num_kv_blocks"] == 128
    # four sequences of at most 32 tokens hold at most 2 blocks each
    assert 4 <= result["peak_kv_blocks_used"] <= 8
    assert result["num_preemptions"] == 0
    assert result["elapsed_s"] > 0 and result["output_tokens_per_s"] > 0


def test_bench_throughput_structured_keeps_the_workload_lengths(capsys):
    proc = run_in_process(
        capsys, "bench", "throughput", "--num-requests", "3", "--min-len", "8", "--max-len", "16",
        "--workload-seed", "7", "--json", "--structured",
        "--num-kv-blocks", "128", "--max-model-len", "512", "--num-threads", "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["structured"] is True
    # the run checks every request produced its output_len under the schema
    assert result["output_tokens"] == sum(r.output_len for r in make_workload(3, 8, 16, 7))
    refused = run_in_process(capsys, "bench", "throughput", "--structured", "--compare", "transformers")
    assert refused.returncode != 0 and "--structured" in refused.stderr
    assert_no_traceback(refused)


def test_bench_throughput_compare_transformers(tiny_model_dirs, capsys):
    """Our line, then one line per transformers peer, on the same workload and model."""
    proc = run_in_process(
        capsys, "bench", "throughput", "--model", tiny_model_dirs["llama"], "--num-requests", "3", "--min-len", "4",
        "--max-len", "8", "--json", "--compare", "transformers", "--peer-batch-size", "2",
        "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["engine"] for r in lines] == ["pagedllm", "transformers-generate-padded", "transformers-continuous-batching"]
    want_out = sum(r.output_len for r in make_workload(3, 4, 8, 1234))
    for r in lines:
        assert r["num_requests"] == 3 and r["output_tokens"] == want_out
    padded = lines[1]
    # batches of 2 and 1 each generate their longest output for every row (the first two requests' output
    # lengths differ, so the padding counts)
    lengths = [r.output_len for r in make_workload(3, 4, 8, 1234)]
    assert lengths[0] != lengths[1]
    assert padded["generated_tokens_incl_padding"] == 2 * max(lengths[0:2]) + lengths[2]
    for peer in lines[1:]:
        assert peer["pagedllm_speedup"] == pytest.approx(
            lines[0]["output_tokens_per_s"] / peer["output_tokens_per_s"], rel=0.02
        )


def test_bench_throughput_peer_model(tiny_model_dirs, tmp_path, capsys):
    """--peer-model: the transformers peer loads that folder (the harness's HF copy), not --model."""
    common = ["bench", "throughput", "--model", tiny_model_dirs["llama"], "--num-requests", "3", "--min-len", "4",
              "--max-len", "8", "--json", "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1"]
    proc = run_in_process(capsys, *common, "--compare", "transformers-padded", "--peer-model", tiny_model_dirs["qwen2"])
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["engine"] for r in lines] == ["pagedllm", "transformers-generate-padded"]
    assert lines[1]["model"] == tiny_model_dirs["qwen2"]
    for bad, message in [
        (["--compare", "transformers", "--peer-model", str(tmp_path / "nowhere")], "does not exist"),
        (["--peer-model", tiny_model_dirs["qwen2"]], "give --compare too"),
    ]:
        proc = run_in_process(capsys, *common, *bad)
        assert proc.returncode != 0 and message in proc.stderr
        assert_no_traceback(proc)


@pytest.mark.parametrize("extra", [[], ["--quantization", "int8"], ["--quantization", "int4",
                                    "--quantization-group-size", "64"]], ids=["gguf", "int8", "int4"])
def test_bench_latency_json(extra, capsys):
    # the bundled file's case in a real subprocess, the re-quantized ones in this process
    run = run_cli if not extra else lambda *args: run_in_process(capsys, *args)
    proc = run(
        "bench", "latency", "--batch-size", "2", "--input-len", "16", "--output-len", "5", "--num-iters", "2",
        "--json", "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1", *extra,
    )
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["batch_size"], r["input_len"], r["output_len"], r["num_iters"]) == (2, 16, 5, 2)
    # the bundled file's blocks are kept unless int8 / int4 is asked for (which rounds its dequantized weights again)
    assert r["weight_dtype"] == {0: "gguf:Q4_1+Q8_0", 2: "int8-per-channel", 4: "int4-g64"}[len(extra)]
    # the rate and GFLOP/s figures are consistent with each other and the parameter count
    assert r["decode_gflops"] == pytest.approx(r["decode_tokens_per_s"] * 2 * r["num_params"] / 1e9, rel=0.01)
    assert r["prefill_tokens_per_s"] == pytest.approx(2 * 16 / (r["ttft_ms"] / 1000), rel=0.01)
    assert 130e6 < r["num_params"] < 140e6  # SmolLM2-135M


def test_env_reports_the_cpu_the_kernels_and_the_backends(tiny_model_dirs):
    proc = run_cli("env", "--json", "--load", "--model", tiny_model_dirs["llama"], "--dtype", "bfloat16",
                   unset=("PAGEDLLM_KERNEL_ISA",))  # the variant the CPU chooses, whatever the caller forces
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    # each feature the kernels care about is listed exactly when /proc/cpuinfo has it
    from pagedllm.entrypoints.env_report import CPU_FEATURES

    assert report["cpu"]["features"] == [f for f in CPU_FEATURES if f in flags]
    from pagedllm.kernels import default_isa

    # unset PAGEDLLM_KERNEL_ISA: the best named variant this CPU runs
    assert report["kernels"]["isa"] == report["kernels"]["default_isa"] == default_isa()
    assert "native" in report["kernels"]["runnable_isas"]
    if report["kernels"]["loaded"]:
        assert Path(report["kernels"]["library"]).exists()
        assert report["kernels"]["bf16_linear_isa"] == ("avx512_bf16" if "avx512_bf16" in flags else
                                                         "avx2" if {"avx2", "fma"} <= flags else "scalar")
    loaded = report["loaded"]
    assert loaded["dtype"] == "bfloat16" and loaded["linear_backend"] == report["auto"]["bfloat16"]["linear"]
    assert sum(loaded["layer_classes"].values()) > 0
    # with the engine's defaults: the tiny model's whole context (1024 tokens) in a pool sized from free memory
    assert loaded["max_model_len"] == 1024 and loaded["num_kv_blocks"] >= 64
    assert report["memory"]["available_gib"] > 0


def test_bench_latency_with_speculation_reports_acceptance(capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "cost_model": false}'
    proc = run_in_process(
        capsys, "bench", "latency", "--input-len", "64", "--output-len", "48", "--num-iters", "1", "--json",
        "--num-kv-blocks", "64", "--max-model-len", "256", "--num-threads", "1", "--speculative-config", spec,
    )
    assert proc.returncode == 0, proc.stderr
    assert_no_traceback(proc)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    s = r["spec_decode"]
    # random prompt tokens, but a one-token n-gram recurs in any 100 tokens: drafts were verified
    assert s["num_drafts"] > 0 and s["num_draft_tokens"] >= s["num_drafts"]
    assert s["acceptance_rate"] == pytest.approx(s["num_accepted_tokens"] / s["num_draft_tokens"], abs=1e-3)
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"], abs=1e-3)
    assert "speculative decoding:" in proc.stdout


@pytest.mark.parametrize("argv", [["generate", "hi", "--top-p", "2"], ["chat", "--temperature", "-1"]])
def test_bad_sampling_flags_are_refused_before_the_model_loads(capsys, monkeypatch, argv):
    """A bad sampling value costs no model load: LLM is never built."""
    import pagedllm

    def no_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded before the sampling flags were checked")

    monkeypatch.setattr(pagedllm, "LLM", no_load)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "the model was loaded" not in err
