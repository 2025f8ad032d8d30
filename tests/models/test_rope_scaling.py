"""RoPE scaling of every rope_type transformers computes: pagedllm's frequencies, tables and outputs against its.

Each tiny random-weight model carries one scaling whose original length is
64 positions, and runs prompts of ~100 tokens (plus 20 generated), so most
positions are where the scaling changes the angles. ``dynamic`` is the
exception: transformers scales it only past ``max_position_embeddings``,
where the engine refuses to go (checked here too). ``longrope`` takes its
short factors for the short prompt and its long ones for the long prompt, as
transformers does (see ``pagedllm/layers/rotary.py``).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from gguf import RopeScalingType
from gguf_write import finish, llama_writer, rope_order
from gguf_write import gguf_name as to_gguf_name

from pagedllm import LLM, SamplingParams
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.loader import load_model_config
from pagedllm.loader.model_config import SUPPORTED_ROPE_TYPES, from_hf_config

ORIGINAL = 64  # original_max_position_embeddings of the scaled models
HEAD_DIM = 16  # hidden 64 over 4 heads
LOGPROB_TOL = 1e-4  # float32 throughout: pagedllm and transformers agree to rounding
GENERATED = 20

# name -> (architecture, rope_parameters, max_position_embeddings)
_LONG_FACTORS = [1.0, 1.3, 1.9, 2.6, 3.4, 4.5, 6.1, 8.0]
SCALINGS: dict[str, tuple[str, dict, int]] = {
    "default": ("llama", {"rope_type": "default", "rope_theta": 10000.0}, 256),
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 256),
    # 128 positions: prompts and outputs stay below it, where transformers' dynamic NTK is unscaled
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, 128),
    # attention_factor derived from factor (0.1 ln 4 + 1)
    "yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                       "rope_theta": 10000.0}, 256),
    # every optional yarn setting, on Qwen2 (q/k/v biases)
    "yarn_qwen2": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                             "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False,
                             "rope_theta": 1_000_000.0}, 256),
    # attention_factor derived from max_position_embeddings / original
    "longrope": ("llama", {"rope_type": "longrope", "short_factor": [1.0, 1.0, 1.1, 1.1, 1.2, 1.3, 1.5, 1.6],
                           "long_factor": _LONG_FACTORS, "original_max_position_embeddings": ORIGINAL,
                           "rope_theta": 10000.0}, 256),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": ORIGINAL, "rope_theta": 500000.0}, 256),
    # half of each head unrotated (zero frequencies), the rest slowed by factor
    "proportional": ("llama", {"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5,
                               "rope_theta": 10000.0}, 256),
}
# prompt lengths: a long one, mostly past ORIGINAL, and a short one (with its output, within ORIGINAL)
PROMPT_LENGTHS = {name: [100, 37] for name in SCALINGS}


def _hf_config(name: str):  # noqa: ANN202
    from transformers import LlamaConfig, Qwen2Config

    arch, rope, max_pos = SCALINGS[name]
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    # conftest's tiny shapes; initializer_range 0.2 peaks the logits so greedy choices are not rounding's
    return cls(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=max_pos, rms_norm_eps=1e-6, initializer_range=0.2,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_parameters=dict(rope))


def _random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def rope_model_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """name -> folder of a tiny random-weight model (seeded) with that RoPE scaling, saved with the tokenizer."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for name in SCALINGS:
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(_hf_config(name), dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"rope-{name}")
        model.save_pretrained(path, safe_serialization=True)
        smollm_tokenizer.save_pretrained(path)
        dirs[name] = str(path)
    return dirs


def _hf(path: str, rope: dict | None = None):  # noqa: ANN202
    """transformers' model on the folder's weights (float32); ``rope`` replaces its RoPE parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if rope is not None:
        config.rope_parameters = rope
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """log-softmax of transformers' logits over ``ids`` in one forward, ``[len(ids), vocab]`` (float64)."""
    with torch.inference_mode():
        return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)


