"""``echo`` and prompt logprobs on /v1/completions, and lm-evaluation-harness reading them.

The server runs the tiny random-weight Llama (its own tokenizer folder);
the prompt's token logprobs are checked against the offline API's
``prompt_logprobs`` and a teacher-forced transformers pass on the same
weights. lm-eval's own ``local-completions`` client then scores a few
(context, continuation) pairs through the server, with the tokenizer read
from the folder (``huggingface``) and through the server (``remote``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch
from openai import OpenAI
from server_helpers import serve_in_thread, sse_events, wait_kv_free

pytestmark = pytest.mark.slow  # real servers or subprocesses: outside the fast tier

PROMPT_IDS = [5, 17, 923, 48, 7, 301, 2500, 11, 64]
TOL = 1e-4


@pytest.fixture(scope="module")
def echo_server(tiny_model_dirs: dict[str, str]) -> Iterator[dict]:
    from pagedllm import LLM

    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=64, block_size=8, max_model_len=256, num_threads=1)
    with serve_in_thread(llm.llm_engine, model_name="tiny") as url:
        yield {"url": url, "path": tiny_model_dirs["llama"]}


@pytest.fixture(scope="module")
def client(echo_server: dict) -> OpenAI:
    return OpenAI(base_url=f"{echo_server['url']}/v1", api_key="unused", max_retries=0, timeout=120)


def teacher_forced(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """log p(ids[t] | ids[:t]) for t >= 1, from transformers in float64."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_echo_logprobs_equal_offline_prompt_logprobs_and_transformers(client, hf_tiny, tiny_model_dirs) -> None:  # noqa: ANN001
    from pagedllm import LLM, SamplingParams

    out = client.completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    lp = out.choices[0].logprobs
    n = len(PROMPT_IDS)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    served = torch.tensor(lp.token_logprobs[1:n], dtype=torch.float64)

    reference = teacher_forced(hf_tiny["llama"], PROMPT_IDS)
    torch.testing.assert_close(served, reference, atol=TOL, rtol=0)

    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=64, block_size=8, max_model_len=256, num_threads=1)
    (offline,) = llm.generate(
        [{"prompt_token_ids": PROMPT_IDS}], SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    expected = [pos[t].logprob for t, pos in zip(PROMPT_IDS[1:], offline.prompt_logprobs[1:])]
    torch.testing.assert_close(served, torch.tensor(expected, dtype=torch.float64), atol=TOL, rtol=0)
    # the last entry is the generated token, the one a non-echo request returns
    assert lp.tokens[-1] == offline.outputs[0].logprobs[0][offline.outputs[0].token_ids[0]].decoded_token
    # each top_logprobs entry holds the chosen token and the most likely one
    tok = llm.get_tokenizer()
    for t, pos, top in zip(PROMPT_IDS[1:], offline.prompt_logprobs[1:], lp.top_logprobs[1:n]):
        assert tok.decode([t]) in top
        assert max(top.values()) == pytest.approx(max(p.logprob for p in pos.values()), abs=TOL)
    # the text offsets walk the token texts
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 1)]


def test_echo_text_is_prompt_then_completion(client, echo_server) -> None:  # noqa: ANN001
    plain = client.completions.create(model="tiny", prompt="The cat sat", max_tokens=6, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="The cat sat", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "The cat sat" + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    detok = httpx.post(f"{echo_server['url']}/detokenize", json={"tokens": PROMPT_IDS}).json()["prompt"]
    by_ids = client.completions.create(model="tiny", prompt=[PROMPT_IDS, PROMPT_IDS[:4]], max_tokens=3,
                                       temperature=0, echo=True, n=2)
    assert [c.index for c in by_ids.choices] == [0, 1, 2, 3]
    assert by_ids.choices[0].text.startswith(detok) and by_ids.choices[1].text.startswith(detok)
    short = httpx.post(f"{echo_server['url']}/detokenize", json={"tokens": PROMPT_IDS[:4]}).json()["prompt"]
    assert by_ids.choices[2].text.startswith(short)


def test_streamed_echo_reassembles_into_the_whole_answer(client, echo_server) -> None:  # noqa: ANN001
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 2}
    whole = httpx.post(f"{echo_server['url']}/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, tokens, token_logprobs, offsets = "", [], [], []
    with httpx.stream("POST", f"{echo_server['url']}/v1/completions", json={**body, "stream": True}) as r:
        for data in sse_events(r.iter_lines()):
            if data == "[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            text += choice["text"]
            if choice["logprobs"] is not None:
                tokens += choice["logprobs"]["tokens"]
                token_logprobs += choice["logprobs"]["token_logprobs"]
                offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"] and text.startswith("Once upon")
    assert tokens == whole["logprobs"]["tokens"]
    assert offsets == whole["logprobs"]["text_offset"]
    assert token_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(token_logprobs[1:]), torch.tensor(whole["logprobs"]["token_logprobs"][1:]))
    assert wait_kv_free(echo_server["url"]) == 0.0


def test_tokenizer_info_describes_the_tokenizer(echo_server, tiny_model_dirs) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    info = httpx.get(f"{echo_server['url']}/tokenizer_info").json()
    hf = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    assert info["eos_token"] == hf.eos_token and info["bos_token"] == hf.bos_token
    assert info["chat_template"] == hf.chat_template and info["model_max_length"] == 256


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_local_completions_scores_loglikelihoods(echo_server, hf_tiny, backend) -> None:  # noqa: ANN001
    """lm-eval's own client (as ``lm_eval --model local-completions``) against the server."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    tokenizer = {"tokenizer": echo_server["path"]} if backend == "huggingface" else {}
    lm = LocalCompletionsAPI(
        model="tiny", base_url=f"{echo_server['url']}/v1/completions", tokenizer_backend=backend,
        max_length=256, max_retries=1, **tokenizer,
    )
    pairs = [("The capital of France is", " Paris"), ("1 2 3 4", " 5 6"), ("Hello", " world, again")]
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)
    ]
    results = lm.loglikelihood(requests, disable_tqdm=True)

    hf = AutoTokenizer.from_pretrained(echo_server["path"])
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results):
        ctx = hf.encode(context, add_special_tokens=False)
        cont = hf.encode(context + continuation, add_special_tokens=False)[len(ctx):]
        ids = ctx + cont
        reference = teacher_forced(hf_tiny["llama"], ids)[len(ctx) - 1 :]
        assert logprob == pytest.approx(float(reference.sum()), abs=TOL * len(cont))
        with torch.inference_mode():
            logits = hf_tiny["llama"](input_ids=torch.tensor([ids])).logits[0]
        greedy = logits[len(ctx) - 1 : -1].argmax(-1).tolist() == cont
        assert is_greedy == greedy
