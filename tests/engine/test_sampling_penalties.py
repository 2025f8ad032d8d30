"""vLLM's logits processors: penalties, min_tokens, logit_bias, allowed_token_ids, bad_words, truncation.

References are independent of the code under test:

- on the same logits, transformers' own processors (``RepetitionPenaltyLogitsProcessor``,
  ``MinNewTokensLengthLogitsProcessor``, ``NoBadWordsLogitsProcessor``,
  ``SequenceBiasLogitsProcessor``, ``PrefixConstrainedLogitsProcessor``) and the
  OpenAI presence/frequency formula computed here with a ``Counter``;
- end to end, greedy ``generate`` of transformers on a tiny random-weight model
  with the same processors, against the engine on the same weights.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from pagedllm import LLM, SamplingParams
from pagedllm.engine.inputs import bad_word_token_ids
from pagedllm.runner.logits_processors import apply_logits_rules
from pagedllm.step_record import LogitsRules

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 4  # both signs, as real logits have


def _tokens(n: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def _apply(logits: torch.Tensor, rules: list, prompts: list, outputs: list) -> torch.Tensor:
    res = apply_logits_rules(logits, rules, prompts, outputs)
    assert res is not None
    return res[0]


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(presence_penalty=2.5), dict(presence_penalty=-2.01), dict(presence_penalty=math.nan),
        dict(presence_penalty="1"), dict(frequency_penalty=3), dict(frequency_penalty=-math.inf),
        dict(repetition_penalty=0), dict(repetition_penalty=-1.0), dict(repetition_penalty=math.inf),
        dict(repetition_penalty=None), dict(min_tokens=-1), dict(min_tokens=1.5), dict(min_tokens=True),
        dict(min_tokens=17), dict(max_tokens=4, min_tokens=5), dict(min_tokens=2**31),
        dict(logit_bias=[1, 2]), dict(logit_bias={-1: 1.0}), dict(logit_bias={"5": 1.0}),
        dict(logit_bias={5: math.nan}), dict(logit_bias={5: "1"}), dict(logit_bias={2**31: 1.0}),
        dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]), dict(allowed_token_ids="12"),
        dict(allowed_token_ids=[1.0]), dict(bad_words="word"), dict(bad_words=[""]), dict(bad_words=["  "]),
        dict(bad_words=[3]), dict(truncate_prompt_tokens=0), dict(truncate_prompt_tokens=-1),
        dict(truncate_prompt_tokens=1.5),
    ],
)
def test_invalid_values_raise_value_error(kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in str(e.value) or "min_tokens" in str(e.value)


def test_defaults_match_vllm_and_logit_bias_is_clamped_as_vllm_does():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (0.0, 0.0, 1.0, 0)
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words is None
    assert p.truncate_prompt_tokens is None and not p.has_logits_processors
    p = SamplingParams(logit_bias={5: 500, 6: -1e6, 7: 2.5}, min_tokens=16, max_tokens=None)
    assert p.logit_bias == {5: 100.0, 6: -100.0, 7: 2.5}
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


# --- each processor against transformers on the same logits -----------------------------------


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    logits = _logits(3)
    prompts = [_tokens(7, 1), _tokens(3, 2), _tokens(5, 3)]
    outputs = [_tokens(4, 4), (), _tokens(9, 5)]
    rules = [LogitsRules(repetition_penalty=penalty)] * 3
    ours = _apply(logits, rules, prompts, outputs)
    for r in range(3):
        ids = torch.tensor([prompts[r] + outputs[r]])
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[r : r + 1].clone())
        torch.testing.assert_close(ours[r : r + 1], want, rtol=0, atol=0)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize("presence,frequency", [(0.5, 0.0), (0.0, 0.7), (-1.5, 2.0), (2.0, -2.0)])
def test_presence_and_frequency_follow_the_openai_formula(presence, frequency):
    logits = _logits(3, seed=1)
    outputs = [_tokens(12, 6) + (3, 3, 3), (), _tokens(5, 7)]
    rules = [LogitsRules(presence_penalty=presence, frequency_penalty=frequency)] * 3
    ours = _apply(logits, rules, [(), (), ()], outputs)
    want = logits.clone()
    for r, out in enumerate(outputs):
        for token, count in Counter(out).items():
            want[r, token] -= frequency * count + presence * 1.0
    torch.testing.assert_close(ours, want)


def test_min_tokens_matches_transformers_min_new_tokens():
    logits = _logits(3, seed=2)
    eos = (2, 9)
    prompt = _tokens(6, 8)
    rule = LogitsRules(min_tokens=4, min_tokens_banned=eos)
    outputs = [(), _tokens(3, 9), _tokens(4, 10)]  # below, just below, at min_tokens
    ours = _apply(logits, [rule] * 3, [(), (), ()], outputs)
    for r, out in enumerate(outputs):
        proc = MinNewTokensLengthLogitsProcessor(len(prompt), 4, list(eos))
        want = proc(torch.tensor([prompt + out]), logits[r : r + 1].clone())
        torch.testing.assert_close(ours[r : r + 1], want)
    assert ours[0, 2] == -math.inf and ours[2, 2] == logits[2, 2]


def test_bad_words_match_transformers_no_bad_words():
    logits = _logits(4, seed=3)
    words = ((5,), (7, 8), (10, 11, 12))
    rule = LogitsRules(bad_words=words)
    # the output ends with: nothing, 7, 10 11, 11 (not the whole prefix of 10 11 12)
    outputs = [(), (1, 7), (3, 10, 11), (4, 11)]
    ours = _apply(logits, [rule] * 4, [(), (), (), ()], outputs)
    for r, out in enumerate(outputs):
        # transformers looks at the whole input; it is the output here, as vLLM bans on the output
        ids = torch.tensor([(63,) + out])  # a neutral first token: its processor needs one
        want = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=62)(ids, logits[r : r + 1].clone())
        torch.testing.assert_close(ours[r : r + 1], want)
    assert ours[1, 8] == -math.inf and ours[2, 12] == -math.inf and ours[3, 12] == logits[3, 12]


def test_logit_bias_matches_sequence_bias_and_allowed_ids_match_prefix_constraint():
    logits = _logits(2, seed=4)
    bias = ((3, 5.0), (40, -100.0), (41, 100.0))
    ours = _apply(logits, [LogitsRules(logit_bias=bias), LogitsRules(allowed_token_ids=(4, 17, 60))], [(), ()], [(), ()])
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(torch.tensor([[1]]), logits[:1].clone())
    torch.testing.assert_close(ours[:1], want)
    allowed = PrefixConstrainedLogitsProcessor(lambda batch_id, ids: [4, 17, 60], num_beams=1)
    want = allowed(torch.tensor([[1]]), logits[1:].clone())
    assert torch.equal(ours[1:].isinf(), want.isinf())
    torch.testing.assert_close(ours[1, [4, 17, 60]], logits[1, [4, 17, 60]])


def test_rows_without_rules_are_untouched_and_cost_nothing():
    logits = _logits(4, seed=5)
    assert apply_logits_rules(logits, [None] * 4, [()] * 4, [()] * 4) is None
    everything = LogitsRules(
        presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.7, logit_bias=((6, 3.0),),
        allowed_token_ids=tuple(range(0, 64, 2)), bad_words=((8,), (1, 10)), min_tokens=5, min_tokens_banned=(2,),
    )
    prompts, outputs = [(), _tokens(5, 1), (), _tokens(4, 2)], [(), (3, 1, 1), (), (9, 9)]
    rules = [None, everything, None, LogitsRules(repetition_penalty=0.8)]
    mixed, changed = apply_logits_rules(logits, rules, prompts, outputs)
    assert changed.tolist() == [1, 3]
    assert torch.equal(mixed[0], logits[0]) and torch.equal(mixed[2], logits[2])
    for r in (1, 3):  # each changed row as it is alone
        alone = _apply(logits[r : r + 1], [rules[r]], [prompts[r]], [outputs[r]])
        torch.testing.assert_close(mixed[r : r + 1], alone)
    assert not torch.equal(mixed[1], logits[1])


def test_bad_word_token_ids_follow_vllms_space_rule(smollm_tokenizer):
    def encode(text: str) -> list[int]:
        return smollm_tokenizer.encode(text, add_special_tokens=False)

    got = bad_word_token_ids(["hello", " world peace"], encode)
    # written out from vLLM's rule: the word as is, then with a space when that is another first token
    # of the same length
    want = []
    for word in ("hello", "world peace"):
        bare, spaced = encode(word), encode(" " + word)
        want.append(tuple(bare))
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            want.append(tuple(spaced))
    assert got == want
    assert tuple(encode(" hello")) in got  # SmolLM2 folds the space into the word


# --- end to end against transformers' generate -----------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs, hf_tiny):
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=256, max_model_len=128, block_size=8, num_threads=1)
    return llm, hf_tiny["llama"]


class _PresenceFrequency(LogitsProcessor):
    """OpenAI's formula over the generated tokens (after ``prompt_len``), hand-written for the oracle."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for token, count in Counter(input_ids[0, self.prompt_len :].tolist()).items():
            scores[0, token] -= self.frequency * count + self.presence
        return scores


