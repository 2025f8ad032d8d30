"""A vLLM offline script runs on pagedllm with only its import changed (docs/coming-from-vllm.md).

The script below is written as vLLM's documentation writes one: ``dtype="auto"``,
``trust_remote_code=True``, ``gpu_memory_utilization``, ``seed``, ``LLM.chat``
with ``chat_template_kwargs`` and list-of-parts content. Expected values come
from the same engine given the plain form (a string content, the template's
text rendered by hand), or from the machine's numbers, never from the call
under test.
"""

from __future__ import annotations

import os
import runpy

import pytest

from pagedllm import SamplingParams
from pagedllm.engine import vllm_args

SCRIPT = '''
from pagedllm import LLM, SamplingParams

llm = LLM(model=MODEL, dtype="auto", trust_remote_code=True, gpu_memory_utilization=UTILIZATION, seed=0,
          max_model_len=512)
params = SamplingParams(temperature=0, max_tokens=6)
messages = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                          {"type": "text", "text": "One word."}]}]
outputs = llm.chat(messages, params, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
text = outputs[0].outputs[0].text
'''
# a greeting only the template's variable can put into the prompt
KWARG_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                  "{% if greeting is defined %}{{ greeting }}{% endif %}")
# a budget small enough to be cheap: the weights plus this much, at the share given
POOL_BYTES = 32 << 20
UTILIZATION = 0.5


@pytest.fixture(scope="module")
def fake_free(smollm_path: str) -> int:
    """The free memory the tests pretend the machine has: what makes a pool of ``POOL_BYTES`` at ``UTILIZATION``."""
    return int((os.path.getsize(smollm_path) + POOL_BYTES) / UTILIZATION)


@pytest.fixture(scope="module")
def script(smollm_path: str, fake_free: int, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The vLLM-style script, run once (its globals: ``llm``, ``outputs``, ``text``)."""
    path = tmp_path_factory.mktemp("vllm-script") / "offline.py"
    path.write_text(SCRIPT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("pagedllm.device_memory.available_memory_bytes", lambda device: fake_free)
        return runpy.run_path(str(path), init_globals={"MODEL": smollm_path, "UTILIZATION": UTILIZATION})


def test_script_runs_and_means_what_vllm_means(script: dict, smollm_path: str) -> None:
    llm = script["llm"]
    config = llm.llm_engine.config
    assert config.dtype == vllm_args.AUTO_DTYPE == "float32"
    assert config.seed == 0
    # the engine's share of the free memory, less the weights, is the KV pool's budget
    assert config.kv_cache_memory_bytes == POOL_BYTES
    assert script["text"]  # it generated
    # list-of-parts content is its text parts joined by newlines: the same as that string given whole
    joined = [{"role": "user", "content": "Name a colour.\nOne word."}]
    plain = llm.chat(joined, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert plain[0].prompt == script["outputs"][0].prompt
    assert plain[0].outputs[0].token_ids == script["outputs"][0].outputs[0].token_ids


def test_chat_template_kwargs_reach_the_template(script: dict) -> None:
    llm = script["llm"]
    msgs = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    out = llm.chat(msgs, params, chat_template=KWARG_TEMPLATE, chat_template_kwargs={"greeting": "HELLO-THERE"},
                   use_tqdm=False)
    assert out[0].prompt == "user: hi\nHELLO-THERE"
    without = llm.chat(msgs, params, chat_template=KWARG_TEMPLATE, use_tqdm=False)
    assert without[0].prompt == "user: hi\n"
    with pytest.raises(ValueError, match="may not set messages"):
        llm.chat(msgs, params, chat_template_kwargs={"messages": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="must be a dict"):
        llm.chat(msgs, params, chat_template_kwargs=["enable_thinking"], use_tqdm=False)


def test_image_part_is_refused_saying_why(script: dict) -> None:
    llm = script["llm"]
    engine = llm.llm_engine
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\].*takes no images"):
        llm.chat(image, SamplingParams(max_tokens=1), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_vllm_args_refused_where_they_mean_nothing(smollm_path: str, fake_free: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pagedllm.device_memory.available_memory_bytes", lambda device: fake_free)
    for bad in (0, 1.5, -0.1, "0.9", True):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be"):
            vllm_args.translate_vllm_args(smollm_path, {"gpu_memory_utilization": bad})
    # a share the weights alone exceed: the sentence says what to do
    with pytest.raises(ValueError, match="weights alone take.*kv_cache_memory_bytes"):
        vllm_args.translate_vllm_args(smollm_path, {"gpu_memory_utilization": 0.01})
    with pytest.raises(ValueError, match="trust_remote_code must be"):
        vllm_args.translate_vllm_args(smollm_path, {"trust_remote_code": "yes"})
    # a pool size given outright wins, as vLLM's kv_cache_memory_bytes does
    given = vllm_args.translate_vllm_args(smollm_path, {"gpu_memory_utilization": 0.9, "num_kv_blocks": 8})
    assert given == {"num_kv_blocks": 8}
    assert vllm_args.translate_vllm_args(smollm_path, {"dtype": "bfloat16"}) == {"dtype": "bfloat16"}
