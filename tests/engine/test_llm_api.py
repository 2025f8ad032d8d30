"""The offline API (``LLM.generate`` / ``LLM.chat`` / ``LLMEngine``) on the bundled model.

Expected values come from the tokenizer itself or from the engine run on a
simpler case (one prompt alone, greedy), never from the case under test.
Generation lengths are kept small: every decode step costs real model time.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from pagedllm import LLM, CompletionOutput, RequestOutput, SamplingParams
from pagedllm.engine.detokenizer import detokenize_incrementally
from pagedllm.engine.sequence import Sequence

P_FRANCE = "The capital of France is"
P_STORY = "Once upon a time"
P_COUNT = "1, 2, 3, 4,"
GREEDY_LEN = 10
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_model_len=1024)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


@pytest.fixture(autouse=True)
def pool_is_whole_after_each_test(llm):
    yield
    engine = llm.llm_engine
    leftover = list(engine.requests)
    free = engine.block_manager.num_free_blocks
    # clean up first so that one failure does not cascade into later tests
    engine.abort_request(leftover)
    assert leftover == []
    assert free == engine.block_manager.num_blocks


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def greedy(max_tokens=GREEDY_LEN, **kwargs):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def greedy_alone(llm):
    """Greedy output of one prompt run alone, cached per prompt."""
    cache: dict = {}

    def get(prompt) -> CompletionOutput:
        key = prompt if isinstance(prompt, str) else tuple(prompt["prompt_token_ids"])
        if key not in cache:
            (out,) = gen(llm, [prompt], greedy())
            cache[key] = out.outputs[0]
        return cache[key]

    return get


def count_prompt(tok):
    return {"prompt_token_ids": tok.encode(P_COUNT)}


def assert_text_is_decoded_tokens(tok, c: CompletionOutput, skip_special_tokens=True):
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=skip_special_tokens)


def assert_healthy(llm):
    """Nothing queued, no block held, and a normal request still runs."""
    engine = llm.llm_engine
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert len(engine.scheduler.waiting) == 0 and len(engine.scheduler.running) == 0
    assert bm.num_free_blocks == bm.num_blocks
    (out,) = gen(llm, [P_FRANCE], greedy(max_tokens=1))
    assert out.finished and len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"
    assert bm.num_free_blocks == bm.num_blocks


# --- the issue's snippet ----------------------------------------------------------


def test_issue_snippet(llm, tok):
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64)
    outs = llm.generate([P_FRANCE, {"prompt_token_ids": [1, 2, 3]}], params)
    assert len(outs) == 2
    assert all(isinstance(o, RequestOutput) for o in outs)
    assert len({o.request_id for o in outs}) == 2
    assert all(isinstance(o.request_id, str) for o in outs)

    # in prompt order
    assert outs[0].prompt == P_FRANCE
    assert outs[0].prompt_token_ids == tok.encode(P_FRANCE)
    assert outs[1].prompt is None
    assert outs[1].prompt_token_ids == [1, 2, 3]

    eos = tok.eos_token_id
    for o in outs:
        assert o.finished is True
        assert o.num_cached_tokens == 0  # both prompts are shorter than a block
        assert len(o.outputs) == 1
        c = o.outputs[0]
        assert isinstance(c, CompletionOutput)
        assert c.index == 0
        assert all(isinstance(t, int) for t in c.token_ids)
        assert 1 <= len(c.token_ids) <= 64
        assert c.finish_reason in ("length", "stop")
        if c.finish_reason == "length":
            assert len(c.token_ids) == 64
            assert eos not in c.token_ids
        else:
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
            assert c.stop_reason is None
        assert c.finished()
        assert isinstance(c.text, str) and c.text
        assert_text_is_decoded_tokens(tok, c)


# --- ordering and greedy ----------------------------------------------------------


def test_outputs_come_back_in_prompt_order_not_finish_order(llm, tok):
    prompts = [P_STORY, {"prompt_token_ids": tok.encode(P_COUNT)}, P_FRANCE]
    # the first prompt finishes last, the last first
    params = [greedy(max_tokens=4), greedy(max_tokens=2), greedy(max_tokens=1)]
    outs = gen(llm, prompts, params)
    assert [o.prompt for o in outs] == [P_STORY, None, P_FRANCE]
    assert [o.prompt_token_ids for o in outs] == [
        tok.encode(P_STORY),
        tok.encode(P_COUNT),
        tok.encode(P_FRANCE),
    ]
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 2, 1]
    assert [int(o.request_id) for o in outs] == sorted(int(o.request_id) for o in outs)


def test_greedy_in_a_batch_equals_greedy_alone(llm, tok, greedy_alone):
    # the second prompt goes in as token ids here and as text alone
    batch = gen(llm, [P_FRANCE, count_prompt(tok)], greedy())
    for prompt, out in zip([P_FRANCE, P_COUNT], batch):
        alone = greedy_alone(prompt)
        c = out.outputs[0]
        assert c.token_ids == alone.token_ids
        assert c.text == alone.text
        assert len(c.token_ids) == GREEDY_LEN
        assert c.finish_reason == "length" and c.stop_reason is None
        assert_text_is_decoded_tokens(tok, c)


def test_max_tokens_gives_length(llm):
    (out,) = gen(llm, [P_STORY], greedy(max_tokens=3))
    c = out.outputs[0]
    assert len(c.token_ids) == 3
    assert c.finish_reason == "length"
    assert c.stop_reason is None


def test_context_limit_ends_generation_with_length(llm):
    # a prompt 3 tokens short of max_model_len with no max_tokens runs to the end of the context
    max_len = llm.llm_engine.config.max_model_len
    ids = [100 + (i * 37) % 5000 for i in range(max_len - 3)]
    (out,) = gen(llm, [{"prompt_token_ids": ids}], greedy(max_tokens=None, ignore_eos=True))
    c = out.outputs[0]
    assert len(c.token_ids) == 3
    assert len(out.prompt_token_ids) + len(c.token_ids) == max_len
    assert c.finish_reason == "length"


def test_prompt_plus_max_tokens_past_the_context_is_refused_as_the_server_does(llm):
    """One rule offline and on the server: prompt + max_tokens > max_model_len is a ValueError, not a cut."""
    from pagedllm.engine.inputs import ContextLengthError

    engine = llm.llm_engine
    max_len = engine.config.max_model_len
    ids = [100 + (i * 37) % 5000 for i in range(max_len - 3)]
    with pytest.raises(ContextLengthError, match=f"{max_len - 3} in the prompt, 4 in the completion"):
        gen(llm, [{"prompt_token_ids": ids}], greedy(max_tokens=4))
    assert not engine.has_unfinished_requests()
    (out,) = gen(llm, [{"prompt_token_ids": ids}], greedy(max_tokens=3, ignore_eos=True))  # exactly fits
    assert len(out.outputs[0].token_ids) == 3


# --- seeds and n -----------------------------------------------------------------


def seeded(seed, **kwargs):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=6, **kwargs)


@pytest.fixture(scope="module")
def seeded_runs(llm):
    first = gen(llm, [P_STORY, P_STORY], [seeded(11), seeded(22)])
    second = gen(llm, [P_STORY, P_STORY], [seeded(11), seeded(22)])
    return first, second


def test_seed_reproduces_outputs_across_calls(seeded_runs):
    first, second = seeded_runs
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert len(a.outputs[0].token_ids) == 6


def test_different_seeds_give_different_outputs(seeded_runs):
    first, _ = seeded_runs
    assert first[0].outputs[0].token_ids != first[1].outputs[0].token_ids


def test_seeded_output_does_not_depend_on_the_batch(llm, seeded_runs):
    first, _ = seeded_runs
    mixed = gen(llm, [P_STORY, P_STORY], [seeded(11), seeded(22, top_p=0.9)])
    assert mixed[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def test_n_returns_n_distinct_outputs(llm, tok):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6)
    out, again = gen(llm, [P_STORY, P_STORY], params)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert out.finished
    assert [c.index for c in out.outputs] == [0, 1, 2]
    ids = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(ids)) == 3
    for c in out.outputs:
        assert c.finish_reason in ("length", "stop")
        assert_text_is_decoded_tokens(tok, c)


# --- stops -------------------------------------------------------------------------


def shortest_prefix_containing(tok, ids, stop):
    for k in range(1, len(ids) + 1):
        if stop in tok.decode(ids[:k], skip_special_tokens=True):
            return k
    raise AssertionError(f"{stop!r} never appears in the greedy text")


@pytest.fixture(scope="module")
def stop_case(tok, greedy_alone):
    """A stop string cut out of the greedy continuation, across token edges."""
    ref = greedy_alone(P_FRANCE)
    ids, text = ref.token_ids, ref.text
    bounds = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]
    assert text == tok.decode(ids)
    # from the 2nd character of token 4 to the next-to-last character of token 5
    start, end = bounds[4] + 1, bounds[6] - 1
    assert end - start >= 2 and bounds[5] - bounds[4] >= 2 and bounds[6] - bounds[5] >= 2
    stop = text[start:end]
    cut = text.find(stop)
    k = shortest_prefix_containing(tok, ids, stop)
    return stop, text[:cut], text[: cut + len(stop)], ids[:k]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(llm, stop_case, include):
    stop, before, with_stop, expected_ids = stop_case
    params = greedy(stop=["never-in-this-text", stop], include_stop_str_in_output=include)
    (out,) = gen(llm, [P_FRANCE], params)
    c = out.outputs[0]
    assert c.text == (with_stop if include else before)
    assert c.token_ids == expected_ids
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop


def test_stop_token_id_ends_generation(llm, tok, greedy_alone):
    ref = greedy_alone(P_FRANCE).token_ids
    stop_id = ref[4]
    k = ref.index(stop_id)  # the first time it is generated
    (out,) = gen(llm, [P_FRANCE], greedy(stop_token_ids=[stop_id]))
    c = out.outputs[0]
    assert c.token_ids == ref[: k + 1]  # the stop token is kept, as in vLLM
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop_id
    assert_text_is_decoded_tokens(tok, c)


@pytest.fixture(scope="module")
def eos_prompt(tok):
    """A chat whose assistant turn is already written: the model's next token is EOS."""
    text = tok.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    text += "Hello! How can I assist you today?"
    return {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def test_eos_stops_and_ignore_eos_runs_to_max_tokens(llm, tok, eos_prompt):
    eos = tok.eos_token_id
    plain, ignoring, raw = gen(
        llm,
        [eos_prompt] * 3,
        [greedy(), greedy(max_tokens=3, ignore_eos=True),
         greedy(max_tokens=3, ignore_eos=True, skip_special_tokens=False)],
    )
    c = plain.outputs[0]
    assert c.token_ids == [eos]
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == ""

    for out, skip in ((ignoring, True), (raw, False)):
        c = out.outputs[0]
        assert len(c.token_ids) == 3
        assert c.token_ids[0] == eos
        assert c.finish_reason == "length"
        assert_text_is_decoded_tokens(tok, c, skip_special_tokens=skip)
    assert raw.outputs[0].token_ids == ignoring.outputs[0].token_ids
    assert raw.outputs[0].text.startswith(tok.eos_token)
    assert tok.eos_token not in ignoring.outputs[0].text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize(
    "text",
    ["héllo wörld 你好 🙂🎉 done", "日本語のテキスト", " 🙂x", "  spaces\n\n tabs\t x", "a<|im_end|>b<|im_start|> c"],
)
def test_incremental_text_equals_decoding_all_tokens(llm, tok, text, skip_special_tokens):
    # multi-byte characters split over byte tokens, and special tokens, fed one by one
    engine = llm.llm_engine
    ids = tok.encode(text, add_special_tokens=False)
    seq = Sequence(tok.encode("Say:"), engine.config.block_size)
    for t in ids:
        seq.append_token(t)
        detokenize_incrementally(engine.tokenizer, seq, skip_special_tokens)
        # never shows half a character
        assert "\ufffd" not in seq.output_text
    assert seq.output_text == tok.decode(ids, skip_special_tokens=skip_special_tokens)


# --- prefix caching ----------------------------------------------------------------


def test_num_cached_tokens_counts_reused_full_blocks(llm):
    block = llm.llm_engine.block_manager.block_size
    ids = list(range(7000, 7000 + 2 * block + 8))  # 2.5 blocks, unique to this test
    (first,) = gen(llm, [{"prompt_token_ids": ids}], greedy(max_tokens=2))
    (again,) = gen(llm, [{"prompt_token_ids": ids}], greedy(max_tokens=2))
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 2 * block
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # a prompt of exactly two blocks: its last token must be computed, so one block is reused
    (prefix,) = gen(llm, [{"prompt_token_ids": ids[: 2 * block]}], greedy(max_tokens=1))
    assert prefix.num_cached_tokens == block


# --- chat --------------------------------------------------------------------------


def test_chat_applies_the_chat_template(llm, tok):
    (out,) = llm.chat(HELLO, greedy(max_tokens=3), use_tqdm=False)
    text = tok.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text
    assert "Hello" in text and text.rstrip().endswith("assistant")
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    # the template holds the special tokens; none is added twice
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert out.prompt_token_ids[0] == im_start
    assert out.prompt_token_ids.count(im_start) == text.count("<|im_start|>")
    assert 1 <= len(out.outputs[0].token_ids) <= 3


def test_chat_many_conversations_in_order(llm, tok):
    convs = [HELLO, [{"role": "user", "content": "What is 2 + 2?"}]]
    outs = llm.chat(convs, greedy(max_tokens=1), use_tqdm=False)
    assert len(outs) == 2
    for conv, out in zip(convs, outs):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert out.prompt == text
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"content": "hi"}], "hello"])
def test_chat_rejects_bad_messages(llm, messages):
    with pytest.raises(ValueError):
        llm.chat(messages, greedy(max_tokens=1), use_tqdm=False)
    assert_healthy(llm)