def _hf_generate(model, prompt: list[int], max_new: int, processors: list, eos: list[int]) -> list[int]:  # noqa: ANN001
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            generation_config=config, logits_processor=LogitsProcessorList(processors),
        )
    return out[0, len(prompt) :].tolist()


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(length)]


PROMPTS = [_prompt(seed, 5 + seed) for seed in range(3)]
MAX_NEW = 16


def _ours(llm: LLM, prompt: list[int], **kwargs) -> list[int]:  # noqa: ANN003
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, **kwargs)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


def _eos(llm: LLM) -> list[int]:
    return sorted(llm.llm_engine.tokenizer.eos_token_ids)


def _pressure(prompt: list[int]) -> dict[int, float]:
    """A bias that makes three tokens (one of them from the prompt) win every step.

    The tiny random model never repeats a token on its own, so a penalty would
    change nothing; with these tokens winning, what each penalty takes off
    decides which of them comes next.
    """
    return {prompt[1]: 30.0, 777: 29.0, 4242: 28.5}


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("penalty", [1.8, 0.7])
def test_greedy_repetition_penalty_matches_generate(tiny, prompt, penalty):
    llm, hf = tiny
    bias = _pressure(prompt)
    biased = _ours(llm, prompt, logit_bias=bias)
    ours = _ours(llm, prompt, logit_bias=bias, repetition_penalty=penalty)
    # vLLM's order: the bias, then the penalties
    processors = [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
                  RepetitionPenaltyLogitsProcessor(penalty)]
    assert ours == _hf_generate(hf, prompt, MAX_NEW, processors, _eos(llm))
    assert ours != biased


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("presence,frequency", [(1.5, 2.0), (2.0, 0.5), (0.0, 0.6)])
def test_greedy_presence_frequency_match_generate(tiny, prompt, presence, frequency):
    llm, hf = tiny
    bias = _pressure(prompt)
    ours = _ours(llm, prompt, logit_bias=bias, presence_penalty=presence, frequency_penalty=frequency)
    processors = [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
                  _PresenceFrequency(len(prompt), presence, frequency)]
    assert ours == _hf_generate(hf, prompt, MAX_NEW, processors, _eos(llm))
    assert ours != _ours(llm, prompt, logit_bias=bias)


