"""``benchmarks/widen_gguf.py``: the bundled model padded with zero channels and heads to a 1B shape computes
what the bundled model computes (its speculative-decoding benchmark relies on it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gguf_convert import read_gguf

from pagedllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import widen_gguf  # noqa: E402

PROMPT = ("The heap queue algorithm keeps a list in an order where every parent is no larger than its "
          "children, so the smallest element is always the first one.")


def _greedy_with_prompt_logprobs(model: str) -> tuple[list[int], list[float]]:
    """Eight greedy tokens and the prompt's logprobs, on float activations (no int8 rounding of the rows)."""
    llm = LLM(model=model, gguf_activations="float32", enable_prefix_caching=False, max_model_len=256,
              num_kv_blocks=32)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [next(iter(d.values())).logprob for d in out.prompt_logprobs if d]
    return list(out.outputs[0].token_ids), logprobs


@pytest.mark.slow
def test_the_widened_bundled_model_has_a_1b_shape_and_computes_the_same_function(
    smollm_path: str, tmp_path: Path
) -> None:
    out = tmp_path / "wide.gguf"
    num_params = widen_gguf.widen(Path(smollm_path), out)
    assert 1.05e9 < num_params < 1.2e9
    fields = read_gguf(out).fields
    assert int(fields["llama.embedding_length"].contents()) == widen_gguf.HIDDEN
    assert int(fields["llama.attention.head_count_kv"].contents()) == widen_gguf.NUM_KV_HEADS
    assert fields["tokenizer.chat_template"].contents() == read_gguf(smollm_path).fields["tokenizer.chat_template"].contents()

    want_tokens, want_logprobs = _greedy_with_prompt_logprobs(smollm_path)
    tokens, logprobs = _greedy_with_prompt_logprobs(str(out))
    assert tokens == want_tokens
    assert len(logprobs) == len(want_logprobs) > 20
    # the same function up to float rounding (RMSNorm's rescaled weights, eps acting 2.7x larger, sums of 1536
    # inputs in another lane order): measured 0.028 at most and 0.006 on another prompt; a wrong head or a
    # missed rescaling moves logprobs by whole units
    diffs = [abs(a - b) for a, b in zip(logprobs, want_logprobs)]
    assert max(diffs) < 0.06
    assert sum(diffs) / len(diffs) < 0.01
