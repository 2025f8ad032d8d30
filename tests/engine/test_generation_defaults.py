"""The model's own defaults: sampling from ``generation_config.json`` (or a GGUF file's ``general.sampling.*``),
and the end-of-turn tokens that stop generation (Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``).

A tiny random Llama checkpoint (SmolLM2's tokenizer plus those two special tokens) carries a
``generation_config.json`` with temperature 0.8, top_p 0.9, top_k 1, repetition_penalty 1.3 and
max_new_tokens 7, and lists ``<|eot_id|>`` among its EOS ids. With top_k 1 sampling is greedy whatever
the temperature, so a request that sets nothing must give transformers' greedy tokens under
transformers' own ``RepetitionPenaltyLogitsProcessor(1.3)``, 7 of them, on every call; a request's own
values (repetition_penalty 1.0) must win; ``generation_config="vllm"`` must ignore the file. The same
folder converted by llama.cpp's ``convert_hf_to_gguf.py`` must carry the defaults (``general.sampling.*``)
and stop at both end-of-turn tokens (slow: the conversion runs in a subprocess), and a real server driven
by the official ``openai`` client must sample with them when a request leaves them out (slow).
"""

from __future__ import annotations

import functools
import json
import logging
import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints import cli
from pagedllm.loader import bundled_model_path, gguf_loader
from pagedllm.loader.end_tokens import gguf_end_token_ids
from pagedllm.loader.generation_defaults import (
    GenerationDefaults,
    gguf_sampling_defaults,
    load_generation_defaults,
)

EOT, END_OF_TURN = "<|eot_id|>", "<end_of_turn>"
EOT_ID, END_OF_TURN_ID = 49152, 49153  # appended to SmolLM2's 49,152 tokens
IM_END_ID = 2  # SmolLM2's EOS, <|im_end|>
GENERATION_CONFIG = {"temperature": 0.8, "top_p": 0.9, "top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 7,
                     "bos_token_id": 1, "eos_token_id": [IM_END_ID, EOT_ID], "do_sample": True}
MODEL_DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 1, "repetition_penalty": 1.3, "max_tokens": 7}
# a prompt after which the tiny model's most likely token is one of the prompt's (27376, 7% above the next one):
# the penalty changes what greedy decoding picks, at the first step
PROMPT = [1, 27376, 21667, 32124, 16084, 47959, 21412, 46213, 4227, 12621, 37292, 14629]
ENGINE = dict(max_model_len=256, num_kv_blocks=64, block_size=8, kv_cache_dtype="float32")


def _save_checkpoint(path: str, smollm_tokenizer) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    smollm_tokenizer.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [EOT, END_OF_TURN]})
    if tokenizer.convert_tokens_to_ids([EOT, END_OF_TURN]) != [EOT_ID, END_OF_TURN_ID]:
        raise RuntimeError("the end-of-turn tokens did not get the ids this test expects")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=IM_END_ID, rope_theta=10000.0,
    )
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # written last and by hand: save_pretrained writes its own generation_config.json
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    path = str(tmp_path_factory.mktemp("tiny-llama-gendef"))
    _save_checkpoint(path, smollm_tokenizer)
    return path


@pytest.fixture(scope="module")
def oracle(model_dir: str):  # noqa: ANN201
    """transformers' greedy tokens on the folder's weights, under transformers' own repetition penalty."""
    from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @functools.cache
    def greedy(num_tokens: int, penalty: float) -> list[int]:
        ids = list(PROMPT)
        with torch.inference_mode():
            for _ in range(num_tokens):
                seen = torch.tensor([ids])
                logits = model(input_ids=seen).logits[:, -1]
                if penalty != 1.0:
                    logits = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits)
                ids.append(int(logits[0].argmax()))
        return ids[len(PROMPT):]

    return greedy


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, **ENGINE)


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams] | None = None,
            num_prompts: int = 1) -> list[tuple[list[int], str]]:
    """(token ids, finish reason) of each of ``num_prompts`` copies of PROMPT (one per params of a list)."""
    num_prompts = len(params) if isinstance(params, list) else num_prompts
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * num_prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def test_a_request_that_sets_nothing_samples_with_the_models_defaults(llm: LLM, oracle) -> None:  # noqa: ANN001
    defaults = llm.get_default_sampling_params()
    assert {k: getattr(defaults, k) for k in MODEL_DEFAULTS} == MODEL_DEFAULTS
    assert llm.llm_engine.generation_defaults.source == "the model's generation_config.json"
    penalized, plain = oracle(7, 1.3), oracle(7, 1.0)
    assert penalized != plain, "the penalty must change the greedy tokens, or this test checks nothing"
    assert not {IM_END_ID, EOT_ID} & set(penalized)
    # top_k=1: the same tokens for every request, with no seed; 7 of them (max_new_tokens)
    assert _tokens(llm, num_prompts=3) == [(penalized, "length")] * 3
    # a SamplingParams that leaves the sampling fields unset gets them too (greedy: temperature 0 is its own)
    assert _tokens(llm, SamplingParams(temperature=0)) == [(penalized, "length")]