def test_greedy_min_tokens_holds_back_a_forced_eos_as_generate_does(tiny):
    llm, hf = tiny
    prompt, eos = PROMPTS[0], _eos(llm)
    forced = {eos[0]: 100.0}  # EOS would win every step
    processors = [
        MinNewTokensLengthLogitsProcessor(len(prompt), 6, eos),
        SequenceBiasLogitsProcessor({(t,): b for t, b in forced.items()}),
    ]
    want = _hf_generate(hf, prompt, MAX_NEW, processors, eos)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=MAX_NEW, min_tokens=6, logit_bias=forced), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos[0] and out.finish_reason == "stop"
    # without min_tokens the bias ends the output at once
    assert _ours(llm, prompt, logit_bias=forced) == [eos[0]]


def test_greedy_min_tokens_masks_stop_token_ids(tiny):
    llm, hf = tiny
    prompt = PROMPTS[1]
    plain = _ours(llm, prompt)
    stop = plain[2]  # would stop the output at its third token
    ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=MAX_NEW, min_tokens=5, stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    want = _hf_generate(hf, prompt, MAX_NEW, [MinNewTokensLengthLogitsProcessor(len(prompt), 5, [stop, *_eos(llm)])],
                        [stop, *_eos(llm)])
    assert ours.token_ids == want
    assert len(ours.token_ids) > 5 and stop not in ours.token_ids[:5]


