"""Builds the native kernels ahead of time, one extension per ISA variant, into the wheel.

``pip wheel .`` / ``pip install .`` (and ``python -m build``) compile
``pagedllm/kernels/*.cpp`` once per named variant (``PREBUILT_ISAS`` in
``pagedllm/kernels/variants.py``: ``avx512_bf16``, ``avx512``, ``avx2``,
``scalar``) with torch's ``BuildExtension`` + ``CppExtension`` into
``pagedllm/kernels/_prebuilt/pagedllm_kernels_<variant>*.so``, and record the
torch version and the sources' hash they were built from in
``_prebuilt/build_info.json``. At run time ``pagedllm.kernels`` loads the
best variant the CPU runs: a wheel needs no compiler.

Editable installs (``pip install -e .``, ``make setup``) skip this and keep
building the kernels at first use, so they stay fast. Environment:

- ``PAGEDLLM_PREBUILT_ISAS``: a comma-separated subset of the variants to
  build (default: all of them); ``none`` builds none (a pure-Python wheel
  that compiles the kernels at first use, like an editable install).

torch must be importable at build time: ``[build-system] requires`` pins it
for isolated builds; ``pip install --no-build-isolation`` uses the
environment's own torch (which must then be the version the package pins).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "pagedllm" / "kernels"


def _variants():  # noqa: ANN202
    # by path: importing the pagedllm package would import torch, transformers, ...
    spec = importlib.util.spec_from_file_location("_pagedllm_kernel_variants", KERNELS / "variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wanted_isas(variants) -> list[str]:  # noqa: ANN001
    if any(cmd in sys.argv for cmd in ("editable_wheel", "develop")):
        return []  # editable: the kernels are built at first use from the checkout
    if platform.machine() not in ("x86_64", "AMD64"):
        return []  # no named variants off x86-64 yet (Arm ones would go here): built at first use
    asked = os.environ.get("PAGEDLLM_PREBUILT_ISAS")
    if asked is None:
        return list(variants.PREBUILT_ISAS)
    names = [n.strip() for n in asked.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in variants.PREBUILT_ISAS]
    if unknown:
        raise SystemExit(f"PAGEDLLM_PREBUILT_ISAS: unknown variants {unknown}; known: {variants.PREBUILT_ISAS}")
    return names


def _extensions() -> dict:
    variants = _variants()
    isas = _wanted_isas(variants)
    if not isas:
        return {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    sources = [str(p.relative_to(ROOT)) for p in sorted(KERNELS.rglob("*.cpp"))]

    class BuildVariants(BuildExtension):
        """One build folder per variant (they compile the same sources), and the record of the build."""

        def build_extension(self, ext) -> None:  # noqa: ANN001
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

        def run(self) -> None:
            out = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
            # an in-tree build folder keeps the libraries of earlier builds: only this build's go in the wheel
            keep = {Path(self.get_ext_fullpath(e.name)).name for e in self.extensions}
            for old in out.glob(f"{variants.LIBRARY_NAME}_*.so") if out.is_dir() else ():
                if old.name not in keep:
                    old.unlink()
            super().run()
            out.mkdir(parents=True, exist_ok=True)
            (out / variants.BUILD_INFO).write_text(json.dumps({
                "torch": torch.__version__,
                "variants": [e.name.split(".")[-1].removeprefix(variants.LIBRARY_NAME + "_") for e in self.extensions],
                "sources": variants.sources_digest(),
            }, indent=1) + "\n")

    exts = [
        CppExtension(
            name=f"pagedllm.kernels._prebuilt.{variants.LIBRARY_NAME}_{isa}",
            sources=sources,
            # -g0 and -s after setuptools' own flags: no debug info (a wheel 10x smaller), same code
            extra_compile_args=[*variants.CFLAGS, *variants.ISA_VARIANTS[isa][0], "-g0"],
            extra_link_args=[*variants.LDFLAGS, "-s"],
        )
        for isa in isas
    ]
    return {"ext_modules": exts, "cmdclass": {"build_ext": BuildVariants}}


setup(**_extensions())
