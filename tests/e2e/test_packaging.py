"""A wheel built from the checkout, installed into a fresh virtualenv with no compiler, runs prebuilt kernels.

An editable install reads the kernel sources from the checkout, so it cannot
show a wheel that leaves a header out, or one whose prebuilt kernels do not
load (the engine then falls back to the slow torch paths). Here the wheel is
built with pip, holding every prebuilt variant this CPU can run (scalar and
AVX2 here; AVX-512 and AVX512-BF16 too on a CPU that has them, not the
others, to build each only where it can be tested), and installed
non-editable into a fresh virtualenv that sees the project venv's packages
but not its editable pagedllm: once per session, by tests/wheel_build.py
(tests/kernels/test_kernel_variants.py runs the kernel tests on its
libraries).

Each check runs the venv's interpreter in a folder holding no checkout, with
PATH holding no ``c++``/``gcc``/``cc``, ``CC``/``CXX`` pointing nowhere and
an empty cache folder, and decodes the bundled GGUF (Q4_1/Q8_0 blocks): the
prebuilt library is loaded (not built, not the torch fallback), the GGUF
linears and native step programs run, and the tokens are those of the
checkout's own build. Each variant the wheel holds and the CPU runs is then
forced with ``PAGEDLLM_KERNEL_ISA`` and checked the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from wheel_build import REPO, WHEEL_ISAS

from pagedllm.kernels import default_isa

pytestmark = pytest.mark.slow  # builds a wheel with two or more kernel variants: outside the fast tier

PROMPT = "The capital of France is"
NUM_TOKENS = 8

CHECK = r"""
import json, shutil, sys
import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm import kernels
from pagedllm.kernels import kernels_failure, load_kernels

site, model = sys.argv[1], sys.argv[2]
if not pagedllm.__file__.startswith(site):
    raise SystemExit(f"pagedllm imported from {pagedllm.__file__}, not the installed wheel in {site}")
compilers = {name: shutil.which(name) for name in ("c++", "g++", "gcc", "cc", "clang")}
if load_kernels() is None:
    raise SystemExit(f"kernels unavailable: {kernels_failure()}")
llm = LLM(model, num_kv_blocks=64, max_model_len=256)
runner = llm.llm_engine.model_runner
methods = sorted({type(m.quant_method).__name__ for m in runner.model.modules() if hasattr(m, "quant_method")})
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True, logprobs=1)
out = llm.generate([sys.argv[4]], params, use_tqdm=False)[0].outputs[0]
print(json.dumps({
    "file": pagedllm.__file__, "compilers": compilers, "library": kernels.library_path(),
    "prebuilt": kernels.kernels_prebuilt(), "variant": kernels.loaded_variant(),
    "weight_format": runner.weight_format, "methods": methods, "attention": runner.backend.name,
    "native_ops": runner.native_ops is not None, "programs": runner.captured_decode.native_programs,
    "tokens": list(out.token_ids), "logprobs": [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)],
}))
"""


def _no_compiler_env(tmp_path: Path, isa: str | None) -> dict[str, str]:
    """An environment with no compiler on PATH or in CC/CXX, an empty cache and (maybe) a forced variant."""
    bare_bin = tmp_path / "bin"  # PATH: one empty folder (nothing the engine runs needs a program)
    bare_bin.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PAGEDLLM_KERNEL_ISA", "VIRTUAL_ENV")}
    env |= {"PATH": str(bare_bin), "CC": "/nonexistent/cc", "CXX": "/nonexistent/c++", "HF_HUB_OFFLINE": "1",
            "PAGEDLLM_CACHE_DIR": str(tmp_path / "cache")}
    if isa is not None:
        env["PAGEDLLM_KERNEL_ISA"] = isa
    return env


def _run_check(python: Path, site: Path, model: str, env: dict[str, str], cwd: Path) -> dict:
    proc = subprocess.run(
        [str(python), "-c", CHECK, str(site), model, str(NUM_TOKENS), PROMPT],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernels unavailable" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkout_decode(smollm_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same decode from the checkout, with the kernels it builds for this CPU's default variant."""
    cwd = tmp_path_factory.mktemp("checkout")
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    env.pop("PAGEDLLM_KERNEL_ISA", None)
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, str(REPO), smollm_path, str(NUM_TOKENS), PROMPT],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_native_gguf_decode(got: dict, venv: Path, tmp_path: Path) -> None:
    """The run imported the installed wheel, found no compiler and decoded the GGUF blocks natively."""
    assert got["file"].startswith(str(venv)), got["file"]
    assert got["compilers"] == dict.fromkeys(got["compilers"]), f"a compiler was reachable: {got['compilers']}"
    # the GGUF blocks stay in their blocks and go through the native kernels (the fallback dequantizes them)
    assert got["weight_format"].startswith("gguf:"), got["weight_format"]
    assert got["methods"] == ["GGUFEmbeddingMethod", "GGUFLinearMethod"], got["methods"]
    assert got == got | {"attention": "cpu_paged", "native_ops": True, "programs": True}
    assert len(got["tokens"]) == NUM_TOKENS
    if not WHEEL_ISAS:  # not x86-64: no prebuilt variants, built here (which needs a compiler): nothing more to see
        return
    assert got["prebuilt"], got
    assert "/_prebuilt/" in got["library"] and got["library"].startswith(str(venv)), got["library"]
    assert not list((tmp_path / "cache").glob("kernels/*/*.so")), "the kernels were built, not loaded"


