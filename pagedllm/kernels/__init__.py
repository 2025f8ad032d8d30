"""Native CPU kernels, compiled on first use with the system C compiler.

Plain C with OpenMP and no torch headers, built into one shared library in
a few seconds with gcc and called through ctypes on tensors' data pointers:
``paged_decode.c`` (decode attention reading KV blocks in place, from a
float32, float16 or bfloat16 cache),
``int8_linear.c`` (weight-only int8 matmul for a few rows),
``packed_linear.c`` (float32 matmul over weights packed into column panels),
``packed_linear_bf16.c`` (the same with bfloat16 weights and products, float32 in and out),
``logit_stats.c`` (per-row argmax and logsumexp of the logits),
``kv_write.c`` (new K/V rows into their cache slots, rounded to the cache's dtype),
``elementwise.c`` (RMSNorm with the residual add, RoPE after Qwen3's q/k norms, SiLU-and-multiply),
``prefill_attention.c`` (causal attention of prompts computed from scratch)
and ``decode_step.c`` (a whole decoder step for decode tokens,
built from the others through the shared headers ``paged_attention.h``
(with ``paged_attention_kv.h``, instantiated once per cache dtype),
``int8_dot.h``, ``panel_f32.h``, ``panel_bf16.h``, ``kv_rows.h`` and ``elementwise.h``; the two panel
matmuls share ``panel_units.h``). The built library is cached under
``$PAGEDLLM_CACHE_DIR`` (default ``~/.cache/pagedllm``), keyed by the source,
the flags, the compiler and this CPU's feature flags (it is built with
``-march=native``, or for the instruction set ``$PAGEDLLM_KERNEL_ISA`` names:
``avx512_bf16``, ``avx512``, ``avx2``, ``scalar``; see ``ISA_VARIANTS``). Where no compiler is found or the build fails,
``load_kernels`` returns None with the reason logged once; the engine then
uses the pure-torch paths (the "auto" attention backend falls back to SDPA,
int8 layers to a dequantized matmul).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -ffast-math is avoided on purpose: linking with it would switch the whole
# process to flush-to-zero. Reassociation alone lets gcc vectorise the dot
# products.
_CFLAGS = [
    "-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast",
]


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


# PAGEDLLM_KERNEL_ISA: which instruction set the kernels are compiled for. "native"
# (the default) is this CPU's own (-march=native); the others force one of the
# code paths the sources hold (#if __AVX512BF16__ / __AVX512F__ / __AVX2__ /
# plain C), so every path can be tested on a CPU that runs it. Each needs the
# CPU features listed; asking for one the CPU lacks is an error, not a crash.
ISA_VARIANTS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "native": (["-march=native"], ()),
    "avx512_bf16": (["-march=x86-64-v4", "-mavx512bf16", "-mf16c", "-mfma"],
                    ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16")),
    "avx512": (["-march=x86-64-v4"], ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")),
    "avx2": (["-march=x86-64-v3"], ("avx2", "fma", "f16c", "bmi2", "movbe")),
    "scalar": (["-march=x86-64"], ()),
}


def kernel_isa() -> str:
    """The variant asked for with ``PAGEDLLM_KERNEL_ISA`` ("native" when unset); ValueError if unknown."""
    isa = os.environ.get("PAGEDLLM_KERNEL_ISA", "native") or "native"
    if isa not in ISA_VARIANTS:
        raise ValueError(f"PAGEDLLM_KERNEL_ISA must be one of {sorted(ISA_VARIANTS)}, got {isa!r}")
    return isa


def runnable_isas() -> list[str]:
    """The variants this CPU can execute (all need x86-64 but "native")."""
    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["native"]
    return [name for name, (_, needs) in ISA_VARIANTS.items() if all(f in flags for f in needs)]


def build_flags() -> list[str]:
    """The compiler flags of the kernel build for the chosen ISA variant."""
    isa = kernel_isa()
    if isa not in runnable_isas():
        raise ValueError(f"PAGEDLLM_KERNEL_ISA={isa!r} needs CPU features {ISA_VARIANTS[isa][1]} this CPU lacks")
    return [*_CFLAGS, *ISA_VARIANTS[isa][0]]


def cache_dir() -> Path:
    """Where built kernel libraries are kept (``$PAGEDLLM_CACHE_DIR/kernels``, default ``~/.cache/pagedllm``)."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return Path(root) / "kernels"


