"""Speculative decoding (ngram, suffix, draft_model) end to end on the bundled model: lossless greedy,
reproducible seeds, the request's spec_decode_* metrics.

The prompts (``tests/spec_prompts.py``) ask the model to repeat a Python
function it is given, or to answer a question about a document by quoting it,
so prompt lookup finds drafts and many are accepted; every test asserts that
drafts were proposed and accepted, so none can pass with speculation idle.
Suffix decoding also runs a request twice, so that its global tree (earlier
outputs) drafts the second one. draft_model runs the bundled model as its own
draft (slow: two engines).
"""

from __future__ import annotations

import pytest
from spec_prompts import CODE, DOCUMENT_QA, REPEAT

from pagedllm import LLM, SamplingParams
from pagedllm.loader import bundled_model_path

# cost_model off: every proposal is verified, so the tests exercise drafts whatever this machine's timings
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
         "cost_model": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "cost_model": False}
# the bundled model drafts for itself: same tokenizer, nearly every draft accepted
DRAFT = {"method": "draft_model", "model": bundled_model_path(), "num_speculative_tokens": 3, "cost_model": False}
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def plain():
    return LLM(num_kv_blocks=512, max_model_len=1024, block_size=4)


@pytest.fixture(scope="module")
def spec():
    # small blocks: drafts cross block boundaries and get blocks of their own often
    return LLM(num_kv_blocks=512, max_model_len=1024, block_size=4, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def suffix():
    return LLM(num_kv_blocks=512, max_model_len=1024, block_size=4, speculative_config=SUFFIX)


@pytest.fixture(scope="module")
def draft():
    return LLM(num_kv_blocks=512, max_model_len=1024, block_size=4, speculative_config=DRAFT)


def assert_pools_whole(llm: LLM) -> None:
    """No request left and every block free, in the target's pool and (with a draft model) the draft's."""
    engine = llm.llm_engine
    for e in [engine] + ([engine.draft_proposer.engine] if engine.draft_proposer is not None else []):
        assert not e.requests
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


@pytest.fixture(autouse=True)
def pool_is_whole_after_each_test(request):
    yield
    for name in ("spec", "suffix", "draft"):
        if name in request.fixturenames:
            assert_pools_whole(request.getfixturevalue(name))


def chat(llm, params, messages=REPEAT):
    return llm.chat(messages, params, use_tqdm=False)[0]


def assert_lossless_and_accepted(out, want) -> None:  # noqa: ANN001
    """``out`` (a speculating run) has plain decoding's tokens, text and finish reason, and drafts were
    proposed and accepted."""
    got = out.outputs[0]
    assert got.token_ids == want.token_ids
    assert got.text == want.text and got.finish_reason == want.finish_reason
    proposed, accepted = out.metrics["spec_decode_num_draft_tokens"], out.metrics["spec_decode_num_accepted_tokens"]
    assert proposed > 0 and accepted > 0, "no draft was proposed and accepted: the test would pass vacuously"
    assert accepted <= proposed


def test_greedy_with_ngram_equals_plain_decoding(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = chat(plain, params).outputs[0]
    out = chat(spec, params)
    assert_lossless_and_accepted(out, want)
    assert spec.llm_engine.speculator.num_accepted_tokens >= out.metrics["spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def plain_document_qa(plain):
    """Plain greedy decoding's answer to the document-QA prompt (computed once for every method)."""
    return chat(plain, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), DOCUMENT_QA).outputs[0]


@pytest.mark.parametrize("method", ["spec", "suffix", pytest.param("draft", marks=pytest.mark.slow)])
def test_greedy_document_qa_with_each_method_equals_plain_decoding(plain_document_qa, request, method):
    """A question about real text (the heapq module's docstring) whose answer quotes it: ngram, suffix and the
    bundled model as its own draft all draft from the document, and greedy output is plain decoding's."""
    llm = request.getfixturevalue(method)
    out = chat(llm, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), DOCUMENT_QA)
    assert_lossless_and_accepted(out, plain_document_qa)
    assert_pools_whole(llm)


@pytest.mark.slow
def test_greedy_with_the_bundled_model_as_its_own_draft_equals_plain_decoding(plain, draft):
    """draft_model with the bundled model as target and draft (one tokenizer): the code-repeat output is plain
    decoding's, and the same weights' greedy drafts are nearly all accepted."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = chat(plain, params).outputs[0]
    out = chat(draft, params)
    assert_lossless_and_accepted(out, want)
    assert out.metrics["spec_decode_num_accepted_tokens"] >= 0.9 * out.metrics["spec_decode_num_draft_tokens"]


def drafts(out) -> tuple[int, int]:
    return out.metrics.get("spec_decode_num_draft_tokens", 0), out.metrics.get("spec_decode_num_accepted_tokens", 0)


@pytest.mark.slow
def test_greedy_with_suffix_equals_plain_decoding(plain, suffix):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = chat(plain, params).outputs[0]
    assert_lossless_and_accepted(chat(suffix, params), want)


@pytest.mark.slow
def test_suffix_drafts_a_repeated_request_from_its_earlier_output(plain, suffix):
    """The same free-text request twice: the first output joins the global tree, which drafts the second
    (nothing in the prompt to copy); both are plain decoding's tokens."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want = chat(plain, params, STORY).outputs[0].token_ids
    proposer = suffix.llm_engine.speculator.proposer
    cached = proposer.num_cached_requests
    first = chat(suffix, params, STORY)
    assert proposer.num_cached_requests == cached + 1  # finish() gave the global tree its output
    second = chat(suffix, params, STORY)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == want
    (_, accepted_first), (proposed, accepted) = drafts(first), drafts(second)
    assert accepted > accepted_first and accepted >= len(want) // 2, (accepted_first, proposed, accepted)


def test_greedy_batch_with_ngram_equals_plain(plain, spec):
    """Two requests in one batch, one of them with logprobs: each equals its plain run, logprobs included."""
    params = [SamplingParams(temperature=0, max_tokens=24, logprobs=2), SamplingParams(temperature=0, max_tokens=30)]
    prompts = [CODE + "\n" + CODE[:40], "1, 2, 3, 4, 5, 6, 1, 2, 3,"]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert [list(p) for p in got[0].outputs[0].logprobs] == [list(p) for p in want[0].outputs[0].logprobs]
    # close, not bitwise: a verify step runs its tokens through the prefill kernels, a plain decode
    # through the decode kernels (docs/speculative-decoding.md)
    for w_pos, g_pos in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        for t in w_pos:
            assert g_pos[t].logprob == pytest.approx(w_pos[t].logprob, abs=0.1)
    assert sum(g.metrics["spec_decode_num_accepted_tokens"] for g in got) > 0


def test_seeded_sampling_with_ngram_is_reproducible(spec):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS)
    first = chat(spec, params)
    second = chat(spec, params)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert first.metrics["spec_decode_num_accepted_tokens"] > 0
    other = chat(spec, SamplingParams(temperature=0.8, top_p=0.95, seed=99, max_tokens=MAX_TOKENS))
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


