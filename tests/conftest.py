"""Shared fixtures: the bundled model, tiny random models saved as HF folders, the oracle."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.loader import bundled_model_path

torch.set_num_threads(2)

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
    """The bundled model with int8 weights (its decode steps of <= SMALL_BATCH_ROWS sequences run fused)."""
    from pagedllm import LLM

    return LLM(num_kv_blocks=256, max_model_len=512, quantization="int8")


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path: str):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> dict[str, str]:  # noqa: ANN001
    """Tiny random-weight Llama, Qwen2 and Qwen3 models saved as safetensors folders."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for arch in (*TINY_ARCHS, "llama3"):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(path, safe_serialization=True)
        smollm_tokenizer.save_pretrained(path)
        dirs[arch] = str(path)
    return dirs


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