def _max_logprob_error(out, want: torch.Tensor) -> float:  # noqa: ANN001
    """Largest gap between pagedllm's reported logprobs (prompt and output, top 5 and chosen) and ``want``."""
    prompt_len = len(out.prompt_token_ids)
    worst = 0.0
    rows = [(i - 1, lps) for i, lps in enumerate(out.prompt_logprobs) if lps is not None]
    rows += [(prompt_len - 1 + i, lps) for i, lps in enumerate(out.outputs[0].logprobs)]
    for row, lps in rows:  # row: the position whose logits predict the token
        for token, lp in lps.items():
            worst = max(worst, abs(lp.logprob - float(want[row, token])))
    return worst


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_rope_models_match_transformers(name: str, rope_model_dirs: dict[str, str]) -> None:
    """Greedy tokens equal transformers' (its own KV-cached decoding) and every logprob pagedllm reports (prompt
    and output, top 5) is transformers' one-forward logprob, past the original length too."""
    path = rope_model_dirs[name]
    max_pos = SCALINGS[name][2]
    hf = _hf(path)
    llm = LLM(path, num_kv_blocks=2 * max_pos // 8, max_model_len=max_pos, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    prompts = _random_prompts(PROMPT_LENGTHS[name], seed=21)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, GENERATED)
        assert _max_logprob_error(out, _hf_logprobs(hf, prompt + tokens)) < LOGPROB_TOL
    if name not in ("default", "dynamic"):
        # the check discriminates: transformers without the scaling is far from pagedllm on the long prompt
        plain = _hf(path, {"rope_type": "default", "rope_theta": SCALINGS[name][1]["rope_theta"]})
        ids = prompts[0] + outs[0].outputs[0].token_ids
        assert _max_logprob_error(outs[0], _hf_logprobs(plain, ids)) > 100 * LOGPROB_TOL


@pytest.mark.parametrize("name", [n for n in SCALINGS if n != "default"])
def test_frequencies_and_tables_are_transformers(name: str) -> None:
    """inv_freq and the attention factor are ``ROPE_INIT_FUNCTIONS``' for the config pagedllm reads; the cos/sin
    tables are what transformers' rotary embedding returns at every position (its sin unsigned)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = _hf_config(name)
    ours = from_hf_config(hf_config.to_dict())  # the loader's reading of the saved config
    kind = SCALINGS[name][1]["rope_type"]
    assert ours.rope_scaling["rope_type"] == kind
    # longrope: transformers' long frequencies for a sequence past the original length (the short ones below)
    seq_len = ORIGINAL + 1 if kind == "longrope" else None
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"), seq_len=seq_len)
    inv_freq, factor = rope_parameters(HEAD_DIM, ours.max_position_embeddings, ours.rope_theta, ours.rope_scaling,
                                       long_factors=True)
    assert torch.equal(inv_freq, want_freq)
    assert factor == want_factor
    if kind in ("yarn", "longrope"):
        assert factor != 1.0  # the factor is really applied below

    rotary = RotaryEmbedding(HEAD_DIM, ours.max_position_embeddings, ours.rope_theta, ours.rope_scaling)
    hf_rotary = LlamaRotaryEmbedding(hf_config)
    positions = torch.arange(ours.max_position_embeddings)
    with torch.inference_mode():
        # one call over every position: transformers' longrope takes its long factors for it
        cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions.unsqueeze(0))
    sign = torch.cat([-torch.ones(HEAD_DIM // 2), torch.ones(HEAD_DIM // 2)])
    # a longrope table: the short rows of the positions below ORIGINAL first (test_longrope_table_...), then these
    first = ORIGINAL if kind == "longrope" else 0
    assert torch.equal(rotary.cos[first:], cos[0])
    assert torch.equal(rotary.sin[first:], sin[0] * sign)


def test_longrope_table_holds_short_rows_then_long_rows() -> None:
    """Short factors below the original length, long ones for every position after them; one set (the short)
    where no position passes the original length. No warning: every token gets transformers' choice."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = SCALINGS["longrope"][1]
    short = [1.0, 1.0, 1.1, 1.1, 1.2, 1.3, 1.5, 1.6]
    hf_config = _hf_config("longrope")
    hf_config.max_position_embeddings = ORIGINAL
    want, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, torch.device("cpu"))
    for max_position in (ORIGINAL, 256):
        inv_freq, _ = rope_parameters(HEAD_DIM, max_position, 10000.0, rope)
        assert torch.equal(inv_freq, want)  # the short set, whatever the length
    assert torch.allclose(inv_freq, 1.0 / (torch.tensor(short) * 10000.0 ** (torch.arange(0, 16, 2) / 16)))
    one_set = RotaryEmbedding(HEAD_DIM, ORIGINAL, 10000.0, rope)
    assert one_set.switch_len is None and one_set.cos.shape == (ORIGINAL, HEAD_DIM)
    both = RotaryEmbedding(HEAD_DIM, 256, 10000.0, rope)
    assert both.switch_len == ORIGINAL and both.cos.shape == (ORIGINAL + 256, HEAD_DIM)
    positions = torch.arange(ORIGINAL, dtype=torch.float32).unsqueeze(1)
    angles = torch.cat([positions * want, positions * want], dim=-1)
    _, factor = rope_parameters(HEAD_DIM, 256, 10000.0, rope)  # one attention factor for both sets
    assert torch.equal(both.cos[:ORIGINAL], angles.cos() * factor)
    both.build_tables(48)  # an engine of 48 positions never passes the original length: the short rows only
    assert both.cos.shape == (48, HEAD_DIM) and torch.equal(both.cos, angles[:48].cos() * factor)


