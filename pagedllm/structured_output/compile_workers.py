"""Grammar compiles in worker processes, where a compile can be stopped: by a time limit, a memory limit, or its request.

xgrammar compiles in C++; on a Python thread nothing interrupts it, so a
hostile schema compiled in the server process runs (and allocates) until it
is done, long after its client left. Here each compile first runs in a
worker process (``python -m pagedllm.structured_output.compile_workers``, spawned on the
first compile and kept), which

- holds the tokenizer's xgrammar info (sent once, as JSON),
- compiles single-threaded, with xgrammar's own cache off (the parent caches),
- runs under ``RLIMIT_AS`` = its size when ready + ``compile_memory_bytes``,
  so a compile past the memory limit fails (or dies) in the worker,

and the parent kills it (and spawns a fresh one for the next compile) when
the compile runs past ``compile_timeout_s`` or its request is cancelled.

The worker answers only whether the constraint compiles within the limits;
the parent then compiles it itself. Sending the compiled grammar back
(``CompiledGrammar.serialize_json``) costs more than compiling it again:
its JSON grows with the grammar's states times the vocabulary (2 MB and
0.5 s for 100 object properties, 227 MB and ~60 s for 1,000, where the
compile itself took 0.4 s), so the second compile is the cheap round trip.

How many compiles run at once is the number of workers (``max_num_compiles``);
a compile waits for a free one, and stops waiting when its request is cancelled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, Pipe
from typing import Any

from pagedllm.structured_output.limits import GrammarLimitError, GrammarLimits

logger = logging.getLogger(__name__)

# a fresh worker imports xgrammar (and torch): seconds, more on a loaded machine
SPAWN_TIMEOUT_S = 300.0
# how often a waiting compile looks at its cancel event
POLL_S = 0.05
# "[10:54:14] /project/cpp/json_schema_converter.cc:5082: " before xgrammar's own message
_XGRAMMAR_LOCATION = r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*"


class CompileCancelled(Exception):  # noqa: N818 - a cancellation, not an error of the constraint
    """The compile's request was cancelled (its client left); the compile was stopped."""


