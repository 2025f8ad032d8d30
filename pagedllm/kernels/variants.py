"""The kernels' ISA variants, their compiler flags and the prebuilt libraries' record.

Dependency-free (no torch, no pagedllm imports): ``setup.py`` loads this file
by path to build one extension per variant, and ``pagedllm.kernels`` picks
and checks the prebuilt library at run time with the same tables.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).parent
LIBRARY_NAME = "pagedllm_kernels"
# the prebuilt libraries of a wheel: _prebuilt/pagedllm_kernels_<variant>*.so and BUILD_INFO
PREBUILT_DIR = HERE / "_prebuilt"
BUILD_INFO = "build_info.json"

# -ffast-math is avoided on purpose: linking with it would switch the whole
# process to flush-to-zero. Reassociation alone lets gcc vectorise the dot
# products. c++20: torch's headers warn under c++17.
CFLAGS = [
    "-O3", "-std=c++20", "-fopenmp", "-fno-math-errno",
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast",
]
LDFLAGS = ["-fopenmp"]

# PAGEDLLM_KERNEL_ISA: which instruction set the kernels are compiled for.
# The named x86-64 variants select one of the code paths the sources hold
# (#if __AVX512BF16__ / __AVX512F__ / __AVX2__ / plain C), so every path can
# be tested on a CPU that runs it; "native" is whatever -march=native gives.
# Each needs the CPU features listed; asking for one the CPU lacks is an
# error, not a crash. Best first: the default is the first this CPU runs.
ISA_VARIANTS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "native": (["-march=native"], ()),
    "avx512_bf16": (["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mf16c", "-mfma"],
                    ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni")),
    "avx512": (["-march=x86-64-v4"], ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")),
    "avx2": (["-march=x86-64-v3"], ("avx2", "fma", "f16c", "bmi2", "movbe")),
    "scalar": (["-march=x86-64"], ()),
}
# what a wheel built on x86-64 holds, best first ("native" is this CPU's own: never prebuilt)
PREBUILT_ISAS = ("avx512_bf16", "avx512", "avx2", "scalar")


def source_files() -> list[Path]:
    """The kernels' C++ sources and headers (in their folders), in a fixed order."""
    return sorted(HERE.rglob("*.cpp")) + sorted(HERE.rglob("*.h"))


def sources_digest() -> str:
    """A hash of the kernels' sources and headers (names and contents)."""
    h = hashlib.sha256()
    for p in source_files():
        h.update(p.relative_to(HERE).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def pick_prebuilt(cpu_features: Iterable[str], available: Iterable[str], machine: str = "x86_64") -> str | None:
    """The best prebuilt variant a CPU with these features runs (None: none of them, or not x86-64).

    ``available``: the variants the wheel holds; the order is ``PREBUILT_ISAS``'s, best first.
    """
    if machine not in ("x86_64", "AMD64"):
        return None
    features, have = set(cpu_features), set(available)
    return next((isa for isa in PREBUILT_ISAS if isa in have and set(ISA_VARIANTS[isa][1]) <= features), None)


def prebuilt_mismatch(info: dict, torch_version: str, digest: str | None) -> str | None:
    """Why prebuilt libraries recorded by ``info`` cannot be loaded here (None: they can).

    A library built against another torch links to symbols that may have
    moved (a crash, not an error); one built from other sources (a checkout
    edited after an in-place build) runs code that is not the checkout's.
    ``digest`` None: the sources are not there to compare.
    """
    built = info.get("torch")
    if built != torch_version:
        return (f"the prebuilt kernels were built against torch {built}, this is torch {torch_version} "
                f"(reinstall pagedllm for this torch, or build them here)")
    if digest is not None and info.get("sources") not in (None, digest):
        return "the prebuilt kernels were built from other sources than the installed ones"
    return None