@pytest.mark.parametrize(
    "penalties",
    # strong enough to change plain greedy's output on this prompt (frequency/presence 1.0 from token 47,
    # measured), else a verify step that skipped them would pass too
    [dict(frequency_penalty=1.0), dict(presence_penalty=1.0, repetition_penalty=1.05),
     dict(repetition_penalty=1.05, frequency_penalty=0.2, logit_bias={28: -2.0}, bad_words=["Fib"])],
)
def test_greedy_with_logits_processors_and_ngram_equals_plain(plain, spec, penalties):
    """The runner applies the processors at each verify position with the drafts before it counted as output:
    the tokens and the (raw) logprobs are plain decoding's, and drafts were accepted."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2, **penalties)
    want = chat(plain, params).outputs[0]
    out = chat(spec, params)
    got = out.outputs[0]
    assert got.token_ids == want.token_ids
    for w_pos, g_pos in zip(want.logprobs, got.logprobs):
        assert set(g_pos) == set(w_pos)
        for t in w_pos:
            assert g_pos[t].logprob == pytest.approx(w_pos[t].logprob, abs=0.1)
    assert out.metrics["spec_decode_num_accepted_tokens"] > 0, "no draft accepted: the test would pass vacuously"


def test_n_and_best_of_speculate_per_sample(plain, spec):
    """n > 1: each sample drafts on its own; greedy samples are plain decoding's, and best_of picks as plainly."""
    single = chat(spec, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    params = SamplingParams(n=2, best_of=3, temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    want = chat(plain, params)
    got = chat(spec, params)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert all(c.token_ids == single.outputs[0].token_ids for c in got.outputs)
    assert [c.cumulative_logprob for c in got.outputs] == pytest.approx([c.cumulative_logprob for c in want.outputs], abs=0.5)
    # three samples, each drafting: more accepted than the single sequence's
    assert got.metrics["spec_decode_num_accepted_tokens"] > single.metrics["spec_decode_num_accepted_tokens"] > 0


def test_seeded_n_samples_speculate_and_are_reproducible(spec):
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=7, max_tokens=30, frequency_penalty=0.1)
    first, second = chat(spec, params), chat(spec, params)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "the samples should differ"
    assert first.metrics["spec_decode_num_accepted_tokens"] > 0


def test_a_stop_inside_accepted_drafts_ends_the_output_there(plain, spec):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["a, b"])
    want = chat(plain, params).outputs[0]
    got = chat(spec, params).outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)


