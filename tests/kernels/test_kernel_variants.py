"""Every kernel code path this CPU can execute, against the plain-torch references.

The kernels hold one code path per instruction set (AVX512-BF16, AVX-512,
AVX2+FMA, plain C), chosen when they are compiled. The rest of the suite runs
the default build (the best named variant this CPU runs); here each other
variant this CPU can run is forced with ``PAGEDLLM_KERNEL_ISA`` and put
through the kernel-level tests in a subprocess (one variant per process: the
op namespace is registered once): the same tests, the same tolerances,
another code path, and the interleaved kernels' outputs equal to the default
build's bits. A variant this CPU cannot execute is refused with a clear error,
not run.

The named variants are the libraries of the session's wheel
(tests/wheel_build.py, which tests/e2e/test_packaging.py checks too): the
same sources compiled with the same flags as a build here, loaded by the
installed package through the path a user's install takes
(``choose_prebuilt``), so each variant is compiled once per session, not
twice. ``native`` (``-march=native``) is never prebuilt: it is built here,
into a fresh cache folder, where it selects other code paths than the
default build. On x86-64 it compiles the same sources as the named variants,
and the paths are chosen by the preprocessor macros the sources test
(``__AVX512BF16__``, ``__AVX512F__``, ``__AVX2__``...): where ``-march=native``
defines the same ones as the default variant's flags (a CPU that runs
AVX512-BF16, this Zen 5 among them), it compiles the very paths the whole
suite runs and is not built again. Off x86-64 ``native`` is the default build,
which the whole suite runs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from wheel_build import installed_env

from pagedllm.kernels import ISA_VARIANTS, default_isa, runnable_isas

TESTS = Path(__file__).resolve().parents[1]
# kernel-level tests: each compares a native op with its torch reference at edge shapes
KERNEL_TESTS = [
    "kernels/test_native_ops.py",
    "kernels/test_moe_route.py",
    "kernels/test_attention.py",
    "kernels/test_attention_sinks.py",
    "kernels/test_kv_int8.py",
    "kernels/test_kv_int4.py",
    "kernels/test_causal_conv1d.py",
    "models/test_bf16_cpu.py::test_packed_bf16_kernel_matches_a_float64_product_of_the_rounded_operands",
    "models/test_bf16_cpu.py::test_packed_bf16_rounds_activations_like_torch",
    "models/test_bf16_cpu.py::test_bf16_linear_backends_compute_the_same_scheme",
    "models/test_linear_backends.py",
    "models/test_weight_only.py::test_quantized_linear_matches_the_dequantized_weights_in_float64",
    "models/test_weight_only.py::test_interleaved_blocks_multiply_the_rows_rounded_to_int8",
    "models/test_weight_only.py::test_a_rows_result_does_not_depend_on_its_batch",
    "models/test_weight_only.py::test_embedding_rows_are_the_dequantized_rows",
    "models/test_weight_only.py::test_bad_inputs_are_value_errors",
    "models/test_weight_only.py::test_a_step_program_runs_quantized_nodes_as_the_ops_do",
    "models/test_weight_only.py::test_a_linear_layer_keeps_only_its_blocks",
    "kernels/test_step_program.py",
    "kernels/test_gguf_quantized.py::test_gguf_linear_matches_the_dequantized_weights_in_float64",
    "kernels/test_gguf_quantized.py::test_a_rows_result_does_not_depend_on_its_batch",
    "kernels/test_gguf_quantized.py::test_embedding_rows_and_dequantize_equal_gguf",
    "kernels/test_gguf_quantized.py::test_bad_gguf_inputs_are_value_errors",
    "kernels/test_gguf_quantized.py::test_a_step_program_runs_gguf_nodes_as_the_ops_do",
    "kernels/test_gguf_quantized.py::test_interleaved_linear_is_the_float64_product_of_rounded_activations",
    "kernels/test_gguf_quantized.py::test_interleaved_rows_do_not_depend_on_their_batch",
    "kernels/test_gguf_quantized.py::test_long_k_quant_rows_summed_a_slice_of_the_tile_at_a_time",
    "kernels/test_gguf_quantized.py::test_interleaving_keeps_every_weight",
    "kernels/test_gguf_quantized.py::test_activations_are_rounded_to_int8_exactly_as_llama_cpp_rounds_them",
    "kernels/test_gguf_quantized.py::test_a_step_program_runs_interleaved_nodes_as_the_ops_do",
    "kernels/test_gguf_iq4_mxfp4.py::test_weights_equal_ggufs_dequantization_in_both_layouts",
    "kernels/test_gguf_iq4_mxfp4.py::test_file_order_linear_is_the_float_product",
    "kernels/test_gguf_iq4_mxfp4.py::test_interleaved_linear_is_the_product_of_rounded_activations",
    "kernels/test_gguf_iq4_mxfp4.py::test_a_rows_result_does_not_depend_on_its_batch",
    "kernels/test_gguf_iq4_mxfp4.py::test_bad_inputs_are_value_errors",
    "kernels/test_gguf_moe_linear.py",
    "kernels/test_gated_delta.py",
    "kernels/test_ssd_scan.py",
]


# the kernel tests, then (in the same process, the library loaded) what was loaded and the interleaved bits
RUN = r"""
import json, sys
import pytest