def test_dynamic_scaling_range_is_refused_by_the_engine(rope_model_dirs: dict[str, str]) -> None:
    """transformers' dynamic NTK rescales only past max_position_embeddings: an engine reaching there is refused."""
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(rope_model_dirs["dynamic"], num_kv_blocks=64, max_model_len=256, block_size=8)


def test_unknown_rope_type_is_a_value_error_naming_it_and_the_supported_ones() -> None:
    cfg = _hf_config("linear").to_dict()
    cfg["rope_parameters"] = {"rope_type": "su-per", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="su-per") as err:
        from_hf_config(cfg)
    assert all(kind in str(err.value) for kind in SUPPORTED_ROPE_TYPES)
    # older configs: rope_scaling with "type"
    cfg["rope_scaling"] = {"type": "mystery", "factor": 2.0}
    with pytest.raises(ValueError, match="mystery"):
        from_hf_config(cfg)
    with pytest.raises(ValueError, match="su-per"):
        RotaryEmbedding(HEAD_DIM, 256, 10000.0, {"rope_type": "su-per"})


def test_bad_rope_parameters_are_value_errors_when_the_table_is_built() -> None:
    with pytest.raises(ValueError, match="low_freq_factor"):
        RotaryEmbedding(HEAD_DIM, 256, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="factor"):
        RotaryEmbedding(HEAD_DIM, 256, 10000.0, {"rope_type": "yarn"})
    # a partial rotation (the tables rotate the whole head), read from the config's top level too
    with pytest.raises(ValueError, match="whole head"):
        RotaryEmbedding(HEAD_DIM, 256, 10000.0, {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5})
    cfg = {**_hf_config("linear").to_dict(), "partial_rotary_factor": 0.5}
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    scaling = from_hf_config(cfg).rope_scaling
    with pytest.raises(ValueError, match="whole head"):
        RotaryEmbedding(HEAD_DIM, 256, 10000.0, scaling)


def test_old_style_rope_scaling_with_type_reads_as_rope_parameters() -> None:
    cfg = _hf_config("linear").to_dict()
    del cfg["rope_parameters"]
    cfg.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
    ours = from_hf_config(cfg)
    got = rope_parameters(HEAD_DIM, ours.max_position_embeddings, ours.rope_theta, ours.rope_scaling)
    want = rope_parameters(HEAD_DIM, 256, 10000.0, SCALINGS["linear"][1])
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


# --- GGUF: rope.scaling.* metadata -> the same rope_parameters -------------------------------------------

