"""Shared fixtures: the bundled model, tiny random models saved as HF folders, the oracle."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

from pagedllm import LLM
from pagedllm.loader import bundled_model_path

torch.set_num_threads(2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers that follow from where a test lives or what it asks for, so no file has to repeat them."""
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)
        if item.path.parent.name == "distributed":
            item.add_marker(pytest.mark.distributed)

# Architectures the tests build from transformers configs. Sizes are tiny so
# that transformers (the oracle) and pagedllm both run in milliseconds; the
# shapes still exercise GQA (4 query heads on 2 KV heads), biases (Qwen2) and
# q/k norms (Qwen3).
TINY_ARCHS = ("llama", "qwen2", "qwen3")


def _tiny_config(arch: str):  # noqa: ANN202
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=49152,  # SmolLM2's tokenizer, saved beside the weights
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        # larger than the default 0.02 so that logits are peaked and greedy
        # choices are not decided by float rounding
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if arch == "llama3":
        # Llama 3 RoPE scaling: long wavelengths slowed, short ones kept
        scaling = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=64)
        return LlamaConfig(**common, rope_parameters=scaling)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=10000.0)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, rope_theta=10000.0)
    return _tiny_window_config(arch, common)


# sliding-window models (tests/test_gemma3_sliding_window.py): a window of 8
# tokens, shorter than most prompts, and both kinds of layer where the family has them
TINY_WINDOW = 8
TINY_WINDOW_ARCHS = ("gemma3", "mistral", "qwen2_window")


def _tiny_window_config(arch: str, common: dict):  # noqa: ANN202
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    if arch == "mistral":
        return MistralConfig(**common, rope_theta=10000.0, sliding_window=TINY_WINDOW)
    if arch == "qwen2_window":
        # layer 0 full, layers 1-2 sliding (max_window_layers=1)
        return Qwen2Config(**{**common, "num_hidden_layers": 3}, rope_theta=10000.0, use_sliding_window=True,
                           sliding_window=TINY_WINDOW, max_window_layers=1)
    if arch in ("gemma3", "gemma3_tied"):
        # sliding, full, sliding, sliding, full; global layers with linear RoPE scaling; a
        # small score cap, which transformers' Gemma 3 ignores. Tied as Gemma 3 ships, a tiny
        # random model repeats its last token (its hidden state stays near that token's
        # embedding), so the main one is untied and "gemma3_tied" checks the tied head only
        layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
        return Gemma3TextConfig(
            **{**common, "num_hidden_layers": 5, "tie_word_embeddings": arch == "gemma3_tied"}, head_dim=32,
            pad_token_id=0,
            sliding_window=TINY_WINDOW, layer_types=layer_types, query_pre_attn_scalar=32,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
            attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
        )
    raise ValueError(arch)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return bundled_model_path()


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: str):  # noqa: ANN201
    """transformers' own load of the bundled GGUF (float32): the oracle; read once, it is slow to parse."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm_int8():  # noqa: ANN201
    """The bundled model with int8 weights (its GGUF blocks dequantized and rounded again to int8 per channel)."""
    from pagedllm import LLM

    return LLM(num_kv_blocks=256, max_model_len=512, quantization="int8", capture_min_decode_steps=0)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path: str):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """Tiny random-weight Llama, Qwen2 and Qwen3 models saved as safetensors folders."""
    return save_tiny_models((*TINY_ARCHS, "llama3"), tmp_path_factory, smollm_tokenizer)


def save_tiny_models(archs: tuple[str, ...], tmp_path_factory: pytest.TempPathFactory, tokenizer) -> dict[str, str]:  # noqa: ANN001
    """Each architecture's tiny random-weight model (seeded) saved with the tokenizer; arch -> folder."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for arch in archs:
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        dirs[arch] = str(path)
    return dirs


@pytest.fixture(scope="session")
def llama_cpp_gguf(tiny_model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory,  # noqa: ANN201
                   gguf_converter) -> object:  # noqa: ANN001
    """``(arch, outtype) -> path``: the tiny folder of ``arch`` (``tiny_model_dirs``) converted to GGUF by
    llama.cpp's own ``convert_hf_to_gguf.py`` (``--outtype f32`` / ``f16`` ...; tests/gguf_convert.py fetches
    the converter once into the pagedllm cache), each file converted once per session."""
    from gguf_convert import ConvertedModels

    return ConvertedModels(tiny_model_dirs, tmp_path_factory.mktemp("llama-cpp-gguf"), gguf_converter)