class ConstraintError(ValueError):
    """xgrammar refused the constraint (it is not a valid schema, regex or grammar); the message is xgrammar's."""


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``.

    JSON string literals are EBNF string literals (the same escapes), so
    quotes, backslashes and control characters in a choice stay literal.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_key(compiler: Any, key: tuple[str, str, bool]) -> Any:  # noqa: ANN401 - xgrammar objects
    """Compile a constraint given by its key (``StructuredOutputsParams.key``: kind, text, disable_any_whitespace)."""
    kind, text, disable_any_whitespace = key
    any_whitespace = not disable_any_whitespace
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    if kind == "json_object":
        # any object (not any JSON value, as xgrammar's builtin JSON grammar allows)
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    return compiler.compile_grammar(text)


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without the C++ source location it starts with."""
    import re

    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return re.sub(_XGRAMMAR_LOCATION, "", lines[0]) if lines else type(e).__name__


class _Worker:
    """One worker process and its pipe; spawned when first needed, killed and forgotten on a stop."""

    def __init__(self, info_json: Callable[[], str], memory_bytes: int, timeout_s: float) -> None:
        self._info_json = info_json
        self._memory_bytes = memory_bytes
        self._timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None
        self._conn: Connection | None = None

    def spawn(self, cancel: threading.Event | None) -> None:
        """Start the process and wait until it is ready; CompileCancelled on ``cancel``."""
        parent, child = Pipe()
        # one malloc arena: a thread's own arena reserves 64 MiB of address space, which RLIMIT_AS counts
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   MALLOC_ARENA_MAX="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.structured_output.compile_workers", str(child.fileno()), str(self._memory_bytes),
             str(self._timeout_s)],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL,
        )
        child.close()
        self._conn = parent
        parent.send(self._info_json())
        reply = self._wait(time.monotonic() + SPAWN_TIMEOUT_S, cancel)
        if reply is None or reply[0] != "ready":
            self.kill()
            raise RuntimeError(f"the grammar compile worker did not start: {reply!r}")

    def _wait(self, deadline: float, cancel: threading.Event | None) -> tuple | None:
        """The worker's next message; None when it died, past ``deadline`` or on ``cancel`` (it is then killed)."""
        conn = self._conn
        if conn is None:
            return None
        while True:
            try:
                if conn.poll(POLL_S):
                    return conn.recv()
            except (EOFError, OSError):
                return None
            if cancel is not None and cancel.is_set():
                self.kill()
                raise CompileCancelled("the request was cancelled while its grammar compiled")
            if time.monotonic() > deadline:
                self.kill()
                return ("timeout",)

    def probe(self, key: tuple[str, str, bool], timeout_s: float, cancel: threading.Event | None) -> tuple:
        """Compile ``key`` in the worker: ``("ok", bytes)``, ``("error", message)``, ``("timeout",)``,
        ``("memory",)`` or ``("died",)``; CompileCancelled on ``cancel``."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self.spawn(cancel)
        try:
            self._conn.send(key)  # type: ignore[union-attr] - set by _spawn
        except (AttributeError, OSError):
            self.kill()
            return ("died",)
        reply = self._wait(time.monotonic() + timeout_s, cancel)
        if reply is None:
            self.kill()
            return ("died",)
        if reply[0] == "memory":
            self.kill()  # its heap is fragmented by the failed allocations: start clean
        return reply

    def kill(self) -> None:
        """Stop the process now (SIGKILL) and reap it; the next probe spawns a fresh one."""
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.wait()
        if self._conn is not None:
            self._conn.close()
        self.proc, self._conn = None, None


class CompileWorkers:
    """``limits.max_num_compiles`` worker processes; ``slot()`` waits for a free one.

    Args:
        info_json: the tokenizer's ``xgrammar.TokenizerInfo`` as JSON (called once per spawn).
        limits: the compile limits (time, memory, how many at once).
    """

    def __init__(self, info_json: Callable[[], str], limits: GrammarLimits) -> None:
        self.limits = limits
        self._free: queue.Queue[_Worker] = queue.Queue()
        self._workers = [
            _Worker(info_json, limits.compile_memory_bytes, limits.compile_timeout_s)
            for _ in range(limits.max_num_compiles)
        ]
        for w in self._workers:
            self._free.put(w)
        self._lock = threading.Lock()
        self._closed = False
        self.num_waiting = 0
        self.num_running = 0
        self.num_stopped = 0  # compiles killed: past the time or memory limit, or cancelled

    @contextlib.contextmanager
    def slot(self, cancel: threading.Event | None) -> Iterator[_Worker]:
        """A free worker for the block; CompileCancelled when ``cancel`` is set while waiting."""
        with self._lock:
            self.num_waiting += 1
        try:
            while True:
                try:
                    worker = self._free.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    if cancel is not None and cancel.is_set():
                        raise CompileCancelled("the request was cancelled while its grammar waited to compile") from None
        finally:
            with self._lock:
                self.num_waiting -= 1
        with self._lock:
            self.num_running += 1
        try:
            yield worker
        finally:
            with self._lock:
                self.num_running -= 1
            if worker.proc is None and not self._closed:
                # killed: a fresh one starts now (seconds), not when the next compile needs it;
                # compiles wait for it as for any busy worker
                threading.Thread(target=self._respawn, args=(worker,), name="grammar-worker-spawn",
                                 daemon=True).start()
            else:
                self._free.put(worker)

    def _respawn(self, worker: _Worker) -> None:
        try:
            if not self._closed:
                worker.spawn(None)
        except Exception:  # noqa: BLE001 - the next probe tries again, and raises what it finds
            if not self._closed:
                logger.warning("a grammar compile worker failed to start; the next compile retries", exc_info=True)
            worker.kill()
        finally:
            self._free.put(worker)

    def check(self, worker: _Worker, key: tuple[str, str, bool], cancel: threading.Event | None) -> None:
        """Whether ``key`` compiles within the limits, in ``worker`` (from ``slot``).

        ConstraintError: xgrammar refused it; GrammarLimitError: past the
        time or memory limit; CompileCancelled: ``cancel`` was set.
        """
        limits = self.limits
        where = f"structured_outputs.{key[0]}"
        try:
            reply = worker.probe(key, limits.compile_timeout_s, cancel)
        except CompileCancelled:
            self._count_stop()
            raise
        if reply[0] == "ok":
            return
        if reply[0] == "error":
            raise ConstraintError(reply[1])
        self._count_stop()
        if reply[0] == "timeout":
            raise GrammarLimitError(
                f"{where} did not compile within the limit of {limits.compile_timeout_s} s "
                "(server flag --grammar-compile-timeout-s, GrammarLimits.compile_timeout_s)"
            )
        raise GrammarLimitError(
            f"{where} needs more memory to compile than the limit of {limits.compile_memory_bytes} bytes "
            "(server flag --grammar-compile-memory-bytes, GrammarLimits.compile_memory_bytes)"
        )

    def _count_stop(self) -> None:
        with self._lock:
            self.num_stopped += 1

    @property
    def num_idle(self) -> int:
        """Workers free for a compile now (started or not yet needed); a respawning one is not."""
        return self._free.qsize()

    def worker_pids(self) -> list[int]:
        """The live workers' process ids."""
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.poll() is None]

    def close(self) -> None:
        """Kill every worker (idle ones; a running one is killed by its compile's end)."""
        self._closed = True
        for w in self._workers:
            w.kill()


def _exit_with_parent() -> None:
    """Exit once the parent is gone (checked each second; PR_SET_PDEATHSIG would fire when the *thread*
    that spawned this process ends, and a respawn runs on a short-lived thread)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _limit_cpu(seconds: float) -> None:
    """SIGXCPU (which ends the process) once this process has used ``seconds`` more CPU time: a compile
    the parent stopped waiting for, or whose parent died, ends on its own."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _vm_size_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _serve(conn: Connection, memory_bytes: int, timeout_s: float) -> None:
    """The worker's loop: the tokenizer info first, then one key per compile, until the pipe closes."""
    info_json = conn.recv()  # before the slow import: the parent's send waits for it
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_key(compiler, ("json", '{"type": "object"}', False))  # allocate what every compile needs once
    limit = _vm_size_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready",))
    while True:
        try:
            key = conn.recv()
        except (EOFError, OSError):
            return
        _limit_cpu(2 * timeout_s + 5)  # the parent kills it at timeout_s; this is the backstop
        try:
            compiled = compile_key(compiler, tuple(key))
            reply: tuple = ("ok", int(compiled.memory_size_bytes))
            del compiled
        except MemoryError:
            reply = ("memory",)
        except (RuntimeError, TypeError, ValueError) as e:  # xgrammar's parse and conversion errors
            message = xgrammar_message(e)
            reply = ("memory",) if "bad_alloc" in message else ("error", message)
        conn.send(reply)


def main(argv: list[str]) -> int:
    """``python -m pagedllm.structured_output.compile_workers FD MEMORY_BYTES TIMEOUT_S``: serve compiles on the pipe end FD."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C on the server is the server's to handle
    _exit_with_parent()
    conn = Connection(int(argv[0]))
    _serve(conn, int(argv[1]), float(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