def test_request_metrics_count_verify_steps_and_acceptance_exactly(spec):
    """A run driven step by step: the request's verify steps, draft and accepted tokens are what the speculator
    was told at each verify (counted here), its accepted tokens what the steps emitted beyond one token each, and
    its rate and mean acceptance length those counts' ratios (vLLM's definitions)."""
    engine = spec.llm_engine
    speculator = engine.speculator
    observed: list[tuple[int, int]] = []

    def counting_observe(seq, num_proposed: int, num_accepted: int) -> None:  # noqa: ANN001
        observed.append((num_proposed, num_accepted))
        type(speculator).observe(speculator, seq, num_proposed, num_accepted)

    speculator.observe = counting_observe
    try:
        engine.add_request("metrics", {"prompt_token_ids": engine.tokenizer.encode(CODE + "\n" + CODE[:40])},
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        emitted, last = [], None
        while engine.has_unfinished_requests():
            (out,) = engine.step()
            emitted.append(len(out.outputs[0].token_ids) - sum(emitted))
            last = out
    finally:
        del speculator.observe
    num_drafts = len(observed)
    num_draft_tokens = sum(p for p, _ in observed)
    num_accepted = sum(a for _, a in observed)
    assert num_drafts > 0 and num_accepted > 0, "no draft accepted: the test would pass vacuously"
    # a step emits one token, or one plus the drafts it accepted: what it emitted beyond one was accepted
    assert num_accepted == sum(n - 1 for n in emitted if n > 1)
    assert sum(emitted) == 40
    assert {k: v for k, v in last.metrics.items() if k.startswith("spec_decode_")} == {
        "spec_decode_num_drafts": num_drafts,
        "spec_decode_num_draft_tokens": num_draft_tokens,
        "spec_decode_num_accepted_tokens": num_accepted,
        "spec_decode_acceptance_rate": num_accepted / num_draft_tokens,
        "spec_decode_mean_acceptance_length": 1 + num_accepted / num_drafts,
    }


def test_request_metrics_figures_from_a_requests_counts():
    """The output processor's figures for a Request whose counts are set by hand: 4 verify steps carrying 10
    drafts, 7 accepted -> rate 0.7, mean acceptance length 1 + 7 / 4 = 2.75; none drafted yet -> None."""
    import random

    from pagedllm.engine.output_processor import OutputProcessor
    from pagedllm.engine.request import Request, spec_decode_rates

    req = Request("r", None, [1, 2, 3], SamplingParams(max_tokens=4), 4, random.Random(0), 0)
    assert "spec_decode_num_drafts" not in OutputProcessor._metrics(req)  # a request that does not speculate
    req.speculates = True
    metrics = OutputProcessor._metrics(req)
    assert (metrics["spec_decode_acceptance_rate"], metrics["spec_decode_mean_acceptance_length"]) == (None, None)
    req.num_drafts, req.num_draft_tokens, req.num_accepted_tokens = 4, 10, 7
    metrics = OutputProcessor._metrics(req)
    assert metrics["spec_decode_num_drafts"] == 4
    assert metrics["spec_decode_acceptance_rate"] == pytest.approx(0.7)
    assert metrics["spec_decode_mean_acceptance_length"] == 2.75
    assert spec_decode_rates(0, 0, 0) == (None, None)
    for bad in ((1, 2, 3), (-1, 0, 0), (1, -2, 0)):
        with pytest.raises(ValueError, match="bad speculative counts"):
            spec_decode_rates(*bad)


def test_bench_latency_summary_uses_the_same_figures():
    """``bench latency --speculative-config``'s summary over the timed runs: the differences of the totals,
    with the rate and mean acceptance length of a request's metrics (rounded to 3 places)."""
    from pagedllm.bench.latency import spec_summary

    assert spec_summary((1, 2, 1), (7, 21, 9)) == {
        "num_drafts": 6, "num_draft_tokens": 19, "num_accepted_tokens": 8,
        "acceptance_rate": 0.421, "mean_acceptance_length": 2.333,
    }
    assert spec_summary((3, 9, 4), (3, 9, 4))["mean_acceptance_length"] is None


def test_server_metrics_carry_the_draft_counts(spec):
    from prometheus_client import generate_latest

    from pagedllm.clients.metrics import ServerMetrics, engine_stats

    engine = spec.llm_engine
    before = engine.speculator.num_drafts, engine.speculator.num_draft_tokens, engine.speculator.num_accepted_tokens
    out = chat(spec, SamplingParams(temperature=0, max_tokens=20))
    stats = engine_stats(engine)
    assert stats.spec_decode_num_accepted_tokens == engine.speculator.num_accepted_tokens > 0
    # the engine's totals grew by the request's own counts (one request ran)
    assert (stats.spec_decode_num_drafts - before[0], stats.spec_decode_num_draft_tokens - before[1],
            stats.spec_decode_num_accepted_tokens - before[2]) == (
        out.metrics["spec_decode_num_drafts"], out.metrics["spec_decode_num_draft_tokens"],
        out.metrics["spec_decode_num_accepted_tokens"])
    metrics = ServerMetrics("m")
    metrics.update_from_engine(engine)
    text = generate_latest(metrics.registry).decode()
    accepted = float(engine.speculator.num_accepted_tokens)
    assert f'pagedllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}' in text
    assert f'pagedllm:spec_decode_num_drafts_total{{model_name="m"}} {float(stats.spec_decode_num_drafts)}' in text
    assert "pagedllm:spec_decode_num_draft_tokens_total" in text


def test_cli_takes_speculative_config_json():
    from pagedllm.engine.llm import make_engine_config
    from pagedllm.entrypoints.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(
        ["generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    kwargs = _engine_kwargs(args)
    cfg = make_engine_config(None, **kwargs)  # what LLM(...) builds from the CLI's arguments
    assert cfg.speculative_config.num_speculative_tokens == 3
    args = build_parser().parse_args(["generate", "hi", "--speculative-config", '{"method": "eagle"}'])
    with pytest.raises(ValueError, match="not implemented yet"):
        make_engine_config(None, **_engine_kwargs(args))


@pytest.mark.slow
def test_batch_invariant_speculation_is_bitwise_plain_decoding():
    """With batch_invariant=True a verify step's tokens go through the decode kernel: tokens and logprobs
    are plain decoding's to the bit (without it they agree to float rounding)."""
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=3)
    runs = []
    for speculative_config in (None, NGRAM):
        llm = LLM(num_kv_blocks=512, max_model_len=1024, block_size=4, batch_invariant=True,
                  speculative_config=speculative_config)
        runs.append(chat(llm, params))
    want, got = (r.outputs[0] for r in runs)
    assert got.token_ids == want.token_ids
    assert [{t: lp.logprob for t, lp in pos.items()} for pos in got.logprobs] == [
        {t: lp.logprob for t, lp in pos.items()} for pos in want.logprobs
    ]
    assert runs[1].metrics["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_preemption_under_a_tight_pool_keeps_speculation_lossless():
    """Four code-repeat requests in a pool too small for them: sequences with drafts are preempted and
    recomputed, and every output is still plain decoding's, bit for bit (batch_invariant=True on both)."""
    prompts = [
        [{"role": "user", "content": f"Repeat this Python function exactly:\n\n{CODE.replace('fibonacci', name)}"}]
        for name in ("fib", "fibo", "f", "fn")
    ]
    params = SamplingParams(temperature=0, max_tokens=50)
    runs = []
    for speculative_config in (None, NGRAM):
        llm = LLM(num_kv_blocks=64, max_model_len=256, block_size=4, batch_invariant=True,
                  speculative_config=speculative_config)
        runs.append([o.outputs[0].token_ids for o in llm.chat(prompts, params, use_tqdm=False)])
        engine = llm.llm_engine
        assert engine.scheduler.num_preemptions > 0, "the pool was not tight enough to preempt"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert runs[1] == runs[0]
    assert engine.speculator.num_accepted_tokens > 0


class CountingCapture:
    """The runner's captured decode, counting the steps it replays that verify drafts (rows that share a table)."""

    def __init__(self, inner):
        self.inner = inner
        self.num_verify_steps = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, input_ids, positions, meta):
        if len({tuple(row) for row in meta.block_tables.tolist()}) < input_ids.shape[0]:
            self.num_verify_steps += 1
        return self.inner(input_ids, positions, meta)


@pytest.mark.slow
def test_captured_verify_steps_are_bitwise_plain_captured_decoding():
    """With decode steps captured from the first, verify steps replay the same graph, each draft a decode row:
    tokens and logprobs are plain (captured) decoding's to the bit."""
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=3)
    runs, captures = [], []
    for speculative_config in (None, NGRAM):
        llm = LLM(num_kv_blocks=512, max_model_len=1024, block_size=4, batch_invariant=True,
                  capture_min_decode_steps=0, speculative_config=speculative_config)
        runner = llm.llm_engine.model_runner
        runner.captured_decode = CountingCapture(runner.captured_decode)
        runs.append(chat(llm, params))
        captures.append(runner.captured_decode)
    want, got = (r.outputs[0] for r in runs)
    assert got.token_ids == want.token_ids
    assert [{t: lp.logprob for t, lp in pos.items()} for pos in got.logprobs] == [
        {t: lp.logprob for t, lp in pos.items()} for pos in want.logprobs
    ]
    assert runs[1].metrics["spec_decode_num_accepted_tokens"] > 0
    assert captures[1].num_verify_steps > 0 and captures[0].num_verify_steps == 0


PERSON = '{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for": "the first program"}'
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "field": {"type": "string"},
                   "known_for": {"type": "string"}},
    "required": ["name", "born", "field", "known_for"],
}


