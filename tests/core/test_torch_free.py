"""The bookkeeping layer must stay importable and usable without torch."""

from __future__ import annotations

import subprocess
import sys


def test_engine_bookkeeping_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import pagedllm.engine.sequence, pagedllm.block_table\n"
        "import pagedllm.engine.block_manager, pagedllm.engine.scheduler, pagedllm.engine.kv_snapshot\n"
        "import pagedllm.engine.step_builder, pagedllm.runner.sequence_states\n"
        "import pagedllm.spec_decode.speculator, pagedllm.spec_decode.config\n"
        "from pagedllm import SamplingParams\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
