"""Native CPU kernels as typed torch ops (``torch.ops.pagedllm.*``), compiled on first use.

The kernels are C++ files with OpenMP and no torch headers, grouped by concept:
``attention/`` (``paged_decode.cpp``: decode attention reading KV blocks in
place, from any of the seven cache types, float32, float16, bfloat16, int8,
int4, fp8 E4M3 and E5M2; ``prefill_attention.cpp``: causal attention of
prompts computed from scratch; ``paged_prefill.cpp``: prompt tokens read from
the paged cache in the decode kernel's order; ``kv_write.cpp``: new K/V rows
into their cache slots, rounded to the cache's type; the shared headers
``paged_attention.h`` and ``paged_attention_kv.h``, whose kernels are C++
templates over the cache-type traits structs of ``kv_types.h``, and
``kv_rows.h``), ``gguf/`` (``gguf_linear.cpp``: matmuls and row lookups over
quantized blocks, GGUF's and the grouped int8 / int4 of weights quantized at
load, ``gguf_blocks.h``; ``gguf_x16_repack.cpp`` and ``gguf_x16_matmul.cpp``:
those blocks interleaved 16 channels at a time at load, ``gguf_x16.h``, and
their int8 matmuls; ``gguf_moe_linear.cpp``: a mixture-of-experts layer's
expert matmuls in one call over stacked experts' blocks, ``gguf_moe.h``), ``packed/`` (``packed_linear.cpp``: float32 matmul over
weights packed into column panels; ``packed_linear_bf16.cpp``: the same with
bfloat16 weights and products; ``panel_f32.h``, ``panel_bf16.h`` and the
``panel_units.h`` they share), ``elementwise/`` (``elementwise.cpp``: RMSNorm
with the residual add, RoPE after Qwen3's q/k norms, SiLU-and-multiply;
``logit_stats.cpp``: per-row argmax and logsumexp of the logits),
``gated_delta/`` (the gated delta rule of Gated DeltaNet layers:
``gated_delta_decode.cpp``, its recurrent form, one token per sequence
updating its state slot in place; ``gated_delta_chunk.cpp``, its chunked
form for prompts; ``gated_delta.h``), ``simd/``
(``simd.h``, the one vector layer holding every SIMD intrinsic, one section
per ISA: ``simd_avx512.h``, ``simd_avx2.h``, ``simd_scalar.h``) and ``step/``
(``step_nodes.cpp`` runs kernel calls recorded as plain "nodes" in one OpenMP
parallel region). The decode-path kernels are team functions (orphaned
``omp for`` loops, ``step/step_nodes.h``): an eager op runs one node, a
recorded decode step (``torch.classes.pagedllm.StepProgram``,
``step/step_program.h``) runs all of its nodes in one region. At the top,
``kernels.h`` and ``step/step_nodes.h`` declare the entry points,
``shm_allreduce.cpp`` lets tensor-parallel ranks of one machine sum through
shared memory, and one binding file, ``ops.cpp`` (with ``step_program.h``),
registers the ops' schemas (``TORCH_LIBRARY(pagedllm, ...)``) and CPU
implementations that check their tensors (dtype, device, contiguity, shapes,
the indices a kernel trusts) and raise ValueError, then call the kernels on
the data pointers. Fake (meta) implementations for tracing live in ``meta.py``.

A wheel holds them prebuilt: ``setup.py`` compiles one library per named
x86-64 variant (``scalar``, ``avx2``, ``avx512``, ``avx512_bf16``) into
``_prebuilt/pagedllm_kernels_<variant>*.so``, recording the torch version and
the sources' hash in ``_prebuilt/build_info.json``. At first use the best
variant this CPU runs is loaded with ``torch.ops.load_library``: no compiler,
no build, in well under a second. A record that does not match (another torch,
edited sources) is refused with one log line, and the kernels are built here
instead. ``PAGEDLLM_KERNELS_PREBUILT=0`` ignores the prebuilt libraries.

Otherwise (an editable install or a checkout, ``native``, a variant the
wheel lacks) everything is built by ``torch.utils.cpp_extension.load`` (ninja, the C++
compiler ``$CXX`` or ``c++``) into one library, once per process, at first
use: in ``$PAGEDLLM_CACHE_DIR/kernels/<variant>-<hash>`` (default
``~/.cache/pagedllm``), the hash covering the sources, the flags, the
compiler and torch's version (and, for ``native``, this CPU's flags).
cpp_extension locks the build folder, so concurrent processes build once.
The variant is ``$PAGEDLLM_KERNEL_ISA`` (see ``ISA_VARIANTS``); by default
the best named one this CPU runs (``avx512_bf16`` > ``avx512`` > ``avx2`` >
``scalar`` on x86-64, by /proc/cpuinfo), so a cache shared between machines
never hands one CPU code built for another; ``native`` (``-march=native``)
is the default elsewhere and an explicit choice on x86-64. One variant per
process: the op namespace is registered once. Where no compiler is found or
the build fails, ``load_kernels`` returns None with the reason logged once;
the engine then uses the pure-torch paths (the "auto" attention backend
falls back to SDPA; quantization="int8" / "int4" is refused).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from pagedllm.cache_dir import cache_root
from pagedllm.kernels.variants import (
    BUILD_INFO,
    CFLAGS,
    ISA_VARIANTS,
    LDFLAGS,
    LIBRARY_NAME,
    PREBUILT_DIR,
    PREBUILT_ISAS,
    pick_prebuilt,
    prebuilt_mismatch,
    sources_digest,
)

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# grouped in folders by concept (attention/, gguf/, packed/, simd/, step/, elementwise/), the binding at the top
_SOURCES = sorted(_HERE.rglob("*.cpp"))
_HEADERS = sorted(_HERE.rglob("*.h"))
_LIBRARY_NAME = LIBRARY_NAME
_CFLAGS = CFLAGS
_LDFLAGS = LDFLAGS


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (x86 "flags", Arm "Features")."""
    return frozenset(_cpu_flags().split(":", 1)[-1].split())