@pytest.fixture(scope="session")
def window_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """Tiny random-weight windowed models (and a tied Gemma 3) saved as safetensors folders."""
    return save_tiny_models((*TINY_WINDOW_ARCHS, "gemma3_tied"), tmp_path_factory, smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_tool_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """A tiny random-weight Qwen3 folder whose chat template lists tools and renders calls (tests/tool_models.py)."""
    from tool_models import save_tiny_tool_model

    return save_tiny_tool_model(tmp_path_factory.mktemp("tiny-qwen3-tools"), smollm_tokenizer)


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dirs: dict[str, str]) -> dict:
    """transformers' own models on the tiny folders' weights: the oracle for them."""
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for arch, path in tiny_model_dirs.items()
    }


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:  # noqa: ANN001
    """Greedy decoding with transformers' own KV cache: the oracle.

    A plain argmax loop rather than ``generate``, so that no generation
    config (EOS handling, min lengths) can change which token wins.
    """
    ids = torch.tensor([prompt_ids], device=model.device)
    out: list[int] = []
    past = None
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]], device=model.device)
    return out



@contextlib.contextmanager
def q8_linear_inputs(model, skip: tuple = (), group: int = 32) -> Iterator:  # noqa: ANN001
    """Within the block, every ``nn.Linear`` of a transformers model (but those in ``skip``) sees its input
    rounded as llama.cpp's Q8 activations.

    Each run of ``group`` features of a row becomes ``dx * round(x / dx)`` with ``dx = max |x| / 127`` (ties
    to even): with 32, what pagedllm's integer kernels over interleaved Q4_0 / Q4_1 / Q8_0 blocks multiply;
    with 256, what those over the k-quants multiply (llama.cpp's Q8_K; see ``kernels/gguf/gguf_x16.h``). An
    input whose width is not a multiple of ``group`` goes in runs of 32 (a narrow k-quant layer falls back to
    Q5_0 / Q5_1). So transformers on the dequantized weights with these inputs is the oracle for a model held
    in those blocks. Written from that definition, not from the kernels.
    """
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0]
        run = group if x.shape[-1] % group == 0 else 32
        blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // run, run)
        dx = blocks.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
        rounded = torch.round(blocks * inv).clamp(-127, 127) * dx
        return (rounded.reshape(x.shape).to(x.dtype), *args[1:])

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and not any(m is k for k in skip)]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


# Bundled-model tests of a mechanism compare two runs whose float sums are ordered differently. With 8-bit
# activations (the default for the bundled blocks) any such difference is rounded into a different int8 row
# somewhere and grows to the rounding's own size (~0.07 in a token's log-probability), so greedy text parts
# at near-ties. Where the two runs are one configuration run two ways (chunked or whole, in a batch or alone,
# after a prefix-cache hit or a preemption: the server, chat, chunking and sharing tests) they run the
# default activations with batch_invariant=True on both sides, which makes them the same bits
# (docs/batch-invariance.md). The rest run these float32 activations, where the two runs agree to float
# rounding: tensor parallelism (the mode refuses it), two KV cache dtypes or attention backends, or the
# prefill kernel against the decode kernel (outside the mode's guarantee), and scores against transformers'.
FLOAT_ACTIVATIONS = {"gguf_activations": "float32"}