def test_the_wheel_holds_every_package_file_and_each_variant(installed_wheel: tuple[Path, Path]) -> None:
    wheel, _ = installed_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "pagedllm"], cwd=REPO, capture_output=True, text=True, check=True)
    package_files = [f for f in tracked.stdout.split() if not f.endswith((".md", ".pyi"))]
    assert package_files, "not a git checkout: nothing to compare the wheel with"
    missing = [f for f in package_files if f not in names]
    assert not missing, f"the wheel leaves out {missing}"
    if WHEEL_ISAS:
        assert "pagedllm/kernels/_prebuilt/build_info.json" in names
        held = sorted(n for n in names if n.startswith("pagedllm/kernels/_prebuilt/pagedllm_kernels_"))
        for isa in WHEEL_ISAS:
            assert any(n.startswith(f"pagedllm/kernels/_prebuilt/pagedllm_kernels_{isa}.") for n in held), held


def test_the_installed_wheel_decodes_the_bundled_gguf_natively_with_no_compiler(
    installed_wheel: tuple[Path, Path], checkout_decode: dict, smollm_path: str, tmp_path: Path
) -> None:
    _, venv = installed_wheel
    assert shutil.which("c++", path=str(tmp_path / "bin")) is None
    got = _run_check(venv / "bin" / "python", venv, smollm_path, _no_compiler_env(tmp_path, None), tmp_path)
    _assert_native_gguf_decode(got, venv, tmp_path)
    if WHEEL_ISAS:
        assert got["variant"] == default_isa() == checkout_decode["variant"]
    # the same compiler flags and sources as the checkout's own build: the same tokens
    assert got["tokens"] == checkout_decode["tokens"], (got["tokens"], checkout_decode["tokens"])
    assert got["logprobs"] == pytest.approx(checkout_decode["logprobs"], abs=1e-4)


@pytest.mark.parametrize("isa", WHEEL_ISAS or ["none"])
def test_each_variant_the_wheel_holds_runs_when_forced(
    isa: str, installed_wheel: tuple[Path, Path], checkout_decode: dict, smollm_path: str, tmp_path: Path
) -> None:
    if isa == "none":
        pytest.skip("not x86-64: a wheel holds no prebuilt variant here (the kernels are built at first use)")
    _, venv = installed_wheel
    got = _run_check(venv / "bin" / "python", venv, smollm_path, _no_compiler_env(tmp_path, isa), tmp_path)
    _assert_native_gguf_decode(got, venv, tmp_path)
    assert got["variant"] == isa and f"pagedllm_kernels_{isa}." in got["library"], got
    # another code path sums floats in another order (the decode kernel's dot products, which prompts now
    # share, reduce 16 lanes on AVX-512 builds and 8 on AVX2), and on 8-bit activations a last-bit difference
    # can move a rounding step of the next layer's int8 rows (issue 35): the first token's logprob of this
    # prompt was -0.2215 (AVX-512 BF16), -0.2750 (AVX2) and -0.2891 (scalar) on a Zen 5, 2026-12-04, and
    # -0.2729 / -0.2929 with the mode off (AVX-512 / AVX2). A broken variant gives other tokens or a far
    # other logprob; the first tokens are the same
    assert got["tokens"][:4] == checkout_decode["tokens"][:4]
    assert got["logprobs"][0] == pytest.approx(checkout_decode["logprobs"][0], abs=0.1)