def _is_x86_64() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def runnable_isas() -> list[str]:
    """The variants this CPU can execute (all need x86-64 but "native")."""
    flags = cpu_flags()
    if not _is_x86_64():
        return ["native"]
    return [name for name, (_, needs) in ISA_VARIANTS.items() if all(f in flags for f in needs)]


def default_isa() -> str:
    """The variant used when ``PAGEDLLM_KERNEL_ISA`` is unset: the best named one this CPU runs ("native" off x86-64)."""
    runnable = runnable_isas()
    return next((isa for isa in ISA_VARIANTS if isa != "native" and isa in runnable), "native")


def kernel_isa() -> str:
    """The variant asked for with ``PAGEDLLM_KERNEL_ISA`` (``default_isa()`` when unset); ValueError if unknown."""
    isa = os.environ.get("PAGEDLLM_KERNEL_ISA") or default_isa()
    if isa not in ISA_VARIANTS:
        raise ValueError(f"PAGEDLLM_KERNEL_ISA must be one of {sorted(ISA_VARIANTS)}, got {isa!r}")
    return isa


def build_flags() -> list[str]:
    """The compiler flags of the kernel build for the chosen ISA variant."""
    isa = kernel_isa()
    if isa not in runnable_isas():
        raise ValueError(f"PAGEDLLM_KERNEL_ISA={isa!r} needs CPU features {ISA_VARIANTS[isa][1]} this CPU lacks")
    return [*_CFLAGS, *ISA_VARIANTS[isa][0]]


def cache_dir() -> Path:
    """Where built kernel libraries are kept (``$PAGEDLLM_CACHE_DIR/kernels``, default ``~/.cache/pagedllm``)."""
    return cache_root() / "kernels"