# --- errors ------------------------------------------------------------------------


def bad_prompts(vocab, max_model_len):
    return {
        "empty string": "",
        "empty token list": {"prompt_token_ids": []},
        "negative token id": {"prompt_token_ids": [5, -1, 7]},
        "token id == vocab": {"prompt_token_ids": [5, vocab]},
        "token id > vocab": {"prompt_token_ids": [vocab + 1000]},
        "prompt of max_model_len tokens": {"prompt_token_ids": [100] * max_model_len},
        "prompt longer than max_model_len": {"prompt_token_ids": [100] * (max_model_len + 5)},
        "float token ids": {"prompt_token_ids": [1.0, 2.0]},
        "token ids as a string": {"prompt_token_ids": "1 2 3"},
        "dict without a prompt": {"text": "hello"},
        "prompt that is not text": {"prompt": 5},
        "int in the prompt list": [P_FRANCE, 42],
        "None in the prompt list": [None],
        "bytes": b"hello",
    }


BAD_PROMPT_NAMES = list(bad_prompts(10, 10))


@pytest.mark.parametrize("name", BAD_PROMPT_NAMES)
def test_bad_prompt_raises_value_error_and_leaves_nothing(llm, name):
    engine = llm.llm_engine
    prompt = bad_prompts(engine.model_config.vocab_size, engine.config.max_model_len)[name]
    with pytest.raises(ValueError):
        gen(llm, prompt, greedy(max_tokens=1))
    assert_healthy(llm)