def _write_gguf(hf, path: str, rope_keys: dict[str, object]) -> None:  # noqa: ANN001
    """A Llama's float32 weights as a GGUF file (Q/K rows in llama.cpp's order), with ``rope_keys`` (a
    ``GGUFWriter`` method name -> value) for its RoPE scaling, as llama.cpp's converter writes them."""
    cfg = hf.config
    writer = llama_writer(cfg, path, HEAD_DIM)
    for method, value in rope_keys.items():
        getattr(writer, method)(value)
    for name, tensor in hf.state_dict().items():
        w = tensor.detach().float().numpy()
        gguf_name = to_gguf_name(name)
        if gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            # per head: halves -> interleaved, llama.cpp's RoPE order (the loader undoes it)
            heads = cfg.num_attention_heads if "attn_q" in gguf_name else cfg.num_key_value_heads
            w = rope_order(w, heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    finish(writer)


_GGUF_ROPE = {
    "linear": {"add_rope_scaling_type": RopeScalingType.LINEAR, "add_rope_scaling_factor": 4.0},
    "yarn": {"add_rope_scaling_type": RopeScalingType.YARN, "add_rope_scaling_factor": 4.0,
             "add_rope_scaling_orig_ctx_len": ORIGINAL},
}


@pytest.mark.parametrize("name", list(_GGUF_ROPE))
def test_gguf_rope_scaling_reads_as_the_hf_config_and_matches_transformers(
    name: str, rope_model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = rope_model_dirs[name]
    hf = _hf(path)
    gguf_path = str(tmp_path_factory.mktemp(f"gguf-rope-{name}") / "model.gguf")
    _write_gguf(hf, gguf_path, _GGUF_ROPE[name])
    from_gguf, from_folder = load_model_config(gguf_path), load_model_config(path)
    assert from_gguf.rope_theta == from_folder.rope_theta
    assert from_gguf.rope_scaling == {k: v for k, v in from_folder.rope_scaling.items() if k != "rope_theta"}
    llm = LLM(gguf_path, tokenizer=path, num_kv_blocks=64, max_model_len=256, block_size=8)
    prompts = _random_prompts([100], seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, prompts[0], GENERATED)


def test_gguf_yarn_settings_map_to_transformers_names_and_unmappable_ones_are_refused(
    rope_model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
) -> None:
    hf = _hf(rope_model_dirs["linear"])  # the weights do not matter here: only the metadata is read
    folder = tmp_path_factory.mktemp("gguf-rope-keys")

    def read(rope_keys: dict[str, object], file: str) -> dict | None:
        _write_gguf(hf, str(folder / file), rope_keys)
        return load_model_config(str(folder / file)).rope_scaling

    yarn = {**_GGUF_ROPE["yarn"], "add_rope_scaling_yarn_attn_factor": 0.75, "add_rope_scaling_yarn_beta_fast": 16.0,
            "add_rope_scaling_yarn_beta_slow": 2.0, "add_rope_scaling_yarn_ext_factor": 1.0}
    assert read(yarn, "yarn.gguf") == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                       "attention_factor": 0.75, "beta_fast": 16.0, "beta_slow": 2.0}
    assert read({"add_rope_scaling_type": RopeScalingType.NONE}, "none.gguf") is None
    with pytest.raises(ValueError, match="yarn_ext_factor"):
        read({**_GGUF_ROPE["yarn"], "add_rope_scaling_yarn_ext_factor": 0.5}, "ext.gguf")
    with pytest.raises(ValueError, match="'longrope'"):
        read({"add_rope_scaling_type": RopeScalingType.LONGROPE}, "longrope.gguf")
    with pytest.raises(ValueError, match="factor"):
        read({"add_rope_scaling_type": RopeScalingType.LINEAR}, "nofactor.gguf")


# --- GGUF rope_freqs (Llama 3.1+): per-pair divisors of the frequencies --------------------------------------
# Files made by llama.cpp's converter are tested against transformers in tests/models/test_gguf_converted.py.

def test_frequency_factors_divide_the_frequencies_once() -> None:
    factors = (1.0, 1.0, 1.5, 2.0, 4.0, 8.0, 8.0, 8.0)
    plain, _ = rope_parameters(HEAD_DIM, 256, 500000.0, None)
    divided, factor = rope_parameters(HEAD_DIM, 256, 500000.0, None, factors)
    assert torch.equal(divided, plain / torch.tensor(factors)) and factor == 1.0
    # llama.cpp composes them with a linear scaling (positions divided by its factor): so does the table
    linear = {"rope_type": "linear", "factor": 4.0}
    both, _ = rope_parameters(HEAD_DIM, 256, 500000.0, linear, factors)
    torch.testing.assert_close(both, plain / torch.tensor(factors) / 4.0, rtol=1e-6, atol=0)
    rotary = RotaryEmbedding(HEAD_DIM, 256, 500000.0, None, factors)
    positions = torch.arange(256, dtype=torch.float32).unsqueeze(1)
    assert torch.equal(rotary.cos[:, : HEAD_DIM // 2], (positions * divided).cos())


def test_frequency_factors_beside_llama3_scaling_or_of_the_wrong_shape_are_refused() -> None:
    factors = (1.0,) * (HEAD_DIM // 2)
    llama3 = SCALINGS["llama3"][1]
    with pytest.raises(ValueError, match="llama3"):  # the factors are llama3's scaling: it would apply twice
        RotaryEmbedding(HEAD_DIM, 256, 500000.0, llama3, factors)
    with pytest.raises(ValueError, match="'yarn'"):
        rope_parameters(HEAD_DIM, 256, 10000.0, SCALINGS["yarn"][1], factors)
    with pytest.raises(ValueError, match="one per rotated pair"):
        rope_parameters(HEAD_DIM, 256, 10000.0, None, factors[:-1])
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive and finite"):
            rope_parameters(HEAD_DIM, 256, 10000.0, None, (*factors[:-1], bad))