def compiler_path() -> str | None:
    """The C++ compiler cpp_extension builds the kernels with: ``$CXX``, else ``c++`` (None when not found)."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _build_dir(isa: str, flags: list[str], compiler: str) -> Path:
    """``<cache>/kernels/<variant>-<hash of the sources and their folder, flags, compiler, torch (and CPU for native)>``.

    The folder is in the hash because cpp_extension writes the sources' paths into the
    build's ``build.ninja``: two checkouts of the same sources sharing one build folder
    would each find the other's paths there and rebuild on every load.
    """
    import torch

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    sources = "\0".join(f"{p.parent.name}/{p.name}\0{p.read_text()}" for p in [*_SOURCES, *_HEADERS])
    # a named variant's code runs on every CPU with its features: the build folder can be
    # shared between machines; -march=native is this CPU's own
    cpu = _cpu_flags() if isa == "native" else ""
    key = hashlib.sha256(
        "\0".join([sources, str(_SOURCES[0].parent.resolve()), " ".join(flags), version, torch.__version__,
                   platform.machine(), cpu]).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"{isa}-{key}"


def _loaded_builds() -> list[str]:
    """The builds of the kernels this process has loaded (at most one: the op namespace is registered once)."""
    import torch

    return [str(p) for p in getattr(torch.ops, "loaded_libraries", ()) if Path(p).name.startswith(_LIBRARY_NAME)]


# cpp_extension waits, without end, while its lock file exists; a build killed
# mid-way (a timeout, Ctrl-C) leaves it behind. Every build and load here runs
# under an OS lock of the folder (``_build_lock``), which the OS releases when
# its process dies: a lock file found while holding it was left by a killed
# build. Where there is no OS lock (no fcntl), a lock file older than any build
# (measured: 4 minutes at most on 2 loaded cores) is taken as stale.
_STALE_LOCK_SECONDS = 20 * 60


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[bool]:
    """Hold an exclusive OS lock on ``build_dir`` (``fcntl.flock``, waiting for another process's build);
    yields whether it is held (False where the platform has no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:  # Windows: the age rule alone
        yield False
        return
    with open(build_dir / ".build-lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _clear_stale_lock(lock: Path, sole_builder: bool = False) -> None:
    """Remove cpp_extension's lock file left by a killed build, so the next build does not wait forever:
    always when ``sole_builder`` (this process holds ``_build_lock``), else when it is older than any build."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if sole_builder or age > _STALE_LOCK_SECONDS:
        logger.warning("removing the kernel build lock %s, left %.0f minutes ago by a build that did not finish",
                       lock, age / 60)
        lock.unlink(missing_ok=True)


def _compile(build_dir: Path, flags: list[str]) -> str:
    """Build (or find built) and load the library, once per process; its path."""
    from torch.utils import cpp_extension

    path = str(build_dir / f"{_LIBRARY_NAME}.so")
    loaded = _loaded_builds()
    if path in loaded:
        # loaded before _load's cache was cleared: loading again would make cpp_extension
        # rebuild under a new name and register the namespace twice
        return path
    if loaded:
        raise RuntimeError(f"this process already loaded another build of the kernels ({loaded[0]}); "
                           "one variant per process")
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir) as sole_builder:
        _clear_stale_lock(build_dir / "lock", sole_builder)
        # a first build takes minutes: say so before and after, or the first run looks hung
        building = not Path(path).exists()
        if building:
            logger.info("building the native CPU kernels into %s (once per machine and source version; "
                        "a few minutes)", build_dir)
        start = time.perf_counter()
        cpp_extension.load(
            name=_LIBRARY_NAME, sources=[str(p) for p in _SOURCES], extra_cflags=list(flags),
            extra_ldflags=list(_LDFLAGS), build_directory=str(build_dir), is_python_module=False, verbose=False,
        )
    if building:
        logger.info("built the native CPU kernels in %.0f s", time.perf_counter() - start)
    return path


def prebuilt_libraries(directory: Path = PREBUILT_DIR) -> dict[str, Path]:
    """The prebuilt variants found in ``directory`` (a wheel's ``_prebuilt``), best first: {variant: library}."""
    out = {}
    for isa in PREBUILT_ISAS:
        # "<name>_<isa>.so" or "<name>_<isa>.cpython-311-x86_64-linux-gnu.so" (setuptools' suffix)
        found = sorted(directory.glob(f"{LIBRARY_NAME}_{isa}.*so"))
        if found:
            out[isa] = found[0]
    return out


def prebuilt_info(directory: Path = PREBUILT_DIR) -> dict | None:
    """The prebuilt libraries' record (the torch they were built against, the sources' hash), None if absent."""
    try:
        return json.loads((directory / BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None


def choose_prebuilt(isa: str | None, available: dict[str, Path], info: dict | None, torch_version: str,
                    digest: str | None, cpu_features: frozenset[str], machine: str) -> tuple[str | None, str | None]:
    """(the prebuilt variant to load, or None; why the prebuilt ones were refused, or None).

    ``isa``: the variant ``PAGEDLLM_KERNEL_ISA`` forces (None: the best this CPU runs).
    """
    if not available:
        return None, None
    if info is None:
        return None, f"the prebuilt kernels have no {BUILD_INFO} (the torch they were built against is unknown)"
    why = prebuilt_mismatch(info, torch_version, digest)
    if why is not None:
        return None, why
    # only the variants this record lists (an in-tree build folder may hold older ones)
    available = {k: v for k, v in available.items() if k in info.get("variants", available)}
    if isa is not None:
        return (isa if isa in available else None), None
    return pick_prebuilt(cpu_features, available, machine), None


def _load_prebuilt(path: Path) -> str:
    import torch

    loaded = _loaded_builds()
    if str(path) in loaded:
        return str(path)
    if loaded:
        raise RuntimeError(f"this process already loaded another build of the kernels ({loaded[0]}); "
                           "one variant per process")
    torch.ops.load_library(str(path))
    return str(path)


class KernelLoad(NamedTuple):
    ops: Any
    failure: str | None  # why the kernels are not loaded
    path: str | None  # the library loaded
    variant: str | None  # its ISA variant
    prebuilt: bool  # a wheel's prebuilt library (False: built here)
    prebuilt_refused: str | None  # why the wheel's prebuilt libraries were not used


@functools.cache
def _load() -> KernelLoad:
    """Load the ops once per process (a wheel's prebuilt library, else one built here)."""
    start = time.perf_counter()
    isa = kernel_isa()
    flags = build_flags()  # a forced ISA this CPU cannot run is the caller's error, raised here
    refused = None
    available = {} if os.environ.get("PAGEDLLM_KERNELS_PREBUILT") == "0" else prebuilt_libraries()
    if available:
        import torch

        digest = sources_digest() if _SOURCES else None
        chosen, refused = choose_prebuilt(os.environ.get("PAGEDLLM_KERNEL_ISA") or None, available, prebuilt_info(),
                                          torch.__version__, digest, cpu_flags(), platform.machine())
        if chosen is not None:
            try:
                path = _load_prebuilt(available[chosen])
            except (OSError, RuntimeError) as e:
                refused = f"the prebuilt {chosen} kernels did not load: {e}"
            else:
                return _loaded(path, chosen, True, None, start)
        if refused:
            logger.warning("%s: building the kernels here instead", refused)
    try:
        compiler = compiler_path()
        if compiler is None:
            raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX') or 'c++'} not found")
        path = _compile(_build_dir(isa, flags, compiler), flags)
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as e:
        detail = getattr(e, "output", None) or getattr(e, "stderr", None) or str(e)
        logger.warning("native CPU kernels unavailable, using the torch paths: %s", detail)
        return KernelLoad(None, str(detail), None, None, False, refused)
    return _loaded(path, isa, False, refused, start)


def _loaded(path: str, isa: str, prebuilt: bool, refused: str | None, start: float) -> KernelLoad:
    import torch

    from pagedllm.kernels.meta import register_fakes

    register_fakes()
    logger.debug("native kernels (%s, %s) loaded in %.2f s: %s", isa, "prebuilt" if prebuilt else "built here",
                 time.perf_counter() - start, path)
    return KernelLoad(torch.ops.pagedllm, None, path, isa, prebuilt, refused)


def load_kernels() -> Any | None:  # noqa: ANN401 (torch's op namespace has no useful static type)
    """The ops' namespace ``torch.ops.pagedllm`` once the library is loaded, or None when it cannot be built here."""
    return _load().ops


def kernels_available() -> bool:
    """Whether the native ops are loaded (prebuilt, built here, or found built in the cache)."""
    return _load().ops is not None


def kernels_failure() -> str | None:
    """Why the kernels could not be loaded (None if they loaded)."""
    return _load().failure


def library_path() -> str | None:
    """The library in use (None if the kernels did not load)."""
    return _load().path


def loaded_variant() -> str | None:
    """The ISA variant of the library in use (None if the kernels did not load)."""
    return _load().variant


def kernels_prebuilt() -> bool:
    """Whether the library in use is one a wheel shipped prebuilt (False: built here, or none loaded)."""
    return _load().prebuilt


def prebuilt_refused() -> str | None:
    """Why a wheel's prebuilt libraries were not used (None: used, or there are none)."""
    return _load().prebuilt_refused
