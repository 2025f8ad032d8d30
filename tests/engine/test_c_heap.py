"""The C heap under the steps' activations: a freed large tensor is reused without page faults once the runner
has set glibc up (``pagedllm/c_heap.py``), from a thread too after ``share_one_arena``, and ``trim_heap`` gives
the memory back.

Each case runs in a process of its own: the settings are process-wide and glibc fixes its arenas when a
second thread first allocates. The figures are the OS's own (minor faults from ``getrusage``, ``VmRSS``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Runs sixteen "layers" as a prompt step's MLP allocates (a gate/up product, its activation, the output; each
# filled, then freed as the next is made), in the main thread or a new one, with or without the settings;
# prints the minor faults of the last four layers and the resident set before and after trim_heap.
_CHILD = r"""
import json, resource, sys, threading
from pagedllm import c_heap
mode, where = sys.argv[1], sys.argv[2]
if mode == "set":
    c_heap.share_one_arena()
import torch
if mode == "engine":  # the settings as the model runner makes them, once the model and the pool are in place
    from pagedllm import LLM
    LLM(sys.argv[3], max_model_len=64, num_threads=1)
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
out = {}
def run():
    if mode == "set":
        out["took"] = c_heap.keep_freed_heap()
    x = torch.ones(2048, 1024)  # [tokens, hidden] 8 MiB
    for layer in range(16):
        if layer == 12:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        gate_up = torch.empty(2048, 8192).fill_(1.0)  # [tokens, 2 intermediate] 64 MiB
        act = gate_up[:, :4096] * gate_up[:, 4096:]  # [tokens, intermediate] 32 MiB
        del gate_up
        x = x + act[:, :1024]
        del act
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    out["kept"] = rss()
    c_heap.trim_heap()
    out["trimmed"] = rss()
if where == "thread":
    t = threading.Thread(target=run); t.start(); t.join()
else:
    run()
print(json.dumps(out))
"""

PAGES = 4 * 96 * 2**20 // 4096  # the last four layers' 4 KiB pages of activations, each a fault if mapped anew


def _run(mode: str, where: str, *extra: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, where, *extra], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        raise AssertionError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc: Linux only")
@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_freed_activation_is_reused_without_faults_and_trimmed_when_idle(where: str) -> None:
    default, kept = _run("default", where), _run("set", where)
    # glibc's default maps the 64 MiB product anew in every layer: its pages fault again
    assert default["faults"] > PAGES // 2
    assert kept["took"] is True
    assert kept["faults"] < PAGES // 50  # the freed blocks served again from the heap, already resident
    # kept resident until trimmed, then handed back
    assert kept["kept"] - kept["trimmed"] > 64 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc: Linux only")
def test_the_model_runner_keeps_freed_activations(smollm_path: str) -> None:
    # an engine built in the process sets the heap up itself: the same layers then fault almost nothing
    kept = _run("engine", "main", smollm_path)
    assert kept["faults"] < PAGES // 50
    assert kept["kept"] - kept["trimmed"] > 64 * 2**20
