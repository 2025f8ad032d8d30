"""Native CPU kernels, compiled on first use with the system C compiler.

The paged decode kernel (``paged_decode.c``) is plain C with OpenMP and no
torch headers, so it builds in about a second with gcc and is called through
ctypes on tensors' data pointers. The built library is cached under
``$PAGEDLLM_CACHE_DIR`` (default ``~/.cache/pagedllm``), keyed by the source,
the flags, the compiler and this CPU's feature flags (it is built with
``-march=native``). Where no compiler is found or the build fails,
``load_paged_decode`` returns None with the reason logged once, and the
engine uses the pure-torch backend instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode.c")
# -ffast-math is avoided on purpose: linking with it would switch the whole
# process to flush-to-zero. Reassociation alone lets gcc vectorise the dot
# products.
_CFLAGS = [
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast",
]
_loaded: dict[str, ctypes.CDLL | None] = {}
_failure: dict[str, str] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return Path(root) / "kernels"


def _build(compiler: str, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=output.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_CFLAGS, str(_SOURCE), "-o", tmp, "-lm"],
            check=True, capture_output=True, text=True, timeout=120,
        )
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_paged_decode() -> ctypes.CDLL | None:
    """The compiled paged decode library, or None when it cannot be built here."""
    if "paged_decode" in _loaded:
        return _loaded["paged_decode"]
    lib = None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    try:
        if compiler is None:
            raise RuntimeError("no C compiler (gcc or cc) on PATH")
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(
            "\0".join([_SOURCE.read_text(), " ".join(_CFLAGS), version, platform.machine(), _cpu_flags()]).encode()
        ).hexdigest()[:16]
        path = _cache_dir() / f"paged_decode-{key}.so"
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
        fn = lib.paged_decode_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # q, k_cache, v_cache
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # block_tables, table_stride, seq_lens
            ctypes.c_void_p,  # out
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # num_seqs, num_heads, num_kv_heads, head_dim
            ctypes.c_int, ctypes.c_int, ctypes.c_float,  # block_size, num_threads, scale
        ]
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        _failure["paged_decode"] = detail
        logger.warning("paged decode kernel unavailable, using the torch path: %s", detail)
        lib = None
    _loaded["paged_decode"] = lib
    return lib


def paged_decode_failure() -> str | None:
    """Why the kernel could not be loaded (None if it loaded or was not tried)."""
    return _failure.get("paged_decode")