def test_greedy_bad_words_match_generate(tiny, smollm_tokenizer):
    llm, hf = tiny
    prompt = PROMPTS[2]
    plain = _ours(llm, prompt)
    words = [smollm_tokenizer.decode([plain[1]]), smollm_tokenizer.decode(plain[4:6])]
    ids = bad_word_token_ids(words, lambda w: smollm_tokenizer.encode(w, add_special_tokens=False))
    # transformers bans on the whole input, vLLM on the output: equal while the prompt ends no bad word's prefix
    assert not any(len(w) > 1 and tuple(prompt[-(len(w) - 1):]) == w[:-1] for w in ids)
    ours = _ours(llm, prompt, bad_words=words)
    eos = _eos(llm)
    want = _hf_generate(hf, prompt, MAX_NEW, [NoBadWordsLogitsProcessor([list(w) for w in ids], eos)], eos)
    assert ours == want
    assert ours != plain


def test_greedy_logit_bias_and_allowed_ids_match_generate(tiny):
    llm, hf = tiny
    prompt, eos = PROMPTS[0], _eos(llm)
    plain = _ours(llm, prompt)
    bias = {plain[0]: -100.0, 555: 7.5, 1234: 9.0}
    want = _hf_generate(hf, prompt, MAX_NEW, [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})], eos)
    assert _ours(llm, prompt, logit_bias=bias) == want != plain
    allowed = sorted({*plain[3:8], 100, 200, 300})
    constraint = PrefixConstrainedLogitsProcessor(lambda batch_id, ids: allowed, num_beams=1)
    ours = _ours(llm, prompt, allowed_token_ids=allowed)
    assert ours == _hf_generate(hf, prompt, MAX_NEW, [constraint], eos)
    assert set(ours) <= set(allowed)


# --- batches, forks, preemption, sampling ------------------------------------------------------

MIXED = [
    dict(),
    dict(repetition_penalty=1.5),
    dict(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={300: 5.0}),
    dict(),
    dict(allowed_token_ids=list(range(1000, 1100)), bad_words=["hello"]),
    dict(min_tokens=10, logit_bias={2: 50.0}),
]


def test_mixed_batch_gives_each_row_its_tokens_alone(tiny):
    llm, _ = tiny
    prompts = [{"prompt_token_ids": PROMPTS[i % 3]} for i in range(len(MIXED))]
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, **kw) for kw in MIXED]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together):
        alone = llm.generate(prompt, p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_preemption_keeps_penalised_outputs(tiny_model_dirs, tiny):
    llm, _ = tiny
    small = LLM(tiny_model_dirs["llama"], num_kv_blocks=12, max_model_len=96, block_size=8, num_threads=1)
    prompts = [{"prompt_token_ids": PROMPTS[i % 3]} for i in range(len(MIXED))]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **kw) for kw in MIXED]
    params[-1] = SamplingParams(temperature=0, max_tokens=40, min_tokens=30, logit_bias={2: 50.0})
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert got == want
    assert len(got[-1]) == 31 and got[-1][-1] == 2  # min_tokens counted the recomputed output


def test_seeded_forks_with_penalties_are_reproducible_and_batch_independent(tiny):
    llm, _ = tiny
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, repetition_penalty=1.4, presence_penalty=0.5,
                       bad_words=["the"], allowed_token_ids=list(range(200, 260)))
    prompt = {"prompt_token_ids": PROMPTS[0]}
    alone = llm.generate(prompt, p, use_tqdm=False)[0]
    others = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.7, max_tokens=9)]
    batch = llm.generate([prompt, {"prompt_token_ids": PROMPTS[1]}, prompt], [p, *others], use_tqdm=False)
    assert [o.token_ids for o in batch[0].outputs] == [o.token_ids for o in alone.outputs]
    for o in alone.outputs:
        assert set(o.token_ids) <= set(range(200, 260))
    assert len({tuple(o.token_ids) for o in alone.outputs}) > 1  # forks sample on their own


