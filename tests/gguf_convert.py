"""GGUF files made as users make them: llama.cpp's own ``convert_hf_to_gguf.py`` run on a Hugging Face folder.

The converter (with the ``conversion`` package it imports and the
``gguf-py`` it was written against) is taken from the llama-cpp-python
sdist on PyPI, which vendors llama.cpp: ``pip download`` fetches the
pinned version once (its sha256 checked), and the three parts are
extracted into ``<pagedllm cache>/llama-cpp-converter/<version>/``
(``$PAGEDLLM_CACHE_DIR``, default ``~/.cache/pagedllm``), where later runs
find them; the 77 MB archive is not kept. A lock file makes concurrent
test sessions fetch it once.

The converter runs in a subprocess of this interpreter (so with the
environment's torch, numpy and transformers) with its own ``gguf-py`` first on
``PYTHONPATH``, not the ``gguf`` package pagedllm reads files with. It also
imports ``sentencepiece``, which is installed beside it (``pip install
--target <cache>/llama-cpp-converter/deps``) and put on the converter's
``PYTHONPATH`` only, never into the environment: sentencepiece's wheel
carries its own libgomp, and a test process that imported it (transformers
does, where it is installed) would run two OpenMP runtimes
(``test_native_ops`` checks that the kernels share torch's).

One thing differs from a user's run, for folders whose ``model_type`` is
``qwen2``: transformers 5 loads such a folder's tokenizer as
``Qwen2Tokenizer``, which rebuilds Qwen's pre-tokenizer instead of reading
the one saved in ``tokenizer.json``. The tiny test checkpoints carry
SmolLM2's tokenizer, and the converter identifies a BPE pre-tokenizer by
hashing its tokens for a fixed text: SmolLM2's vocabulary under Qwen's
rules is a tokenizer it does not know (a real Qwen2 folder, Qwen's
vocabulary under Qwen's rules, is one it knows), so it stops. For those
folders the converter is started through a two-line wrapper that makes
``AutoTokenizer`` read ``tokenizer.json`` as saved, as it does for the
Llama and Qwen3 folders. Weights and metadata are converted untouched.

``convert`` runs the converter in a process of its own, as a user does.
``ConverterProcess`` (the tests' session fixture ``gguf_converter``) runs
it once per file in one long-lived process, the script executed as
``__main__`` with each file's command line: most of a one-off run is
importing torch, transformers and the converter, which that process does
once. Its files are byte for byte the one-off runs' (checked when it was
written, for Llama and Qwen2 folders in F32 and F16, in either order and
after a failed run).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gguf import GGUFReader

from pagedllm.cache_dir import cache_root

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# of llama_cpp_python-0.3.36.tar.gz on PyPI
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# what the converter needs from the sdist's vendor/llama.cpp/
_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# model_types whose saved tokenizer transformers 5 rebuilds under another class (see the module docstring)
_RETOKENIZED_MODEL_TYPES = ("qwen2", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_RUN_WITH_SAVED_TOKENIZER = (
    "import runpy, sys\n"
    "from transformers import AutoTokenizer, PreTrainedTokenizerFast\n"
    "AutoTokenizer.from_pretrained = PreTrainedTokenizerFast.from_pretrained\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
# what the converter imports that the test environment must not (see the module docstring)
_CONVERTER_DEPS = ("sentencepiece",)
_PIP_TIMEOUT_S = 600
_CONVERT_TIMEOUT_S = 300


def converter_dir() -> Path:
    """The folder holding ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``, fetched on first use.

    RuntimeError (with pip's output) when it cannot be fetched: the tests
    that need it need PyPI once.
    """
    root = cache_root() / "llama-cpp-converter"
    target = root / LLAMA_CPP_PYTHON_VERSION
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"):
        if not (target / "convert_hf_to_gguf.py").is_file():  # another session may have fetched it meanwhile
            _fetch(root, target)
    return target


def converter_deps_dir() -> Path:
    """The folder of the converter's own dependencies (``_CONVERTER_DEPS``), installed there on first use."""
    root = cache_root() / "llama-cpp-converter"
    target = root / "deps"
    if (target / ".done").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"), tempfile.TemporaryDirectory(dir=root) as tmp:
        if not (target / ".done").is_file():
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet",
                   "--target", tmp, *_CONVERTER_DEPS]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"could not install the converter's dependencies ({' '.join(cmd)}):\n"
                                   f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
            Path(tmp, ".done").touch()
            os.replace(tmp, target)
            os.mkdir(tmp)  # for the TemporaryDirectory's own clean-up
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fetch(root: Path, target: Path) -> None:
    """Download the sdist, check it, extract the converter's parts into ``target`` (renamed into place whole)."""
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        # --no-binary for this package only: the sdist, while pip prepares its metadata with wheels of its
        # build requirements (':all:' would build those from source, cmake included)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
               "--disable-pip-version-check", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        archive = Path(tmp) / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        if done.returncode != 0 or not archive.is_file():
            raise RuntimeError(f"could not fetch llama.cpp's converter ({' '.join(cmd)}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{archive.name} has sha256 {digest}, expected {SDIST_SHA256}")
        staging = Path(tmp) / "parts"
        _extract_parts(archive, staging)
        os.replace(staging, target)


