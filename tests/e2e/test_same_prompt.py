"""``benchmarks/same_prompt.py`` run for real: a server with ``--batch-invariant``, a few needles under load.

With the mode on every answer to the needle must be the same, text and logprobs bitwise
(docs/batch-invariance.md); the script must also stop its server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a real server

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "same_prompt.py"


def test_same_prompt_with_the_mode_on_gives_one_answer(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    args = ["--modes", "on", "--num-requests", "8", "--concurrency", "4", "--background", "2",
            # a needle of 12 lines of GPL-3 (still prefilled beside the background's steps), 8 tokens each
            "--needle-lines", "12", "--max-tokens", "8", "--warmup", "1", "--json", "--log-dir", str(tmp_path),
            "--server-args", "--num-threads 1 --max-model-len 4096 --num-kv-blocks 512"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith("{")]
    assert line["batch_invariant"] is True
    assert (line["needles"], line["errors"]) == (8, 0)
    assert line["distinct_completions"] == 1 and line["most_common_count"] == 8
    assert line["distinct_logprob_vectors"] == 1 and line["first_divergence_token"] is None
    log = (tmp_path / "same_prompt_on.log").read_text()
    assert "Finished server process" in log and "Traceback" not in log, log[-2000:]  # a clean shutdown
