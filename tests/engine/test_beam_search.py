"""Beam search: transformers' answer, found with forked (shared) KV blocks.

The oracle is ``generate(num_beams=W, length_penalty=lp, do_sample=False)``
on the same float32 weights (its default ``early_stopping=False``); with
W=1 transformers runs greedy search, so there the oracle is its greedy
tokens, scored by a teacher-forced forward pass. The block checks watch
``BlockManager`` between ``LLMEngine.step`` calls.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import FLOAT_ACTIVATIONS

from pagedllm import LLM
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.sequence import SequenceStatus


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def hf_beam_search(hf, prompt: list[int], width: int, lp: float, max_new: int, eos: list[int]):
    """transformers' finished beams, best first: [(output token ids, score)]."""
    with torch.inference_mode():
        g = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=width,
            length_penalty=lp,
            max_new_tokens=max_new,
            do_sample=False,
            num_return_sequences=width,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    beams = []
    for seq, score in zip(g.sequences.tolist(), g.sequences_scores.tolist()):
        out = seq[len(prompt) :]
        # finished early: the EOS is kept, then padding up to the longest beam
        for i, t in enumerate(out):
            if t in eos:
                assert all(p == eos[0] for p in out[i + 1 :])
                out = out[: i + 1]
                break
        beams.append((out, score))
    return beams


def teacher_forced_logprobs(hf, prompt: list[int], output: list[int]) -> list[float]:
    with torch.inference_mode():
        lp = hf(torch.tensor([prompt + output])).logits[0].log_softmax(-1)
    return [float(lp[len(prompt) + j - 1, t]) for j, t in enumerate(output)]


def check_against_hf(ours, hf, prompt, width, lp, max_new, eos):
    expected = hf_beam_search(hf, prompt, width, lp, max_new, eos)
    assert len(ours.sequences) == width
    for got, (tokens, score) in zip(ours.sequences, expected):
        assert got.tokens == prompt + tokens
        assert got.output_token_ids == tokens
        assert got.score == pytest.approx(score, abs=1e-4)
        # the score is the summed logprob over the generated length ** lp
        assert got.score == pytest.approx(got.cum_logprob / len(tokens) ** lp, abs=1e-6)
        assert got.finish_reason == ("stop" if tokens[-1] in eos else "length")
    scores = [s.score for s in ours.sequences]
    assert scores == sorted(scores, reverse=True)


def pool_is_whole(llm: LLM) -> bool:
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.llm_engine.has_unfinished_requests()


# --- SmolLM2 ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm():
    # scores equal transformers' to 1e-4 on float32 activations and a float32 cache, as transformers keeps
    # (8-bit activations move them by ~0.07: conftest; the GGUF default's float16 cache by ~2e-4)
    return LLM(num_kv_blocks=256, max_model_len=1024, kv_cache_dtype="float32", **FLOAT_ACTIVATIONS)


def smollm_prompt(llm: LLM, which: str) -> list[int]:
    tok = llm.get_tokenizer()
    if which == "chat":  # a short answer: hypotheses end at EOS, of different lengths
        text = tok.apply_chat_template(
            [{"role": "user", "content": "What is 2+2? Reply with one number."}], tokenize=False, add_generation_prompt=True
        )
        return tok.encode(text, add_special_tokens=False)
    return tok.encode("The capital of France is")


@pytest.mark.parametrize(
    ("which", "width", "lp", "max_new"),
    [("chat", 3, 1.0, 12), ("chat", 4, 0.5, 12), ("plain", 2, 2.0, 8)],
)
@pytest.mark.slow
def test_smollm_beam_search_matches_transformers(smollm, hf_smollm, which, width, lp, max_new):
    prompt = smollm_prompt(smollm, which)
    eos = sorted(smollm.llm_engine.tokenizer.eos_token_ids)
    (ours,) = smollm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(width, max_new, length_penalty=lp))
    check_against_hf(ours, hf_smollm, prompt, width, lp, max_new, eos)
    if which == "chat":
        assert ours.sequences[0].finish_reason == "stop"
    assert pool_is_whole(smollm)


@pytest.mark.slow
def test_smollm_two_prompts_in_one_call(smollm, hf_smollm):
    prompts = [smollm_prompt(smollm, "chat"), smollm_prompt(smollm, "plain")]
    eos = sorted(smollm.llm_engine.tokenizer.eos_token_ids)
    outs = smollm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(3, 6))
    for prompt, ours in zip(prompts, outs):
        check_against_hf(ours, hf_smollm, prompt, 3, 1.0, 6, eos)
    assert pool_is_whole(smollm)


@pytest.mark.slow  # ~5 s: `make test`
def test_text_prompt_and_text_output(smollm):
    (ours,) = smollm.beam_search("The capital of France is", BeamSearchParams(2, 4))
    tok = smollm.get_tokenizer()
    for s in ours.sequences:
        assert s.tokens[: len(s.tokens) - len(s.output_token_ids)] == tok.encode("The capital of France is")
        assert s.text == tok.decode(s.output_token_ids, skip_special_tokens=True)