def _extract_parts(archive: Path, dest: Path) -> None:
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            rel = member.name.removeprefix(prefix)
            if member.name.startswith(prefix) and rel.split("/", 1)[0] in _PARTS and (member.isfile() or member.isdir()):
                member.name = rel
                members.append(member)
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kwargs)
    missing = [p for p in _PARTS if not (dest / p).exists()]
    if missing:
        raise RuntimeError(f"{archive.name} lacks vendor/llama.cpp/{missing}")


def _converter_env() -> dict[str, str]:
    """The environment the converter runs in: its own ``gguf-py`` and dependencies first on ``PYTHONPATH``."""
    env = dict(os.environ)
    # the converter's own gguf-py first (it also puts it on sys.path itself, after the script's folder)
    paths = (str(converter_dir() / "gguf-py"), str(converter_deps_dir()), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


# model types the converter exports a multi-token-prediction head for by default (it asserts there is one)
_MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def _converter_args(model_dir: str, outtype: str, out_path: str) -> list[str]:
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    # a tiny checkpoint of these has no MTP layers: the converter is told so (--no-mtp)
    no_mtp = cfg.get("model_type") in _MTP_MODEL_TYPES and not cfg.get("mtp_num_hidden_layers")
    return [model_dir, "--outtype", outtype, "--outfile", out_path, *(["--no-mtp"] if no_mtp else [])]


def _reads_saved_tokenizer(model_dir: str) -> bool:
    """Whether the converter must be made to read the folder's ``tokenizer.json`` as saved (module docstring)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f).get("model_type") in _RETOKENIZED_MODEL_TYPES


def convert(model_dir: str, outtype: str, out_path: str) -> str:
    """Run llama.cpp's converter on the Hugging Face folder ``model_dir`` in a process of its own; returns
    ``out_path``, the GGUF written.

    RuntimeError with the converter's output when it fails.
    """
    args = [str(converter_dir() / "convert_hf_to_gguf.py"), *_converter_args(model_dir, outtype, out_path)]
    if _reads_saved_tokenizer(model_dir):
        cmd = [sys.executable, "-c", _RUN_WITH_SAVED_TOKENIZER, *args]
    else:
        cmd = [sys.executable, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_converter_env(), timeout=_CONVERT_TIMEOUT_S)
    if done.returncode != 0 or not os.path.isfile(out_path):
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir} (--outtype {outtype}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-6000:]}")
    return out_path


# The worker of ConverterProcess: runs the converter script as __main__ once per job read from stdin (one JSON
# line: its arguments, whether it reads the saved tokenizer, its log file) with the process's stdout and stderr
# sent to the job's log, and answers one JSON line on the stdout it started with. The script's imports (torch,
# transformers, the conversion package: most of a run's time) stay loaded between jobs.
_WORKER = (
    "import json, os, runpy, sys, traceback\n"
    "from transformers import AutoTokenizer, PreTrainedTokenizerFast\n"
    "script = sys.argv[1]\n"
    "sys.path.insert(0, os.path.dirname(script))\n"
    "own_from_pretrained = AutoTokenizer.__dict__['from_pretrained']\n"
    "reply = os.fdopen(os.dup(1), 'w')\n"
    "for line in iter(sys.stdin.readline, ''):\n"
    "    job = json.loads(line)\n"
    "    log = os.open(job['log'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
    "    os.dup2(log, 1); os.dup2(log, 2); os.close(log)\n"
    "    AutoTokenizer.from_pretrained = (PreTrainedTokenizerFast.from_pretrained if job['saved_tokenizer']\n"
    "                                     else own_from_pretrained)\n"
    "    sys.argv = [script, *job['args']]\n"
    "    error = None\n"
    "    try:\n"
    "        runpy.run_path(script, run_name='__main__')\n"
    "    except BaseException:\n"
    "        error = traceback.format_exc()\n"
    "    sys.stdout.flush(); sys.stderr.flush()\n"
    "    reply.write(json.dumps({'error': error}) + '\\n'); reply.flush()\n"
)


class ConverterProcess:
    """One converter process that converts many folders, one after another, for the life of this object.

    Each conversion is the script run as ``__main__`` with its command line,
    as ``convert`` runs it, in a process that keeps the script's imports
    loaded: most of a one-off run is importing torch, transformers and the
    converter. Started on first use; ``close`` ends it.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._proc: subprocess.Popen | None = None
        self.num_jobs = 0

    def _worker(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            script = str(converter_dir() / "convert_hf_to_gguf.py")
            self._proc = subprocess.Popen([sys.executable, "-c", _WORKER, script], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=_converter_env())
        return self._proc

    def convert(self, model_dir: str, outtype: str, out_path: str) -> str:
        """As ``convert``, in this object's process; returns ``out_path``."""
        args = _converter_args(model_dir, outtype, out_path)
        self.num_jobs += 1
        log = self.log_dir / f"convert-{self.num_jobs}.log"
        proc = self._worker()
        job = {"args": args, "saved_tokenizer": _reads_saved_tokenizer(model_dir), "log": str(log)}
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], _CONVERT_TIMEOUT_S)
        answer = proc.stdout.readline() if ready else ""
        if not answer:  # timed out or died: a fresh process for the next job
            self.close()
        error = json.loads(answer)["error"] if answer else "the converter process ended or timed out"
        if error is not None or not os.path.isfile(out_path):
            output = log.read_text(errors="replace") if log.is_file() else ""
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir} (--outtype {outtype}):\n"
                               f"{output[-6000:]}{error or ''}")
        return out_path

    def close(self) -> None:
        """End the process (it exits at the end of its input)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


class ConvertedModels:
    """GGUF files converted from tiny checkpoints, once per (name, outtype) for the life of this object."""

    def __init__(self, model_dirs: dict[str, str], out_dir: Path, converter: ConverterProcess | None = None) -> None:
        self.model_dirs, self.out_dir = model_dirs, out_dir
        self.converter = converter  # None: a process per file (``convert``)
        self.files: dict[tuple[str, str], str] = {}

    def __call__(self, name: str, outtype: str) -> str:
        """The GGUF of ``model_dirs[name]`` in ``outtype``, converted on first request."""
        key = (name, outtype)
        if key not in self.files:
            out = self.out_dir / f"{name}-{outtype}.gguf"
            run = convert if self.converter is None else self.converter.convert
            self.files[key] = run(self.model_dirs[name], outtype, str(out))
        return self.files[key]



def read_gguf(path: str) -> GGUFReader:
    """gguf's ``GGUFReader`` of ``path`` with its metadata parsed by pagedllm's ``struct`` loop (``gguf_loader._Reader``).

    gguf's own parse of a 49k vocabulary and its merges takes seconds per
    file; this one a tenth of one, and it reads what gguf reads
    (``tests/engine/test_tokenizer_cache.py`` compares the two on the
    bundled file). The tensors are gguf's own.
    """
    from pagedllm.loader.gguf_loader import _Reader

    return _Reader(path)
