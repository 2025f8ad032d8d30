"""A wheel built from the checkout, installed non-editable, runs the native kernels.

An editable install reads the kernel sources from the checkout, so it cannot
show a wheel that leaves a header out, or one whose prebuilt kernels do not
load (the engine then falls back to the slow torch paths). Here the wheel is
built with pip (holding only this CPU's default variant prebuilt, to build
once rather than four times), installed into its own folder with ``pip
install --target`` and imported from there in a fresh interpreter whose
working directory holds no checkout and which has no C++ compiler: the
prebuilt library is loaded, nothing is compiled into the fresh cache folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds a wheel and installs it into a fresh virtualenv: outside the fast tier

REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import json, sys
import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm import kernels
from pagedllm.kernels import kernels_failure, load_kernels

site = sys.argv[1]
assert pagedllm.__file__.startswith(site), pagedllm.__file__
assert load_kernels() is not None, kernels_failure()
import torch
assert torch.ops.pagedllm.packed_linear_panel() > 0  # the typed ops are registered
llm = LLM(sys.argv[2], num_kv_blocks=32, max_model_len=128, block_size=8)
runner = llm.llm_engine.model_runner
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                   use_tqdm=False)
print(json.dumps({"file": pagedllm.__file__, "linear": runner.linear_backend, "attention": runner.backend.name,
                  "native_ops": runner.native_ops is not None, "programs": runner.captured_decode.native_programs,
                  "library": kernels.library_path(), "prebuilt": kernels.kernels_prebuilt(),
                  "variant": kernels.loaded_variant(),
                  "tokens": out[0].outputs[0].token_ids}))
"""


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, the folder it is installed into)."""
    root = tmp_path_factory.mktemp("wheel")
    dist, site = root / "dist", root / "site"
    from pagedllm.kernels import default_isa

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
        check=True, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PAGEDLLM_PREBUILT_ISAS=default_isa() if default_isa() != "native" else "none"),
    )
    (wheel,) = dist.glob("pagedllm-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    return wheel, site


def test_the_wheel_holds_every_package_file(installed_wheel: tuple[Path, Path]) -> None:
    wheel, _ = installed_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "pagedllm"], cwd=REPO, capture_output=True, text=True, check=True)
    package_files = [f for f in tracked.stdout.split() if not f.endswith((".md", ".pyi"))]
    if not package_files:
        pytest.skip("not a git checkout: nothing to compare the wheel with")
    missing = [f for f in package_files if f not in names]
    assert not missing, f"the wheel leaves out {missing}"
    from pagedllm.kernels import default_isa

    if default_isa() != "native":
        assert "pagedllm/kernels/_prebuilt/build_info.json" in names
        assert any(n.startswith(f"pagedllm/kernels/_prebuilt/pagedllm_kernels_{default_isa()}.") for n in names), names


def test_a_wheel_install_builds_and_uses_the_native_kernels(
    installed_wheel: tuple[Path, Path], tiny_model_dirs: dict[str, str], tmp_path: Path
) -> None:
    _, site = installed_wheel
    # no compiler: a wheel's kernels are prebuilt
    env = dict(os.environ, PYTHONPATH=str(site), PAGEDLLM_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
               CXX="/nonexistent/c++")
    env.pop("PAGEDLLM_KERNEL_ISA", None)
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, str(site), tiny_model_dirs["llama"]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernels unavailable" not in proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(site))
    # the fast CPU path, as from the checkout: packed linears, paged attention in place, native step programs
    assert got == got | {"linear": "packed", "attention": "cpu_paged", "native_ops": True, "programs": True}
    assert len(got["tokens"]) == 4
    from pagedllm.kernels import default_isa

    if default_isa() == "native":  # not x86-64: no prebuilt variants, built here (needs a compiler)
        return
    assert got["library"].startswith(str(site / "pagedllm" / "kernels" / "_prebuilt")), got["library"]
    assert got["prebuilt"] and got["variant"] == default_isa()
    assert not list((tmp_path / "cache").glob("kernels/*/pagedllm_kernels.so")), "the kernels were built, not loaded"