@pytest.mark.slow  # 4-5 s a case: `make test`
@pytest.mark.parametrize("kind", ["json", "regex"])
def test_structured_output_with_ngram_equals_plain(plain, spec, kind):
    """A constrained request speculates: drafts the grammar rejects are cut before verify, each verify row is
    masked as plain decoding's row at that position was; tokens and logprobs equal plain decoding's."""
    from pagedllm.sampling_params import StructuredOutputsParams

    constraint = (StructuredOutputsParams(json=PERSON_SCHEMA) if kind == "json"
                  else StructuredOutputsParams(regex=r'\{"name": "[A-Za-z ]+", "born": [0-9]+, .{0,80}\}'))
    messages = [{"role": "user", "content": "Repeat this JSON exactly:\n" + PERSON + "\n" + PERSON}]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2, structured_outputs=constraint)
    want = chat(plain, params, messages).outputs[0]
    out = chat(spec, params, messages)
    got = out.outputs[0]
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    for w_pos, g_pos in zip(want.logprobs, got.logprobs):
        assert set(g_pos) == set(w_pos)
        for t in w_pos:
            assert g_pos[t].logprob == pytest.approx(w_pos[t].logprob, abs=0.1)
    assert out.metrics["spec_decode_num_accepted_tokens"] > 0, "no draft accepted: the test would pass vacuously"