@pytest.mark.parametrize("prompt", [42, None])
def test_bare_non_prompt_raises_value_error(llm, prompt):
    with pytest.raises(ValueError):
        gen(llm, prompt, greedy(max_tokens=1))


def test_error_messages_say_what_is_wrong(llm):
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        gen(llm, "", greedy())
    with pytest.raises(ValueError, match=str(vocab)):
        gen(llm, {"prompt_token_ids": [vocab]}, greedy())
    with pytest.raises(ValueError, match="-3"):
        gen(llm, {"prompt_token_ids": [-3]}, greedy())
    with pytest.raises(ValueError, match="max_model_len"):
        gen(llm, {"prompt_token_ids": [100] * engine.config.max_model_len}, greedy())


def test_one_bad_prompt_in_a_list_queues_nothing(llm):
    engine = llm.llm_engine
    good = [P_FRANCE, P_STORY]
    with pytest.raises(ValueError):
        gen(llm, good + [{"prompt_token_ids": [-5]}], greedy(max_tokens=1))
    assert not engine.has_unfinished_requests()
    assert engine.step() == []  # nothing was left behind to run
    assert_healthy(llm)


@pytest.mark.parametrize(
    "params",
    [
        [greedy()],  # 1 for 2 prompts
        [greedy(), greedy(), greedy()],  # 3 for 2 prompts
        [],
        "not sampling params",
        [greedy(max_tokens=1), "not sampling params"],  # right count, wrong type
    ],
    ids=["too-few", "too-many", "empty", "string", "wrong-type"],
)
def test_mismatched_sampling_params_raise(llm, params):
    with pytest.raises(ValueError):
        gen(llm, [P_FRANCE, P_STORY], params)
    assert_healthy(llm)


