"""``benchmarks/spec_workloads.py``: the speculative-decoding benchmark conversations build and fit the bundled model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import spec_workloads  # noqa: E402


def test_every_workload_builds_with_conversations_ending_in_a_user_turn():
    built = spec_workloads.workloads()
    assert list(built) == list(spec_workloads.WORKLOADS)
    for name, conversations in built.items():
        assert 2 <= len(conversations) <= 5, name
        for conversation in conversations:
            assert conversation[-1]["role"] == "user", name
            assert all(m["content"].strip() for m in conversation), name
    for conversation in built["multi-turn-code"]:  # the code to revisit sits in an earlier assistant turn
        assert [m["role"] for m in conversation] == ["user", "assistant", "user", "assistant", "user"]
        assert conversation[1]["content"].startswith("```python\ndef ")


def test_workloads_picks_some_and_refuses_unknown_names():
    assert list(spec_workloads.workloads(["open-chat", "doc-qa"])) == ["doc-qa", "open-chat"]
    assert spec_workloads.workload_names("doc-qa, multi-turn-code") == ["doc-qa", "multi-turn-code"]
    with pytest.raises(argparse.ArgumentTypeError):
        spec_workloads.workload_names("doc-qa,nope")
    with pytest.raises(ValueError):
        spec_workloads.workloads(["nope"])


def test_prompts_stay_under_1500_tokens_of_the_bundled_model():
    from pagedllm.loader import bundled_model_path
    from pagedllm.loader.tokenizer import Tokenizer

    tok = Tokenizer(bundled_model_path(), [])
    for name, conversations in spec_workloads.workloads().items():
        for conversation in conversations:
            prompt = tok.apply_chat_template(conversation, add_generation_prompt=True)
            assert len(tok.encode(prompt, add_special_tokens=False)) < 1500, name