tests = sys.argv[1]
code = pytest.main(sys.argv[2:])
if code != 0:
    raise SystemExit(int(code))
sys.path[:0] = [tests, tests + "/kernels"]
import pagedllm
from pagedllm import kernels
from test_gguf_iq4_mxfp4 import x16_digest

print(json.dumps({"file": pagedllm.__file__, "library": kernels.library_path(), "variant": kernels.loaded_variant(),
                  "prebuilt": kernels.kernels_prebuilt(), "x16": x16_digest()}))
"""
# checks the fallback when no library loads (a compiler that is not there): the same for every variant (none
# is compiled), and run by the whole suite; a prebuilt library is loaded without a compiler, so not here
NO_COMPILER_TEST = "tests/kernels/test_attention.py::test_without_a_compiler_auto_falls_back_and_int8_is_refused"


def _run_kernel_tests(python: str, env: dict[str, str]) -> dict:
    """Run the kernel tests under ``python`` and ``env``; what the process loaded and its ``x16_digest``."""
    args = ["-q", "-x", "-p", "no:cacheprovider", "--deselect", NO_COMPILER_TEST, *[str(TESTS / t) for t in KERNEL_TESTS]]
    proc = subprocess.run([python, "-c", RUN, str(TESTS), *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert " passed" in lines[-2] and "failed" not in lines[-2], lines[-2]
    return json.loads(lines[-1])


def _tested_macros(flags: list[str]) -> set[str]:
    """The macros the kernel sources choose their code paths by that the compiler defines under ``flags``."""
    from pagedllm import kernels

    tested = set()
    for path in [*kernels._SOURCES, *kernels._HEADERS]:
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("#") and "if" in line:
                tested |= set(re.findall(r"\b__[A-Z0-9_]+__\b", line))
    compiler = kernels.compiler_path()
    if compiler is None:
        pytest.fail("no C++ compiler: the suite builds the kernels, so one must be on PATH")
    proc = subprocess.run([compiler, "-dM", "-E", "-x", "c++", *kernels._CFLAGS, *flags, "-"], input="",
                          capture_output=True, text=True, check=True, timeout=60)
    defined = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}
    return tested & defined


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(ISA_VARIANTS))
def test_kernel_tests_pass_with_every_runnable_isa(isa: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if isa not in runnable_isas():
        pytest.skip(f"this CPU cannot execute the {isa} code path (needs {ISA_VARIANTS[isa][1]})")
    if isa == default_isa():
        pytest.skip(f"{isa} is this CPU's default build, which the whole suite runs")
    forced = {"PAGEDLLM_KERNEL_ISA": isa, "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache")}
    if isa == "native":
        native, default = _tested_macros(ISA_VARIANTS[isa][0]), _tested_macros(ISA_VARIANTS[default_isa()][0])
        if native == default:
            pytest.skip(f"-march=native defines the macros the sources test as the default {default_isa()} build "
                        f"does ({sorted(native)}): the same code paths, which the whole suite runs")
        got = _run_kernel_tests(sys.executable, os.environ | forced)
        assert not got["prebuilt"] and got["variant"] == isa, got
        built = list((tmp_path / "cache" / "kernels").glob(f"{isa}-*/pagedllm_kernels.so"))
        assert built, "the forced variant was not the one built"
    else:
        _, venv = request.getfixturevalue("installed_wheel")
        got = _run_kernel_tests(str(venv / "bin" / "python"), installed_env(**forced))  # the wheel, not the checkout
        assert got["file"].startswith(str(venv)), got["file"]
        assert got["prebuilt"] and got["variant"] == isa, got
        assert "/_prebuilt/" in got["library"] and f"pagedllm_kernels_{isa}." in got["library"], got["library"]
        assert not list((tmp_path / "cache").glob("kernels/*/*.so")), "the kernels were built, not loaded"
    # the interleaved kernels' integer sums are exact: the variant gives the default build's very bits
    from test_gguf_iq4_mxfp4 import x16_digest

    assert got["x16"] == x16_digest()


def test_a_variant_the_cpu_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import kernels

    missing = [isa for isa in ISA_VARIANTS if isa not in runnable_isas()]
    if not missing:
        pytest.skip("this CPU runs every variant")
    monkeypatch.setenv("PAGEDLLM_KERNEL_ISA", missing[0])
    with pytest.raises(ValueError, match="this CPU lacks"):
        kernels.build_flags()
    monkeypatch.setenv("PAGEDLLM_KERNEL_ISA", "sse9")
    with pytest.raises(ValueError, match="must be one of"):
        kernels.kernel_isa()


def test_the_default_variant_is_the_best_this_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm import kernels

    monkeypatch.delenv("PAGEDLLM_KERNEL_ISA", raising=False)
    runnable = runnable_isas()
    if runnable == ["native"]:
        assert kernels.kernel_isa() == "native"  # not x86-64: -march=native is the only build
        return
    best = next(isa for isa in ("avx512_bf16", "avx512", "avx2", "scalar") if isa in runnable)
    assert kernels.kernel_isa() == default_isa() == best


def test_a_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path) -> None:  # noqa: ANN001
    """cpp_extension waits on its lock file forever: one older than any build is removed, a fresh one kept."""
    import os
    import time

    from pagedllm import kernels

    lock = tmp_path / "lock"
    lock.touch()
    kernels._clear_stale_lock(lock)
    assert lock.exists()  # a build may be running
    old = time.time() - kernels._STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    kernels._clear_stale_lock(lock)
    assert not lock.exists()
    kernels._clear_stale_lock(lock)  # nothing there: nothing to do


def test_a_fresh_lock_of_a_killed_build_is_cleared_by_the_next_builder(tmp_path) -> None:  # noqa: ANN001
    """A build killed a minute ago leaves cpp_extension's lock file, which it would wait on forever: the OS lock
    (``_build_lock``) dies with the killed process, so the next builder holds it and removes the file at once;
    while a live builder holds the OS lock, another process cannot take it."""
    import fcntl
    import signal
    import subprocess
    import sys

    from pagedllm import kernels

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from pagedllm import kernels\n"
         f"with kernels._build_lock(Path({str(tmp_path)!r})):\n"
         f"    Path({str(tmp_path / 'lock')!r}).touch(); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with open(tmp_path / ".build-lock", "a+") as handle, pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the live builder holds it
        kernels._clear_stale_lock(tmp_path / "lock")
        assert (tmp_path / "lock").exists()  # fresh, and no OS lock held: kept
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    with kernels._build_lock(tmp_path) as sole_builder:  # released by the OS with the killed process
        assert sole_builder
        kernels._clear_stale_lock(tmp_path / "lock", sole_builder)
    assert not (tmp_path / "lock").exists()


def test_two_checkouts_of_the_same_sources_build_in_two_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # cpp_extension records the sources' paths in build.ninja: a shared folder would rebuild on every load
    import pagedllm.kernels as kernels

    compiler = kernels.compiler_path()
    if compiler is None:
        pytest.fail("no C++ compiler: the suite builds the kernels, so one must be on PATH")
    folders = []
    for name in ("a", "b", "a"):
        checkout = tmp_path / name
        checkout.mkdir(exist_ok=True)
        copies = []
        for src in [*kernels._SOURCES, *kernels._HEADERS]:
            (checkout / src.name).write_text(src.read_text())
            copies.append(checkout / src.name)
        monkeypatch.setattr(kernels, "_SOURCES", [p for p in copies if p.suffix == ".cpp"])
        monkeypatch.setattr(kernels, "_HEADERS", [p for p in copies if p.suffix == ".h"])
        folders.append(kernels._build_dir("avx2", ["-O3"], compiler))
    assert folders[0] != folders[1] and folders[0] == folders[2]
    assert folders[0].parent == folders[1].parent == kernels.cache_dir()