# --- LLMEngine ---------------------------------------------------------------------


def test_engine_add_step_abort(llm, tok, greedy_alone):
    engine = llm.llm_engine
    bm = engine.block_manager
    long_prompt = {"prompt_token_ids": list(range(9000, 9000 + 3 * bm.block_size + 3))}
    engine.add_request("a", P_FRANCE, greedy())
    engine.add_request("b", count_prompt(tok), greedy())
    engine.add_request("victim", long_prompt, greedy(max_tokens=200))
    assert engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 3

    # a duplicate id is refused and changes nothing
    with pytest.raises(ValueError, match="already"):
        engine.add_request("a", P_STORY, greedy())
    with pytest.raises(ValueError):
        engine.add_request(7, P_STORY, greedy())
    assert engine.get_num_unfinished_requests() == 3

    streamed: dict[str, list[list[int]]] = {"a": [], "b": [], "victim": []}
    for _ in range(3):
        for out in engine.step():
            assert not out.finished
            assert out.outputs[0].finish_reason is None
            streamed[out.request_id].append(list(out.outputs[0].token_ids))
    # one new token per step, each step's list extends the previous one
    for rid, seen in streamed.items():
        assert [len(s) for s in seen] == [1, 2, 3], rid
        assert seen[0] == seen[1][:1] and seen[1] == seen[2][:2]

    victim_blocks = len(engine.requests["victim"].seqs[0].block_table)
    # 3.x blocks of prompt + 3 tokens: 4 blocks, none shared with the others
    assert victim_blocks == 4
    free_before = bm.num_free_blocks
    engine.abort_request("victim")
    assert bm.num_free_blocks == free_before + victim_blocks  # at once, not at the next step
    assert engine.get_num_unfinished_requests() == 2
    engine.abort_request("no-such-request")  # ignored
    assert engine.get_num_unfinished_requests() == 2

    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= GREEDY_LEN
        for out in engine.step():
            assert out.request_id in ("a", "b")
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"a", "b"}
    assert finished["a"].outputs[0].token_ids == greedy_alone(P_FRANCE).token_ids
    assert finished["b"].outputs[0].token_ids == greedy_alone(P_COUNT).token_ids
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.step() == []