# --- tiny random models -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    models = {}
    for arch in ("llama", "qwen2"):
        path = tiny_model_dirs[arch]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        models[arch] = (LLM(path, num_kv_blocks=128, max_model_len=256, block_size=4), hf)
    return models


@pytest.mark.parametrize(
    ("arch", "width", "lp"),
    [("llama", 2, 1.0), ("llama", 4, 0.0), ("llama", 3, 2.0), ("qwen2", 4, 1.0), ("qwen2", 3, -0.5)],
)
@pytest.mark.slow
def test_tiny_beam_search_matches_transformers(tiny, arch, width, lp):
    llm, hf = tiny[arch]
    eos = sorted(llm.llm_engine.tokenizer.eos_token_ids)
    for seed, n in ((11, 7), (12, 13)):
        prompt = random_prompt(n, seed)
        (ours,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(width, 8, length_penalty=lp))
        check_against_hf(ours, hf, prompt, width, lp, 8, eos)
    assert pool_is_whole(llm)


@pytest.mark.parametrize("lp", [1.0, 2.0])
def test_width_one_is_greedy(tiny, lp):
    from conftest import hf_greedy

    llm, hf = tiny["llama"]
    eos = llm.llm_engine.tokenizer.eos_token_ids
    prompt = random_prompt(9, seed=31)
    greedy = hf_greedy(hf, prompt, 10)
    assert not eos & set(greedy)  # no EOS on the way: width 1 has nothing else to weigh
    (ours,) = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(1, 10, length_penalty=lp))
    (best,) = ours.sequences
    assert best.output_token_ids == greedy
    total = sum(teacher_forced_logprobs(hf, prompt, greedy))
    assert best.cum_logprob == pytest.approx(total, abs=1e-3)
    assert best.score == pytest.approx(total / 10**lp, abs=1e-4)
    assert best.finish_reason == "length"


# --- forks share blocks -------------------------------------------------------------------------
def test_beams_fork_by_sharing_blocks_and_copy_only_partial_blocks(tiny):
    llm, _ = tiny["llama"]
    engine = llm.llm_engine
    bm = engine.block_manager
    bs = bm.block_size
    width = 3
    prompt = random_prompt(10, seed=41)  # blocks of 4: two full, one with 2 tokens

    copies: list[tuple[int, int]] = []
    changes: list[tuple[int, int, int]] = []  # (logical index, num computed, old block)
    append_slot, take_copies = bm.append_slot, bm.take_copies

    def watched_append_slot(seq):
        before, computed = list(seq.block_table), seq.num_computed_tokens
        ok = append_slot(seq)
        if ok:
            for i, old in enumerate(before):
                if seq.block_table[i] != old:
                    changes.append((i, computed, old))
                    assert bm.block_hash[old] is None  # never a published (full) block
        return ok

    def watched_take_copies():
        got = take_copies()
        copies.extend(got)
        return got

    bm.append_slot, bm.take_copies = watched_append_slot, watched_take_copies
    try:
        copies0 = bm.num_cow_copies
        engine.add_beam_search_request("beam", {"prompt_token_ids": prompt}, BeamSearchParams(width, 12, ignore_eos=True))
        req = engine.requests["beam"]
        assert engine.step() == []  # the prefill; the search forks the first beam
        live = req.beam.live
        assert len(live) == width
        table = list(live[0].block_table)
        assert len(table) == 3
        assert all(s.block_table == table for s in live)
        assert [bm.ref_counts[b] for b in table] == [width] * 3
        assert bm.num_used_blocks == 3

        engine.step()  # every beam writes position 10, into the shared partial block:
        # the first two copy it, the last writes in place; the full blocks stay shared
        assert copies == [(table[2], d) for _, d in copies] and len(copies) == width - 1
        assert all(s.block_table[:2] == table[:2] for s in req.beam.live)

        pruned = []
        result = None
        while result is None:
            outs = engine.step()
            result = outs[0] if outs else None
            running = engine.scheduler.running
            held = [b for s in running for b in s.block_table]
            assert sum(bm.ref_counts) == len(held)
            assert bm.num_used_blocks == len(set(held))
            for s in req.seqs:
                if s.status == SequenceStatus.FINISHED_STOPPED:
                    assert s.block_table == []  # a pruned or finished beam holds nothing
                    pruned.append(s.seq_id)
        assert pruned
        assert len(req.seqs) > width  # beams were forked along the way
    finally:
        bm.append_slot, bm.take_copies = append_slot, take_copies
    # every copy was of a partially filled block that the writer was about to write into
    assert copies and len(copies) == len(changes) == bm.num_cow_copies - copies0
    for (src, _), (i, computed, old) in zip(copies, changes):
        assert src == old
        assert i == computed // bs and computed % bs != 0
    assert len(result.outputs) == width
    assert pool_is_whole(llm)


