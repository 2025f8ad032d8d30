"""Block sharing end to end: n / best_of samples share the prompt's KV blocks.

Expected values never come from the case under test: sampled logprobs are
checked against a fresh single-sequence run that re-scores the same tokens
by teacher forcing (no sharing involved) and against transformers'
log_softmax on the same weights; best_of against an n run with the same
seed; a tight pool against an ample one. Block ids and reference counts are
inspected between ``LLMEngine.step`` calls.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams

BLOCK = 16
TEXT = (
    "The history of the city begins in the third century, when a small group of "
    "fishermen settled on the island and"
)
SAMPLE = dict(temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # the default (8-bit) activations, batch-invariant: the comparisons below set a request against the same
    # one after a prefix-cache hit, or its samples against a fresh re-scoring of their tokens as a prompt;
    # by default those sum in other orders (prefill vs decode attention kernel), and on 8-bit activations a
    # last-bit difference can move a rounding step and a near-tie. With the mode each token's hidden state is
    # the same bits however its request is run (docs/batch-invariance.md)
    return LLM(num_kv_blocks=256, max_model_len=1024, batch_invariant=True)


@pytest.fixture(scope="module")
def engine(llm):
    return llm.llm_engine


@pytest.fixture(autouse=True)
def pool_is_whole_after_each_test(engine):
    yield
    leftover = list(engine.requests)
    free = engine.block_manager.num_free_blocks
    engine.abort_request(leftover)  # clean up before asserting: no cascade
    assert leftover == []
    assert free == engine.block_manager.num_blocks


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def chosen_logprob(position: dict, token: int) -> float:
    return position[token].logprob


# --- one prefill, shared blocks --------------------------------------------------------------
def test_n4_prefills_once_and_the_samples_share_the_prompt_blocks(engine):
    prompt = random_prompt(40, seed=101)  # 2 full blocks + 8 tokens of a third
    bm = engine.block_manager
    computed0 = engine.num_prompt_tokens_computed
    copies0 = bm.num_cow_copies
    engine.add_request("n4", {"prompt_token_ids": prompt}, SamplingParams(n=4, max_tokens=3, seed=3, **SAMPLE))

    outs = engine.step()  # the prefill
    assert engine.num_prompt_tokens_computed - computed0 == 40  # once, not 4 times
    seqs = engine.requests["n4"].seqs
    assert len(seqs) == 4
    assert [len(o.token_ids) for o in outs[0].outputs] == [1, 1, 1, 1]
    tables = [s.block_table for s in seqs]
    assert len(tables[0]) == 3 and all(t == tables[0] for t in tables)
    assert [bm.ref_counts[b] for b in tables[0]] == [4, 4, 4]
    assert bm.num_used_blocks == 3

    engine.step()  # the first decode writes position 40 into the shared third block
    assert engine.num_prompt_tokens_computed - computed0 == 40
    full = tables[0][:2]
    assert all(s.block_table[:2] == full for s in seqs)
    assert [bm.ref_counts[b] for b in full] == [4, 4]
    third = [s.block_table[2] for s in seqs]
    assert len(set(third)) == 4 and all(bm.ref_counts[b] == 1 for b in third)
    assert bm.num_cow_copies - copies0 == 3  # three copy, the last writes in place
    assert bm.num_used_blocks == 2 + 4  # four unshared sequences would hold 12

    outs = engine.step()
    assert outs[0].finished and [len(o.token_ids) for o in outs[0].outputs] == [3, 3, 3, 3]
    assert engine.num_prompt_tokens_computed - computed0 == 40


# --- the copies are real: logprobs under sharing equal a fresh, unshared re-scoring -------------
@pytest.fixture(scope="module")
def shared_run(llm):
    """n=3 samples of a prompt whose last block is partial, with logprobs=3."""
    tok = llm.get_tokenizer()
    prompt = tok.encode(TEXT)
    assert len(prompt) > BLOCK and len(prompt) % BLOCK != 0  # a shared, partial last block
    bm = llm.llm_engine.block_manager
    copies0 = bm.num_cow_copies
    params = SamplingParams(n=3, max_tokens=8, seed=1234, logprobs=3, **SAMPLE)
    (out,) = gen(llm, [prompt], params)
    return prompt, out, bm.num_cow_copies - copies0


def test_samples_wrote_into_private_copies_of_the_partial_block(shared_run):
    prompt, out, num_copies = shared_run
    conts = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(conts)) == 3  # they diverged, so in-place writes would clash
    # every output token (positions len(prompt) .. +7) lies in the prompt's last block
    assert (len(prompt) + 7) // BLOCK == len(prompt) // BLOCK
    assert num_copies == 2


def test_logprobs_under_sharing_equal_teacher_forced_rescoring(llm, shared_run):
    prompt, out, _ = shared_run
    conts = [c.token_ids for c in out.outputs]
    # fresh single-sequence runs: prompt + continuation, scored position by position
    rescored = gen(llm, [prompt + c for c in conts], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for c, r in zip(out.outputs, rescored):
        assert len(r.prompt_logprobs) == len(prompt) + len(c.token_ids)
        for j, token in enumerate(c.token_ids):
            expected = chosen_logprob(r.prompt_logprobs[len(prompt) + j], token)
            assert chosen_logprob(c.logprobs[j], token) == pytest.approx(expected, abs=1e-3), (c.index, j)


def test_cumulative_logprob_is_the_sum_of_the_token_logprobs(shared_run):
    _, out, _ = shared_run
    for c in out.outputs:
        total = sum(chosen_logprob(p, t) for p, t in zip(c.logprobs, c.token_ids))
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-6)
        assert c.cumulative_logprob < 0


def test_logprobs_k_gives_top_k_plus_the_chosen_token_with_ranks(shared_run):
    _, out, _ = shared_run
    k = 3
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for position, token in zip(c.logprobs, c.token_ids):
            top = sorted((lp for t, lp in position.items() if lp.rank <= k), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top] == [1, 2, 3]
            values = [lp.logprob for lp in top]
            assert values == sorted(values, reverse=True)
            chosen = position[token]
            assert len(position) == (k if chosen.rank <= k else k + 1)
            assert chosen.rank >= 1
            # rank 1 is the most likely token; the chosen one can be no likelier
            assert chosen.logprob <= top[0].logprob + 1e-6
            if chosen.rank > k:
                assert chosen.logprob <= top[-1].logprob + 1e-6
            assert all(lp.logprob <= 0 and isinstance(lp.decoded_token, str) for lp in position.values())


def test_prompt_logprobs_shape(llm):
    prompt = llm.get_tokenizer().encode("One two three four five six")
    (out,) = gen(llm, [prompt], SamplingParams(n=2, max_tokens=2, seed=0, prompt_logprobs=2, **SAMPLE))
    pl = out.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None
    for position, token in zip(pl[1:], prompt[1:]):
        assert token in position
        top = sorted(lp.rank for lp in position.values() if lp.rank <= 2)
        assert top == [1, 2]
        assert len(position) == (2 if position[token].rank <= 2 else 3)


# --- the same, against transformers on a tiny model -----------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLM(path, num_kv_blocks=64, max_model_len=256, block_size=4), hf


def _rank_band(row: torch.Tensor, value: float, tol: float = 1e-4) -> range:
    """The ranks a logprob ``value`` may have in ``row`` when both engines' floats differ by up to ``tol``: a
    value within it of another (a near-tie among 49k logits) may be counted either side of it."""
    return range(int((row > value + tol).sum()) + 1, int((row > value - tol).sum()) + 2)


def test_tiny_model_shared_samples_match_transformers_log_softmax(tiny):
    llm, hf = tiny
    prompt = random_prompt(10, seed=5)  # blocks of 4: the last one partial
    params = SamplingParams(n=3, max_tokens=6, seed=21, logprobs=2, prompt_logprobs=2, **SAMPLE)
    (out,) = gen(llm, [prompt], params)
    assert llm.llm_engine.block_manager.num_free_blocks == 64
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        ids = prompt + c.token_ids
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)  # [len, vocab]
        for j, token in enumerate(c.token_ids):
            row = ref[len(prompt) + j - 1]
            position = c.logprobs[j]
            assert position[token].logprob == pytest.approx(float(row[token]), abs=1e-3)
            assert position[token].rank in _rank_band(row, float(row[token]))
            vals, top_ids = row.topk(2)
            for r, (t, v) in enumerate(zip(top_ids.tolist(), vals.tolist()), start=1):
                assert position[t].rank == r
                assert position[t].logprob == pytest.approx(v, abs=1e-3)
        total = sum(float(ref[len(prompt) + j - 1, t]) for j, t in enumerate(c.token_ids))
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)
    # prompt logprobs: position i given tokens < i
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        position = out.prompt_logprobs[i]
        assert position[prompt[i]].logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-3)
        assert position[prompt[i]].rank in _rank_band(ref[i - 1], float(ref[i - 1, prompt[i]]))


# --- best_of ---------------------------------------------------------------------------------------
def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(llm, engine):
    # sample i of a seeded request draws from random.Random(f"{seed}:{i}")
    # (engine/request.py), so n=4 and best_of=4 run the very same 4 samples
    prompt = random_prompt(20, seed=202)
    (all4,) = gen(llm, [prompt], SamplingParams(n=4, max_tokens=5, seed=77, **SAMPLE))
    ranked = sorted(all4.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert len({c.cumulative_logprob for c in ranked}) == 4

    engine.add_request("bo", {"prompt_token_ids": prompt}, SamplingParams(n=2, best_of=4, max_tokens=5, seed=77, **SAMPLE))
    steps, final = 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        if outs:
            assert final is None, "best_of reports only once, when the winners are known"
            (final,) = outs
    assert final is not None and final.finished and steps == 5
    assert [c.token_ids for c in final.outputs] == [c.token_ids for c in ranked[:2]]
    for got, want in zip(final.outputs, ranked[:2]):
        # the second request finds the first one's prompt blocks in the prefix cache; batch-invariant (the
        # ``llm`` fixture) a prefix hit changes no bit, so the same samples have the same logprobs exactly
        assert got.cumulative_logprob == want.cumulative_logprob
    assert [c.index for c in final.outputs] == [0, 1]


# --- seeds -----------------------------------------------------------------------------------------
def test_seeded_samples_are_reproducible_and_differ_from_each_other(llm):
    prompt = random_prompt(12, seed=303)
    params = SamplingParams(n=3, max_tokens=6, seed=42, **SAMPLE)
    first = [c.token_ids for c in gen(llm, [prompt], params)[0].outputs]
    again = [c.token_ids for c in gen(llm, [prompt], params)[0].outputs]  # now with prefix-cache hits
    assert first == again
    assert len({tuple(t) for t in first}) == 3
    other = [c.token_ids for c in gen(llm, [prompt], SamplingParams(n=3, max_tokens=6, seed=43, **SAMPLE))[0].outputs]
    assert other != first


# --- no block outlives its request -----------------------------------------------------------------
def test_finished_n_best_of_and_beam_requests_hold_no_blocks(llm, engine):
    prompt = random_prompt(21, seed=404)
    gen(llm, [prompt], SamplingParams(n=3, max_tokens=3, seed=1, **SAMPLE))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    gen(llm, [prompt], SamplingParams(n=1, best_of=3, max_tokens=3, seed=1, **SAMPLE))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=3))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("kind", ["n", "best_of", "beam"])
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_abort_mid_run_frees_every_block(engine, kind, steps):
    bm = engine.block_manager
    prompt = random_prompt(21, seed=500 + steps)
    if kind == "beam":
        engine.add_beam_search_request("x", {"prompt_token_ids": prompt}, BeamSearchParams(beam_width=3, max_tokens=8))
    else:
        best_of = 3 if kind == "best_of" else None
        n = 1 if kind == "best_of" else 3
        engine.add_request("x", {"prompt_token_ids": prompt}, SamplingParams(n=n, best_of=best_of, max_tokens=8, seed=2, **SAMPLE))
    for _ in range(steps):
        engine.step()
    if steps:
        assert bm.num_used_blocks > 0
        assert len([s for s in engine.requests["x"].seqs if s.block_table]) == 3
    engine.abort_request("x")
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.running == [] and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.step() == []


# --- preemption ------------------------------------------------------------------------------------
def test_preempted_samples_finish_with_the_tokens_of_an_ample_pool(tiny_model_dirs):
    # two n=3 requests, blocks of 4, 16 blocks: they cannot all run at once.
    # Seeded samples keep their random streams through preemption.
    prompts = [random_prompt(10, seed=600), random_prompt(10, seed=601)]
    params = SamplingParams(n=3, max_tokens=16, seed=9, **SAMPLE)

    def run(num_blocks):
        llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=num_blocks, max_model_len=64, block_size=4)
        sched = llm.llm_engine.scheduler
        plans = []
        schedule = sched.schedule

        def recording_schedule():
            out = schedule()
            plans.append((out, {s.request_id for s in sched.running}))
            return out

        sched.schedule = recording_schedule
        outs = gen(llm, prompts, params)
        assert llm.llm_engine.block_manager.num_free_blocks == num_blocks
        return [[c.token_ids for c in o.outputs] for o in outs], sched.num_preemptions, plans

    ample, n_ample, _ = run(256)
    tight, n_tight, plans = run(16)
    assert n_ample == 0
    assert n_tight > 0
    # a preemption takes every running sample of the victim's request; the
    # first one, while the samples still share their prompt blocks, all three
    preempting = [(out, running_after) for out, running_after in plans if out.preempted]
    assert len(preempting[0][0].preempted) == 3
    assert len({q.request_id for q in preempting[0][0].preempted}) == 1
    for out, running_after in preempting:
        for victim in {q.request_id for q in out.preempted}:
            assert victim not in running_after
    assert all(len({tuple(t) for t in samples}) == 3 for samples in ample)
    assert tight == ample


# --- the benchmark command -------------------------------------------------------------------------
def test_bench_sharing_command_reports_both_runs(tiny_model_dirs, capsys):
    import json

    from pagedllm.entrypoints import cli

    argv = ["bench", "sharing", "--model", tiny_model_dirs["llama"], "--num-prompts", "2", "--prompt-len", "20",
            "--output-len", "4", "--n", "3", "--block-size", "4", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    shared, unshared = result["sharing"], result["no_sharing"]
    assert result["prefix_caching"] is False
    # 20 tokens = 5 full blocks of 4; 4 output tokens each land in a sixth block
    assert shared["prompt_tokens_computed"] == 2 * 20  # one prefill per prompt
    assert unshared["prompt_tokens_computed"] == 2 * 3 * 20
    assert shared["peak_kv_blocks_used"] == 2 * (5 + 3)  # shared prompt + a private block per sample
    assert unshared["peak_kv_blocks_used"] == 2 * 3 * 6
    assert shared["output_tokens"] == unshared["output_tokens"] == 2 * 3 * 4
    assert shared["sequences"] == unshared["sequences"] == 6
    assert shared["preemptions"] == unshared["preemptions"] == 0
    assert result["peak_blocks_ratio"] == round(36 / 16, 2)