def test_grammar_cuts_drafts_at_the_first_rejected_token_and_rolls_back(spec):
    """``valid_drafts`` keeps the drafts the grammar allows, up to the first it rejects; the matcher is left
    where it was (rolled back), and ``verify_bitmasks`` gives one mask per kept draft plus one."""
    from types import SimpleNamespace

    from pagedllm.sampling_params import StructuredOutputsParams

    engine = spec.llm_engine
    grammar = engine.compile_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(regex="ab+c")))
    tok = engine.tokenizer
    a, b, c, x = (tok.encode(s, add_special_tokens=False)[0] for s in ("a", "b", "c", "x"))
    seq = SimpleNamespace(seq_id=1, token_ids=[7, a], num_prompt_tokens=1, num_output_tokens=1)
    assert grammar.valid_drafts(seq, [b, b, x, b]) == [b, b]
    assert grammar.valid_drafts(seq, [x]) == []
    assert grammar._accepted[1] == 1  # the walks rolled the matcher back to the output
    seq.token_ids += [b, b]
    seq.num_output_tokens = 3
    masks = grammar.verify_bitmasks(seq, 2)
    assert len(masks) == 3 and all(masks)
    seq.token_ids[-1] = x  # a draft the grammar rejects was never to be verified
    with pytest.raises(ValueError, match="rejects draft 1"):
        grammar.verify_bitmasks(seq, 2)
