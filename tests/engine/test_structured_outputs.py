"""Structured outputs offline: JSON schemas, regexes, choices, grammars on the bundled model.

Outputs are checked by independent validators (``jsonschema``, ``re.fullmatch``,
``json.loads``), never by xgrammar itself. Sampled runs are seeded, at
temperature 1.0, and use ``disable_any_whitespace``: with vLLM's default (any
whitespace between JSON tokens) a 135M model at temperature 1.0 sometimes
spends its whole budget on newlines, which is the constraint working, not
finishing. Schemas are small (maxLength, maxItems, enums, bounds) so every
output finishes, and the tests assert that they did.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.engine.sequence import Sequence
from pagedllm.runner.logits_processors import apply_token_bitmasks
from pagedllm.structured_output.compiler import choice_grammar
from pagedllm.structured_output.grammar_state import RequestGrammar

NUM_SEEDS = 20
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                },
                "required": ["name", "id"],
            }
        },
        "required": ["user"],
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
    "enum_and_bounded_number": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["color", "score"],
    },
}
REGEXES = [r"[a-z]{3}-[0-9]{2,4}", r"(yes|no), [A-Z][a-z]{1,6}\.", r"\d{1,3}(\.\d{1,2})? (kg|lb)"]
PERSON = SCHEMAS["nested"]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def prompt(llm) -> str:
    messages = [{"role": "user", "content": "Reply with a short JSON answer."}]
    return llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture(autouse=True)
def pool_is_whole_after_each_test(llm):
    yield
    engine = llm.llm_engine
    assert not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _json(schema: dict, **kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, **kw)


def _seeded(constraint: StructuredOutputsParams, max_tokens: int, n: int = NUM_SEEDS) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=constraint) for i in range(n)]


# --- sampled outputs follow their constraint --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_json_follows_its_schema(llm, prompt, name):
    schema = SCHEMAS[name]
    outs = llm.generate([prompt] * NUM_SEEDS, _seeded(_json(schema), 96), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert len({o.outputs[0].text for o in outs}) > 1  # the seeds sample, the mask does not decide alone


@pytest.mark.parametrize("regex", REGEXES)
def test_sampled_text_matches_its_regex(llm, prompt, regex):
    outs = llm.generate([prompt] * NUM_SEEDS, _seeded(StructuredOutputsParams(regex=regex), 32), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert re.fullmatch(regex, c.text), c.text


def test_choice_returns_one_of_the_choices(llm, prompt):
    choices = ['say "hi"', "back\\slash", "café", "no"]
    params = _seeded(StructuredOutputsParams(choice=choices), 16, n=10)
    params.append(SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices)))
    for out in llm.generate([prompt] * len(params), params, use_tqdm=False):
        assert out.outputs[0].text in choices
        assert out.outputs[0].finish_reason == "stop"


def test_grammar_and_json_object(llm, prompt):
    grammar = 'root ::= "ID-" [0-9] [0-9]? " " ("ok" | "fail")'
    outs = llm.generate([prompt] * 5, _seeded(StructuredOutputsParams(grammar=grammar), 16, n=5), use_tqdm=False)
    for out in outs:
        assert re.fullmatch(r"ID-[0-9]{1,2} (ok|fail)", out.outputs[0].text)
    obj = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=128, structured_outputs=obj), use_tqdm=False)[0]
    c = out.outputs[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert c.finish_reason == "length" and c.text.startswith("{")


def test_greedy_follows_the_constraint_and_differs_from_unconstrained(llm, prompt):
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    regex = r"[0-9]{4}"
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex))
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(regex, out.text) and out.finish_reason == "stop"
    assert out.text != free.text


# --- how outputs end ---------------------------------------------------------------------------


def test_max_tokens_before_the_grammar_completes_is_length(llm, prompt):
    params = SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="a{40}"))
    c = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert set(c.text) == {"a"}


def test_a_terminated_grammar_stops_even_with_ignore_eos(llm, prompt):
    so = StructuredOutputsParams(choice=["alpha", "beta"])
    c = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, structured_outputs=so),
                     use_tqdm=False)[0].outputs[0]
    assert c.text in ("alpha", "beta")
    assert c.finish_reason == "stop" and len(c.token_ids) < 30


def test_stop_strings_still_cut_a_constrained_output(llm, prompt):
    so = _json(PERSON)
    c = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, stop=",", structured_outputs=so),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == ","
    assert c.text.startswith('{"user"') and "," not in c.text


# --- with the logits processors ------------------------------------------------------------------


def test_logit_bias_chooses_among_what_the_grammar_allows(llm, prompt):
    tok = llm.get_tokenizer()
    so = StructuredOutputsParams(choice=["red", "green", "blue"])
    for word in ("green", "blue"):
        first = tok.encode(word, add_special_tokens=False)[0]
        params = SamplingParams(temperature=0, max_tokens=8, logit_bias={first: 100.0}, structured_outputs=so)
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text == word
    # a bias toward a token the grammar forbids cannot bring it back
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={tok.encode("{", add_special_tokens=False)[0]: 100.0},
                            structured_outputs=so)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text in ("red", "green", "blue")


def test_constraint_and_allowed_ids_that_exclude_each_other_are_refused_up_front(llm, prompt):
    tok = llm.get_tokenizer()
    letters = tok.encode(" hello world", add_special_tokens=False)
    bad = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=letters,
                         structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(ValueError, match="leave no token that can start the structured output"):
        llm.generate(prompt, bad, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_constraint_that_dead_ends_on_the_allowed_ids_ends_that_sequence_only(llm, prompt):
    tok = llm.get_tokenizer()
    (one,) = tok.encode("1", add_special_tokens=False)
    # "1" three times, then the grammar wants EOS, which the allowed ids leave out: nothing to sample
    dead_end = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[one],
                              structured_outputs=StructuredOutputsParams(regex="1{3}"))
    good = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    ended, ok = llm.generate([prompt, prompt], [dead_end, good], use_tqdm=False)
    assert ended.outputs[0].text == "111" and ended.outputs[0].finish_reason == "no_valid_token"
    assert ok.error is None and re.fullmatch("[0-9]+", ok.outputs[0].text)
    assert not llm.llm_engine.has_unfinished_requests()


# --- forks and preemption ------------------------------------------------------------------------


def test_n4_forks_share_the_prompt_blocks_and_each_follows_the_schema(llm, prompt):
    engine = llm.llm_engine
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=64, structured_outputs=_json(PERSON))
    engine.add_request("forks", prompt, params)
    engine.step()  # the prefill: the four samples fork from it
    seqs = engine.requests["forks"].seqs
    full = seqs[0].num_prompt_tokens // engine.config.block_size
    assert full >= 1
    shared = seqs[0].block_table[:full]
    assert all(s.block_table[:full] == shared for s in seqs)
    assert all(engine.block_manager.ref_counts[b] == 4 for b in shared)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final is not None and final.finished and len(final.outputs) == 4
    for c in final.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PERSON)
    assert len({c.text for c in final.outputs}) > 1  # each fork has its own matcher and its own samples


def test_best_of_returns_its_best_valid_outputs(llm, prompt):
    params = SamplingParams(n=2, best_of=3, temperature=1.0, seed=11, max_tokens=64, structured_outputs=_json(PERSON))
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PERSON)


@pytest.mark.slow
def test_preemption_keeps_every_output_valid_and_unchanged(llm, prompt):
    schema = SCHEMAS["enum_and_bounded_number"]
    params = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=64, structured_outputs=_json(schema))
              for i in range(6)]
    # 12 sequences of ~30 prompt + ~20 output tokens need ~48 blocks of 16 at once; give them 14. By
    # default a recomputed prefix is summed in another order than its decode steps were, and on 8-bit
    # activations a last-bit difference can move a rounding step, and so a sample (seen on AVX2 kernels);
    # batch_invariant computes it in one order (docs/batch-invariance.md), on the default activations
    small = LLM(num_kv_blocks=14, max_model_len=224, batch_invariant=True)
    # the roomy run: the module's engine (256 blocks), where the mode is on by default ("auto")
    roomy = llm
    assert roomy.llm_engine.resolved_config.batch_invariant is True
    roomy_preemptions = roomy.llm_engine.scheduler.num_preemptions
    got = small.generate([prompt] * len(params), params, use_tqdm=False)
    want = roomy.generate([prompt] * len(params), params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert roomy.llm_engine.scheduler.num_preemptions == roomy_preemptions
    for g, w in zip(got, want):
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
        for c in g.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), schema)
    assert small.llm_engine.block_manager.num_free_blocks == 14


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one"),
        (dict(json={"type": "object"}, regex="a"), "exactly one"),
        (dict(json_object=False), "exactly one"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json=[1, 2]), "JSON schema object"),
        (dict(regex=""), "non-empty string"),
        (dict(choice=[]), "non-empty list"),
        (dict(choice=["a", 3]), "non-empty list"),
        (dict(grammar=5), "non-empty string"),
        (dict(regex="a", disable_any_whitespace="yes"), "must be a bool"),
    ],
)
def test_malformed_constraints_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    "constraint, message",
    [
        (StructuredOutputsParams(json={"type": "foo"}), r"structured_outputs\.json .*Unsupported type"),
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), r"structured_outputs\.json"),
        (StructuredOutputsParams(regex="(ab"), r"structured_outputs\.regex is not a valid regular expression"),
        (StructuredOutputsParams(regex="[z-a]"), r"structured_outputs\.regex"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), r"structured_outputs\.grammar .*not defined"),
        (StructuredOutputsParams(grammar='start ::= "a"'), r"structured_outputs\.grammar .*root"),
    ],
)
def test_constraints_that_do_not_compile_fail_when_added(llm, prompt, constraint, message):
    engine = llm.llm_engine
    good = SamplingParams(max_tokens=4)
    bad = SamplingParams(max_tokens=4, structured_outputs=constraint)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt, prompt], [good, bad], use_tqdm=False)  # checked before anything is queued
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, bad)
    assert "bad" not in engine.requests


def test_sampling_params_refuses_a_constraint_of_the_wrong_type():
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_each_distinct_constraint_compiles_once(llm):
    compiler = llm.llm_engine.grammar_compiler
    before = compiler.num_compiled
    a = compiler.compile(StructuredOutputsParams(regex="x[0-9]{7}"))
    b = compiler.compile(StructuredOutputsParams(regex="x[0-9]{7}"))
    assert a is b and compiler.num_compiled == before + 1
    compiler.compile(StructuredOutputsParams(regex="x[0-9]{7}", disable_any_whitespace=True))
    # property order is part of a schema (the output's key order): a different constraint
    compiler.compile(_json({"type": "object", "properties": {"q": {"type": "integer"}, "p": {"type": "integer"}}}))
    compiler.compile(_json({"type": "object", "properties": {"p": {"type": "integer"}, "q": {"type": "integer"}}}))
    assert compiler.num_compiled == before + 4


# --- the pieces -------------------------------------------------------------------------------------


def test_apply_token_bitmasks_touches_only_the_masked_rows_and_tokens():
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(3, vocab)
    original = logits.clone()
    allowed = [0, 5, 31, 32, 69]
    words = np.zeros(3, dtype=np.uint32)  # ceil(70 / 32) words
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    apply_token_bitmasks(logits, [b"", words.view(np.int32).tobytes(), b""])
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite == allowed
    assert torch.equal(logits[1, allowed], original[1, allowed])


def test_request_grammar_follows_forks_and_rollbacks(llm):
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    compiled = engine.grammar_compiler.compile(StructuredOutputsParams(regex=r"x[0-9]+\.[0-9]+"))
    grammar = RequestGrammar(compiled, engine.model_config.vocab_size)
    seq = Sequence([1, 2, 3], block_size=16)
    fresh = grammar.bitmask(seq)
    for t in tok.encode("x12.", add_special_tokens=False):
        assert grammar.accept(seq, t) is False
        seq.append_token(t)
    after_dot = grammar.bitmask(seq)
    assert after_dot != fresh
    fork = seq.fork(1)  # a new sequence id: its matcher is replayed from its tokens
    assert grammar.bitmask(fork) == after_dot
    seq.token_ids = seq.token_ids[:3]  # fewer tokens than accepted: rolled back
    assert grammar.bitmask(seq) == fresh


def test_choice_grammar_keeps_special_characters_literal():
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def test_step_record_carries_masks_as_plain_bytes(llm, prompt):
    from pagedllm.engine.step_builder import build_step_record

    engine = llm.llm_engine
    engine.add_request("record", prompt, SamplingParams(max_tokens=2, structured_outputs=_json(PERSON)))
    try:
        output = engine.scheduler.schedule()
        reqs = [engine.requests[s.seq.request_id] for s in output.scheduled]
        record = build_step_record(output, [r.params for r in reqs], [None], [None], engine._bitmasks(output, reqs))
        (step,) = record.sequences
        assert len(step.token_bitmasks) == 1 and isinstance(step.token_bitmasks[0], bytes)
        words = np.frombuffer(step.token_bitmasks[0], dtype=np.int32)
        assert words.shape == (-(-engine.model_config.vocab_size // 32),)
        brace = llm.get_tokenizer().encode("{", add_special_tokens=False)[0]
        assert (int(words[brace // 32]) >> (brace % 32)) & 1  # a schema's object opens with "{"
    finally:
        engine.block_manager.unpublish_unconfirmed()
        engine.abort_request("record")