def compiler_path() -> str | None:
    """The C compiler the kernels are built with: ``$CC``, else gcc or cc on PATH."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(compiler: str, output: Path, flags: list[str]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=output.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, *map(str, _SOURCES), "-o", tmp, "-lm"],
            check=True, capture_output=True, text=True, timeout=120,
        )
        os.chmod(tmp, 0o755)  # mkstemp makes it private; a shared cache dir must stay usable
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """Build (once per process) and load the library: (library, None, path) or (None, why not, None)."""
    compiler = compiler_path()
    flags = build_flags()  # a forced ISA this CPU cannot run is the caller's error, raised here
    try:
        if compiler is None:
            raise RuntimeError("no C compiler (gcc or cc) on PATH")
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        sources = "\0".join(p.read_text() for p in [*_SOURCES, *_HEADERS])
        key = hashlib.sha256(
            "\0".join([sources, " ".join(flags), version, platform.machine(), _cpu_flags()]).encode()
        ).hexdigest()[:16]
        path = cache_dir() / f"pagedllm_kernels-{kernel_isa()}-{key}.so"
        if not path.exists():
            _build(compiler, path, flags)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning("native CPU kernels unavailable, using the torch paths: %s", detail)
        return None, detail, None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.paged_decode.restype = i32
    lib.paged_decode.argtypes = [
        ptr, ptr, ptr, i32,  # q, k_cache, v_cache, kv_type (KV_TYPE_CODES)
        ptr, i64, ptr,  # block_tables, table_stride, seq_lens
        ptr,  # out
        i32, i32, i32, i32,  # num_seqs, num_heads, num_kv_heads, head_dim
        i32, i32, ctypes.c_float,  # block_size, num_threads, scale
    ]
    lib.int8_linear_f32.restype = None
    lib.int8_linear_f32.argtypes = [
        ptr, i64, i64, ptr,  # x, num_rows, in_features, w
        ptr, ptr, i64, ptr,  # scales, bias, out_features, out
        i32,  # num_threads
    ]
    lib.packed_linear_panel.restype = i32
    lib.packed_linear_panel.argtypes = []
    lib.packed_linear_pack.restype = None
    lib.packed_linear_pack.argtypes = [ptr, i64, i64, ptr]  # w, out_features, in_features, packed
    lib.packed_linear_f32.restype = None
    lib.packed_linear_f32.argtypes = [
        ptr, i64, i64, ptr,  # x, num_rows, in_features, packed
        ptr, i64, ptr, i32,  # bias, out_features, out, num_threads
    ]
    lib.packed_linear_bf16_panel.restype = i32
    lib.packed_linear_bf16_panel.argtypes = []
    lib.packed_linear_bf16_native.restype = i32
    lib.packed_linear_bf16_native.argtypes = []
    lib.packed_linear_bf16_pack.restype = None
    lib.packed_linear_bf16_pack.argtypes = [ptr, i64, i64, ptr]  # w (float32), out_features, in_features, packed
    lib.packed_linear_bf16.restype = i32
    lib.packed_linear_bf16.argtypes = [
        ptr, i64, i64, ptr,  # x (float32), num_rows, in_features, packed (bf16)
        ptr, i64, ptr, i32,  # bias (float32), out_features, out (float32), num_threads
    ]
    lib.write_kv.restype = i32
    lib.write_kv.argtypes = [
        ptr, i64, ptr, i64, ptr, ptr, i32,  # k, k_stride, v, v_stride, k_cache, v_cache, kv_type
        ptr, i64, i64, i64, i32,  # slots, num_tokens, row elements, num_slots, num_threads
    ]
    lib.logit_stats_f32.restype = None
    lib.logit_stats_f32.argtypes = [ptr, i64, i64, ptr, ptr, i32]  # logits, rows, vocab, argmax, lse, threads
    f32 = ctypes.c_float
    lib.add_rms_norm_f32.restype = None
    lib.add_rms_norm_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32, i32]  # x, delta, w, y, rows, n, eps, threads
    lib.qk_norm_rope_f32.restype = None
    lib.qk_norm_rope_f32.argtypes = [
        ptr, i64, i64, i64, i64, i64,  # x, rows, row_stride, num_q_heads, num_kv_heads, head_dim
        ptr, ptr, f32, ptr, ptr, i32,  # q_norm, k_norm, eps, cos, sin, threads
    ]
    lib.silu_mul_f32.restype = None
    lib.silu_mul_f32.argtypes = [ptr, ptr, i64, i64, i32]  # gate_up, out, rows, inter, threads
    lib.prefill_attention_f32.restype = i32
    lib.prefill_attention_f32.argtypes = [
        ptr, i64, ptr, i64, ptr, i64, ptr, i64,  # q, k, v, out with their row strides
        ptr, i32, i32, i32, i32, f32, i32,  # bounds, num_seqs, num_heads, num_kv_heads, head_dim, scale, threads
    ]
    lib.decode_step.restype = i32
    lib.decode_step.argtypes = [
        ptr, ptr, i64, ptr, ptr,  # model, x, num_rows, positions, slots
        ptr, i64, ptr, ptr,  # block_tables, table_stride, seq_lens, out
        i32,  # num_threads
    ]
    return lib, None, str(path)


# the kernels' numbering of KV cache element types (paged_attention.h)
KV_TYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}


def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it cannot be built here."""
    return _load()[0]


def kernels_failure() -> str | None:
    """Why the kernels could not be loaded (None if they loaded)."""
    return _load()[1]


def library_path() -> str | None:
    """The built library in use (None if the kernels did not load)."""
    return _load()[2]