# --- preemption -------------------------------------------------------------------------------
@pytest.mark.slow
def test_beam_search_under_preemption_finds_the_same_beams(tiny_model_dirs):
    prompts = [random_prompt(10, seed=3), random_prompt(10, seed=4)]
    params = BeamSearchParams(3, 16, ignore_eos=True)

    def run(num_blocks):
        llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=num_blocks, max_model_len=64, block_size=4)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        assert pool_is_whole(llm)
        return [[(s.tokens, round(s.score, 5)) for s in o.sequences] for o in outs], llm.llm_engine.scheduler

    ample, sched = run(256)
    assert sched.num_preemptions == 0
    tight, sched = run(16)
    assert sched.num_preemptions > 0
    assert tight == ample


def test_beam_searches_stay_within_max_num_seqs(tiny_model_dirs):
    """Each search holds its beam width from admission: 3 searches of width 4 under max_num_seqs=4 run one at a time."""
    prompts = [{"prompt_token_ids": random_prompt(10, seed=s)} for s in (5, 6, 7)]
    params = BeamSearchParams(4, 12, ignore_eos=True)

    def run(max_num_seqs):
        llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=256, max_model_len=64, block_size=4, max_num_seqs=max_num_seqs)
        sched = llm.llm_engine.scheduler
        plan, most = sched.schedule, []

        def recording():
            out = plan()
            most.append(sched.num_running)
            return out

        sched.schedule = recording
        outs = llm.beam_search(prompts, params)
        assert pool_is_whole(llm)
        return [[(s.tokens, round(s.score, 5)) for s in o.sequences] for o in outs], max(most)

    roomy, most = run(16)
    assert most > 4  # the searches overlap when there is room
    limited, most = run(4)
    assert most <= 4
    assert limited == roomy


def test_beam_search_that_outgrows_the_pool_does_not_hang(tiny_model_dirs):
    # 8 beams of up to 60 tokens cannot all live in 16 blocks of 4 once a
    # preemption has broken their sharing: the request must end, not spin
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=16, max_model_len=64, block_size=4, enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.add_beam_search_request("b", {"prompt_token_ids": random_prompt(10, seed=3)}, BeamSearchParams(8, 50, ignore_eos=True))
    final = None
    for _ in range(300):  # the search needs 50 steps; more without progress is a hang
        outs = [o for o in engine.step() if o.finished]
        if outs:
            final = outs[0]
            break
    assert final is not None
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 16
    # ended early: the beams still live are reported with finish_reason "abort"
    assert "abort" in {c.finish_reason for c in final.outputs}
    assert 1 <= len(final.outputs) <= 8


# --- parameters ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(beam_width=0, max_tokens=4),
        dict(beam_width=9, max_tokens=4),
        dict(beam_width=True, max_tokens=4),
        dict(beam_width=2.0, max_tokens=4),
        dict(beam_width=2, max_tokens=0),
        dict(beam_width=2, max_tokens=True),
        dict(beam_width=2, max_tokens=1.5),
        dict(beam_width=2, max_tokens=4, length_penalty="1"),
        dict(beam_width=2, max_tokens=4, length_penalty=True),
        dict(beam_width=2, max_tokens=4, length_penalty=None),
    ],
)
def test_bad_beam_search_params_raise(kwargs):
    with pytest.raises(ValueError):
        BeamSearchParams(**kwargs)


def test_good_beam_search_params():
    p = BeamSearchParams(beam_width=8, max_tokens=1, length_penalty=0)
    assert (p.beam_width, p.max_tokens, p.ignore_eos, p.length_penalty) == (8, 1, False, 0)


def test_engine_rejects_bad_beam_requests_and_keeps_nothing(tiny):
    llm, _ = tiny["llama"]
    engine = llm.llm_engine
    with pytest.raises(ValueError):
        engine.add_beam_search_request("a", {"prompt_token_ids": [5, 6]}, {"beam_width": 2})
    with pytest.raises(ValueError):
        engine.add_beam_search_request("a", {"prompt_token_ids": []}, BeamSearchParams(2, 4))
    with pytest.raises(ValueError):
        llm.beam_search([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [10**9]}], BeamSearchParams(2, 4))
    small = LLM(llm.llm_engine.config.model, num_kv_blocks=64, max_model_len=256, block_size=4, max_num_seqs=2)
    with pytest.raises(ValueError):
        small.beam_search([{"prompt_token_ids": [5, 6]}], BeamSearchParams(3, 4))
    assert pool_is_whole(llm) and pool_is_whole(small)


@pytest.mark.parametrize("penalty", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_length_penalty_raises(penalty):
    with pytest.raises(ValueError, match="finite"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=penalty)