def test_engine_abort_everything_frees_the_pool_at_once(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    engine.add_request("x", P_STORY, greedy(max_tokens=50))
    engine.add_request("y", P_COUNT, greedy(max_tokens=50))
    engine.add_request("z", P_FRANCE, greedy(max_tokens=50))
    engine.step()
    engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    engine.abort_request(["x", "y", "z"])
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    # ids of aborted requests can be used again
    engine.add_request("x", P_STORY, greedy(max_tokens=1))
    (out,) = engine.step()
    assert out.request_id == "x" and out.finished


def test_engine_abort_a_request_that_never_ran(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    engine.add_request("queued", P_STORY, greedy(max_tokens=5))
    engine.abort_request("queued")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert bm.num_free_blocks == bm.num_blocks


# --- failures and edge cases ------------------------------------------------------


@contextmanager
def _failing_steps(engine):  # noqa: ANN001, ANN202
    """Every model step raises inside the block; the runner is restored after it."""
    execute = engine.model_runner.execute

    def failing_execute(record):  # noqa: ANN001, ANN202 - the runner's own signature
        raise RuntimeError("injected fault")

    engine.model_runner.execute = failing_execute
    try:
        yield
    finally:
        engine.model_runner.execute = execute


def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(llm):
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(1000, 1040))}  # 2 full blocks of 16 to publish
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with _failing_steps(engine), pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(prompt, greedy, use_tqdm=False)
    pool = engine.block_manager
    assert pool.num_free_blocks == pool.num_blocks
    # the blocks were published when the step was planned but never written:
    # a later prompt with that prefix must compute them, not hit them
    out = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_a_failed_step_keeps_what_earlier_steps_cached(llm):
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cached = {"prompt_token_ids": list(range(2000, 2040))}  # 2 full blocks of 16
    failing = {"prompt_token_ids": list(range(3000, 3040))}
    llm.generate(cached, greedy, use_tqdm=False)
    with _failing_steps(engine), pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(failing, greedy, use_tqdm=False)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert llm.generate(cached, greedy, use_tqdm=False)[0].num_cached_tokens == 32  # still cached
    assert llm.generate(failing, greedy, use_tqdm=False)[0].num_cached_tokens == 0  # never written


