"""One wheel of the checkout per test session, installed non-editable into a fresh virtualenv.

Building the wheel compiles the kernels once per prebuilt variant this CPU
runs (minutes on two cores), so it is built once (the session fixture
``installed_wheel`` in tests/conftest.py) and used twice:
tests/e2e/test_packaging.py checks the wheel and its install without a
compiler, and tests/kernels/test_kernel_variants.py puts each variant the
wheel holds through the kernel tests (the same compiled code the checkout
would build for that variant: the same sources, the same flags).

The venv sees the project venv's packages (torch, pytest, tokenizers...)
through a path file, but not its editable pagedllm: a path line in a
``.pth`` file adds a folder to ``sys.path`` without running the ``.pth``
files inside it, which is where an editable install hooks itself in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from pagedllm.kernels import default_isa, runnable_isas
from pagedllm.kernels.variants import PREBUILT_ISAS

REPO = Path(__file__).resolve().parents[1]
# the prebuilt variants this CPU can run: the ones the wheel here holds (none off x86-64: "native" is built)
WHEEL_ISAS = [isa for isa in PREBUILT_ISAS if isa in runnable_isas()] if default_isa() != "native" else []


def venv_site(venv: Path) -> Path:
    """The site-packages folder of ``venv`` (created by this interpreter's version)."""
    rel = Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    return venv / rel


def installed_env(**extra: str) -> dict[str, str]:
    """This process's environment for the venv's interpreter: without ``PYTHONPATH`` (which would put a
    checkout before the installed wheel) and ``PYTEST_ADDOPTS`` (plugins of this run the venv may not see)."""
    drop = ("PYTHONPATH", "PYTEST_ADDOPTS", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in drop} | extra


def build_and_install(root: Path) -> tuple[Path, Path]:
    """Build the checkout's wheel (holding ``WHEEL_ISAS``) into ``root`` and install it into a fresh venv there.

    Returns (the wheel, the venv).
    """
    dist, venv = root / "dist", root / "venv"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(REPO)],
        check=True, capture_output=True, text=True, timeout=1500,
        env=dict(os.environ, PAGEDLLM_PREBUILT_ISAS=",".join(WHEEL_ISAS) or "none"),
    )
    (wheel,) = dist.glob("pagedllm-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = venv_site(venv)
    # the project venv's packages, without running its .pth files (its editable pagedllm hook among them)
    (site / "project_packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # no PYTHONPATH: a checkout on it (with the egg-info the wheel's build leaves there) is pagedllm 0.1.0
    # "already installed" to pip, which would then install nothing
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True, capture_output=True, text=True, timeout=300, env=installed_env(),
    )
    return wheel, venv