def test_best_of_with_penalties_returns_its_best(tiny):
    llm, _ = tiny
    p = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=8, frequency_penalty=1.0)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, p, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_logprobs_stay_those_of_the_raw_distribution(tiny):
    llm, _ = tiny
    prompt = {"prompt_token_ids": PROMPTS[0]}
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False)[0]
    first = plain.outputs[0].token_ids[0]
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=2, logit_bias={first: -100}),
                          use_tqdm=False)[0]
    chosen = banned.outputs[0].token_ids[0]
    assert chosen != first
    # the raw distribution's top entries, and the chosen token's raw logprob and rank (2nd most likely)
    assert banned.outputs[0].logprobs[0][first].logprob == pytest.approx(plain.outputs[0].logprobs[0][first].logprob)
    assert banned.outputs[0].logprobs[0][chosen].rank == 2


# --- engine-side checks, stop strings, truncation ----------------------------------------------


def test_vocabulary_errors_raise_and_the_engine_keeps_serving(tiny):
    llm, _ = tiny
    vocab = llm.llm_engine.model_config.vocab_size
    prompt = {"prompt_token_ids": PROMPTS[0]}
    for bad in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=[5, vocab]),
                dict(min_tokens=2, allowed_token_ids=_eos(llm))):
        with pytest.raises(ValueError):
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, **bad), use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    assert len(_ours(llm, PROMPTS[0])) == MAX_NEW


def test_min_tokens_holds_back_stop_strings(tiny, smollm_tokenizer):
    llm, _ = tiny
    plain = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=10),
                         use_tqdm=False)[0].outputs[0]
    stop = smollm_tokenizer.decode(plain.token_ids[:1]).strip() or plain.text[:1]
    early = SamplingParams(temperature=0, max_tokens=10, stop=[stop])
    late = SamplingParams(temperature=0, max_tokens=10, stop=[stop], min_tokens=8)
    assert len(llm.generate({"prompt_token_ids": PROMPTS[0]}, early, use_tqdm=False)[0].outputs[0].token_ids) < 8
    assert len(llm.generate({"prompt_token_ids": PROMPTS[0]}, late, use_tqdm=False)[0].outputs[0].token_ids) > 8


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny):
    llm, _ = tiny
    long_prompt = PROMPTS[2] * 30  # 210 tokens: longer than max_model_len=128
    p = SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=5)
    out = llm.generate({"prompt_token_ids": long_prompt}, p, use_tqdm=False)[0]
    assert out.prompt_token_ids == long_prompt[-5:]
    want = llm.generate({"prompt_token_ids": long_prompt[-5:]}, SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError):
        llm.generate({"prompt_token_ids": long_prompt}, SamplingParams(max_tokens=8), use_tqdm=False)


def test_beam_search_still_runs_beside_penalised_requests(tiny):
    from pagedllm import BeamSearchParams

    llm, _ = tiny
    (beam,) = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=6))
    assert len(beam.sequences) == 2


@pytest.mark.parametrize(
    "kwargs",
    [dict(repetition_penalty=3e38), dict(repetition_penalty=1e-30), dict(frequency_penalty=-2.0, presence_penalty=-2.0),
     dict(logit_bias={t: 100.0 for t in range(0, 49152, 97)}), dict(min_tokens=8, allowed_token_ids=[2, 5, 6])],
)
def test_extreme_but_valid_settings_run_through_a_step(tiny, kwargs):
    llm, _ = tiny
    p = SamplingParams(temperature=1.0, seed=11, max_tokens=8, logprobs=1, **kwargs)
    out = llm.generate({"prompt_token_ids": PROMPTS[0] * 3}, p, use_tqdm=False)[0].outputs[0]
    assert 1 <= len(out.token_ids) <= 8
    assert all(math.isfinite(lp[t].logprob) for lp, t in zip(out.logprobs, out.token_ids))
    if "allowed_token_ids" in kwargs:  # EOS (2) allowed but held back by min_tokens = max_tokens
        assert len(out.token_ids) == 8 and set(out.token_ids) <= {5, 6}