def assert_greedy_within_q8_noise(hf, prompt: list[int], ours: list[int], group: int = 32) -> float | None:  # noqa: ANN001
    """``ours`` (greedy tokens of a model held in interleaved blocks, 8-bit activations) against greedy
    transformers on the dequantized weights, unrounded: equal, or parting at a near-tie only.

    Where they first part, transformers' own logit gap between its token and ours must be no larger than
    the largest change that rounding the linear inputs to 8 bits (``q8_linear_inputs`` in runs of ``group``:
    256 for a model with k-quant layers; transformers again: an independent measure) makes to the gap between
    the top two tokens at any position of transformers' continuation. Or ``ours`` are transformers' own greedy
    tokens with its linear inputs rounded so (the oracle itself: in a small random model one coarse rounding
    can raise a third token past a gap the top two keep, and the continuations then part for good). Returns
    the gap at the parting (None when equal).
    """
    plain = hf_greedy(hf, prompt, len(ours))
    if ours == plain:
        return None
    i = next(i for i, (a, b) in enumerate(zip(ours, plain)) if a != b)
    ids = torch.tensor([prompt + plain])
    with torch.inference_mode():
        logits = hf(ids).logits[0, len(prompt) - 1 :]  # [len(ours) + 1, vocab]: each continuation position
        with q8_linear_inputs(hf, group=group):
            rounded = hf(ids).logits[0, len(prompt) - 1 :]
            if ours == hf_greedy(hf, prompt, len(ours)):
                return float(logits[i, plain[i]] - logits[i, ours[i]])
    top2 = logits.topk(2).indices  # [positions, 2]
    moved = ((logits.gather(1, top2) @ torch.tensor([1.0, -1.0])) - (rounded.gather(1, top2) @ torch.tensor([1.0, -1.0])))
    gap = float(logits[i, plain[i]] - logits[i, ours[i]])
    assert 0 <= gap <= float(moved.abs().max()), (i, gap, float(moved.abs().max()))
    return gap


def CapturingLLM(*args: object, **kwargs: object) -> LLM:  # noqa: N802 (stands in for the class)
    """``LLM`` whose decode steps are captured from the first one.

    The engine's default traces the decode step only once the requests may
    still decode ``capture_min_decode_steps`` (512) steps, where the trace
    pays for itself; the short runs of tests would then never replay a
    captured step. Tests of the captured path (and those that meant to run
    it, as every offline run did before) take this instead of ``LLM``.
    """
    kwargs.setdefault("capture_min_decode_steps", 0)
    return LLM(*args, **kwargs)


@pytest.fixture(scope="session")
def gguf_converter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One llama.cpp converter process for the session's conversions (``tests/gguf_convert.py``'s
    ``ConverterProcess``: the files are byte for byte those of a process per file, without importing torch,
    transformers and the converter again for each); ended with the session."""
    from gguf_convert import ConverterProcess

    converter = ConverterProcess(tmp_path_factory.mktemp("converter-logs"))
    yield converter
    converter.close()


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(a wheel of the checkout holding every prebuilt variant this CPU runs, the fresh venv it is installed in).

    Built once per session (minutes: one kernel build per variant) for tests/e2e/test_packaging.py and
    tests/kernels/test_kernel_variants.py; see tests/wheel_build.py.
    """
    from wheel_build import build_and_install

    return build_and_install(tmp_path_factory.mktemp("wheel"))


# a tiny LFM2 (tests/models/test_family_lfm2.py, and the hybrid model of the /kv page's tests)
LFM2_LAYER_TYPES = ["conv", "conv", "full_attention", "conv"]


@pytest.fixture(scope="session")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """A tiny random LFM2 saved as a safetensors folder (hidden 64, 4 layers, 3 of them convs of 3 taps)."""
    from transformers import AutoModelForCausalLM, Lfm2Config

    cfg = Lfm2Config(vocab_size=49152, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                     layer_types=LFM2_LAYER_TYPES, conv_L_cache=3, block_multiple_of=32, initializer_range=0.2,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("tiny-lfm2")
    model.save_pretrained(path, safe_serialization=True)
    smollm_tokenizer.save_pretrained(path)
    return str(path)



def spread_gated_delta_params(model: torch.nn.Module) -> None:
    """Give a freshly initialised Qwen3-Next / Qwen3.5 checkpoint's norms and decay parameters values away from
    transformers' defaults (ones, zeros), so that a loader mixing up ``w`` and ``1 + w`` or the decay's terms
    changes the tokens: the gated norm multiplies by ``w`` itself, the others by ``1 + w``."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.uniform_(0.5, 1.5)
            elif "norm" in name:
                param.uniform_(-0.5, 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                param.uniform_(-1.0, 1.0)

@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    """A tiny random Qwen3.5 saved as a safetensors folder (hidden 64, 4 layers: 3 Gated DeltaNet, then full
    attention), its norms and decay parameters spread as tests/models/test_family_qwen3_next.py's."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            linear_conv_kernel_dim=4, max_position_embeddings=1024, initializer_range=0.2,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    spread_gated_delta_params(model)
    path = tmp_path_factory.mktemp("tiny-qwen3_5")
    model.save_pretrained(path, safe_serialization=True)
    smollm_tokenizer.save_pretrained(path)
    return str(path)