def test_a_requests_own_values_win(llm: LLM, oracle) -> None:  # noqa: ANN001
    own = [SamplingParams(repetition_penalty=1.0, max_tokens=5), SamplingParams(min_tokens=9, max_tokens=9)]
    assert _tokens(llm, own) == [(oracle(5, 1.0), "length"), (oracle(9, 1.3), "length")]
    # the model's max_tokens cannot undercut a request's min_tokens unnoticed
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate("hi", SamplingParams(min_tokens=9), use_tqdm=False)


def test_generation_config_vllm_ignores_the_models_defaults(model_dir: str, oracle) -> None:  # noqa: ANN001
    llm = LLM(model_dir, generation_config="vllm", **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams()
    assert llm.llm_engine.generation_defaults == GenerationDefaults()
    assert _tokens(llm, SamplingParams(temperature=0, max_tokens=7)) == [(oracle(7, 1.0), "length")]
    # the end tokens are the model's whatever generation_config says
    assert {IM_END_ID, EOT_ID} <= llm.llm_engine.tokenizer.eos_token_ids


def test_end_of_turn_tokens_stop_an_hf_folder(llm: LLM) -> None:
    # generation_config's eos_token_id list (<|eot_id|>), the tokenizer's EOS (<|im_end|>); a folder's end tokens
    # are those it lists, as vLLM and transformers read it: <end_of_turn> is not one of this folder's
    forced = [SamplingParams(logit_bias={token: 100.0}, max_tokens=5) for token in (EOT_ID, IM_END_ID, END_OF_TURN_ID)]
    assert _tokens(llm, forced) == [([EOT_ID], "stop"), ([IM_END_ID], "stop"), ([END_OF_TURN_ID] * 5, "length")]


def test_the_defaults_are_read_checked_and_logged(model_dir: str, tmp_path, caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.INFO, logger="pagedllm.loader.generation_defaults"):
        defaults = load_generation_defaults(model_dir, "auto")
    assert defaults.values == MODEL_DEFAULTS
    assert caplog.messages == ["sampling defaults from the model's generation_config.json: temperature=0.8, "
                               "top_p=0.9, top_k=1, repetition_penalty=1.3, max_tokens=7"]
    # a folder named by generation_config: its file, not the model's
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": None}))
    other = load_generation_defaults(model_dir, str(tmp_path))
    assert (other.values, other.source) == ({"temperature": 0.6, "top_p": 0.95}, str(tmp_path / "generation_config.json"))
    with pytest.raises(ValueError, match="must be 'auto', 'vllm' or a folder holding generation_config.json"):
        load_generation_defaults(model_dir, str(tmp_path / "nowhere"))
    for bad, key in (({"temperature": -1}, "temperature"), ({"top_k": 2.5}, "top_k"),
                     ({"max_new_tokens": 0}, "max_tokens")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=f"generation_config.json: the sampling default {key}=.*--generation-config vllm"):
            load_generation_defaults(model_dir, str(tmp_path))
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_generation_defaults(model_dir, str(tmp_path))
    # a model without a generation_config.json (the bundled GGUF has no general.sampling keys) sets none
    assert load_generation_defaults(bundled_model_path(), "auto") == GenerationDefaults()
    assert EngineConfig(model="m", generation_config="vllm").generation_config == "vllm"
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(model="m", generation_config="")


def test_gguf_sampling_metadata_is_read_as_the_converter_wrote_it() -> None:
    # float32 metadata reads back as the decimal the converter was given
    metadata = {"general.sampling.temp": 0.6000000238418579, "general.sampling.top_p": 0.8999999761581421,
                "general.sampling.top_k": 40, "general.sampling.min_p": 0.05000000074505806,
                "general.sampling.penalty_repeat": 1.100000023841858, "general.sampling.mirostat": 2}
    values, ignored = gguf_sampling_defaults(metadata, "a.gguf")
    assert values == {"temperature": 0.6, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}
    assert ignored == ("general.sampling.mirostat",)
    with pytest.raises(ValueError, match="a.gguf: the sampling default top_p=1.5"):
        gguf_sampling_defaults({"general.sampling.top_p": 1.5}, "a.gguf")


def test_gguf_end_tokens_are_its_eos_eot_eom_and_end_of_turn_controls() -> None:
    tokens = ["<unk>", "<s>", "</s>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "hello", "<|im_end|>", "<|eom_id|>"]
    types = [2, 3, 3, 3, 3, 1, 1, 4, 3]  # <|end|> is a normal token here: text, not an end of turn
    metadata = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 6}
    assert gguf_end_token_ids(metadata) == (2, 3, 4, 6, 7, 8)
    assert gguf_end_token_ids({"tokenizer.ggml.eom_token_id": 5}) == (5,)
    # the bundled SmolLM2: <|im_end|> (its EOS) and <|endoftext|>, both control tokens
    reader = gguf_loader.open_reader(bundled_model_path())
    assert gguf_end_token_ids(gguf_loader.metadata(reader)) == (0, 2)
    assert gguf_loader.read_config(reader).eos_token_ids == (0, 2)


def test_the_command_line_and_env_use_the_models_defaults(model_dir: str, capsys, caplog) -> None:  # noqa: ANN001
    argv = ["generate", "--model", model_dir, "--max-model-len", "256", "--num-kv-blocks", "64", "Hello"]
    with caplog.at_level(logging.INFO, logger="pagedllm.loader.generation_defaults"):
        assert cli.main(argv) == 0
    assert "sampling defaults from the model's generation_config.json: temperature=0.8" in caplog.text
    assert "(7 tokens, finish_reason=length)" in capsys.readouterr().out
    assert cli.main(["env", "--model", model_dir]) == 0
    report = capsys.readouterr().out
    assert "values: temperature=0.8, top_p=0.9, top_k=1, repetition_penalty=1.3, max_tokens=7" in report
    assert f"end_token_ids: {IM_END_ID}, {EOT_ID}" in report


def test_the_command_lines_sampling_is_its_flags_then_the_models_then_its_own() -> None:
    def params(flags: list[str], model: dict) -> SamplingParams:
        args = cli.build_parser().parse_args(["generate", "hi", *flags])
        return cli._sampling_params(cli._given_sampling(args), args, GenerationDefaults(model, "test"))

    def fields(p: SamplingParams) -> tuple:
        return p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens

    assert fields(params([], {})) == (0.7, 0.9, 0, 1.0, 64)  # the command's own
    assert fields(params([], MODEL_DEFAULTS)) == (0.8, 0.9, 1, 1.3, 7)
    assert fields(params(["--temperature", "0", "--max-tokens", "3", "--repetition-penalty", "1.1"],
                         MODEL_DEFAULTS)) == (0, 0.9, 1, 1.1, 3)
    assert fields(params(["--top-k", "5"], {"temperature": 0.2})) == (0.2, 0.9, 5, 1.0, 64)


@pytest.mark.slow  # llama.cpp's converter runs in the session's converter process (seconds)
def test_a_converted_gguf_carries_the_defaults_and_stops_at_end_of_turn(
    model_dir: str, oracle, tmp_path_factory: pytest.TempPathFactory, gguf_converter,  # noqa: ANN001
) -> None:
    path = gguf_converter.convert(model_dir, "f32", str(tmp_path_factory.mktemp("gendef-gguf") / "tiny-gendef-f32.gguf"))
    llm = LLM(path, gguf_activations="float32", **ENGINE)
    defaults = llm.llm_engine.generation_defaults
    # the converter copies every sampling key but max_new_tokens
    assert defaults.values == {k: v for k, v in MODEL_DEFAULTS.items() if k != "max_tokens"}
    assert defaults.source == "the GGUF file's general.sampling metadata"
    # its EOS is the tokenizer's <|im_end|>; <|eot_id|>, <end_of_turn> and <|endoftext|> stop by their text
    assert llm.llm_engine.tokenizer.eos_token_ids == {0, IM_END_ID, EOT_ID, END_OF_TURN_ID}
    assert _tokens(llm, SamplingParams(max_tokens=7), num_prompts=2) == [(oracle(7, 1.3), "length")] * 2
    forced = [SamplingParams(logit_bias={token: 100.0}, max_tokens=5) for token in (EOT_ID, END_OF_TURN_ID)]
    assert _tokens(llm, forced) == [([EOT_ID], "stop"), ([END_OF_TURN_ID], "stop")]


@pytest.mark.slow  # a real uvicorn server (seconds to start and stop)
def test_the_server_samples_with_the_models_defaults(llm: LLM, oracle) -> None:  # noqa: ANN001
    from openai import OpenAI
    from server_helpers import serve_in_thread

    with serve_in_thread(llm.llm_engine, model_name="tiny") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        prompt_text = llm.llm_engine.tokenizer.decode(PROMPT)
        # no sampling fields: the model's top_k=1 and repetition_penalty 1.3, the same answer on each call
        texts = {client.completions.create(model=model, prompt=PROMPT, max_tokens=7).choices[0].text for _ in range(3)}
        chats = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt_text}])
                 for _ in range(2)]
        assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
        # no max_tokens: the model's max_new_tokens (7), unless an end token came first
        usage, reason = chats[0].usage.completion_tokens, chats[0].choices[0].finish_reason
        assert (usage == 7 and reason == "length") or (usage < 7 and reason == "stop")
        # the request's own values win: no penalty, and its own max_tokens
        own = client.completions.create(model=model, prompt=PROMPT, max_tokens=5,
                                        extra_body={"repetition_penalty": 1.0})
    tokenizer = llm.llm_engine.tokenizer
    assert texts == {tokenizer.decode(oracle(7, 1.3))}
    assert own.choices[0].text == tokenizer.decode(oracle(5, 1.0))