def test_max_model_len_beyond_the_models_positions_is_refused(smollm_path):
    # SmolLM2 has 8192 positions
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(max_model_len=8193, num_kv_blocks=600)


def test_one_token_prompt_has_prompt_logprobs_with_only_none(llm):
    out = llm.generate({"prompt_token_ids": [504]}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_tiny_temperature_is_greedy(llm):
    greedy = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    tiny = llm.generate("The capital of France is", SamplingParams(temperature=1e-30, max_tokens=8, seed=1),
                        use_tqdm=False)
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_resident_weight_and_kv_cache_bytes_are_reported(tiny_model_dirs: dict[str, str], caplog) -> None:  # noqa: ANN001
    """The bytes the model and the cache hold, derived here from the config, and the start-up log line."""
    import json

    path = tiny_model_dirs["llama"]
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    layers, heads, kv_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter + 2 * hidden
    lm_head = 0 if cfg.get("tie_word_embeddings") else vocab * hidden
    params = vocab * hidden + layers * per_layer + hidden + lm_head
    kw = {"num_kv_blocks": 32, "max_model_len": 128, "block_size": 8}
    # cos and sin, float32, for the positions the engine reaches
    rope_tables = 2 * min(cfg["max_position_embeddings"], kw["max_model_len"]) * head_dim
    with caplog.at_level("INFO", logger="pagedllm.runner.model_runner"):
        plain = LLM(path, linear_backend="torch", **kw)  # the weights as loaded
    assert plain.weight_bytes == 4 * (params + rope_tables)
    # the pool, K and V of every layer, float32
    assert plain.kv_cache_bytes == 32 * 2 * layers * 8 * kv_heads * head_dim * 4
    assert "resident: weights" in caplog.text and "KV cache" in caplog.text
    half = LLM(path, linear_backend="torch", kv_cache_dtype="bfloat16", **kw)
    assert half.kv_cache_bytes * 2 == plain.kv_cache_bytes
    # int8 and int4 keep only their blocks (the embedding's too): a quarter and a sixth of float32 and less
    assert LLM(path, quantization="int8", **kw).weight_bytes < plain.weight_bytes / 3
    assert LLM(path, quantization="int4", **kw).weight_bytes < plain.weight_bytes / 5
