"""Weight-only int8 / int4 quantized while loading (``QuantizedLinearMethod.weight_loader``): the same bytes as rounding
each whole weight of a float32 model, and a load peak of about the blocks plus one checkpoint tensor.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import pagedllm.layers.quantization.quantized_linear as quantized_linear
from pagedllm.config import EngineConfig
from pagedllm.kernels import load_kernels
from pagedllm.layers.attention import make_backend
from pagedllm.layers.linear import layer_shape
from pagedllm.layers.quantization.quantized_linear import (
    layer_group_size,
    pack_groups,
    quantize_groups,
)
from pagedllm.loader import iter_weights, load_model_config
from pagedllm.resolved_config import resolve_config
from pagedllm.runner.model_loader import LoadedModel, load_model, model_tensors, resident_bytes

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="int8/int4 need the native build")


def _save_model(path: str, arch: str, tied: bool, dtype: torch.dtype = torch.float32, **sizes: int) -> str:
    """A random-weight transformers model of ``arch`` ("llama", "qwen2": biases) saved as safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2) | sizes
    config = (LlamaConfig if arch == "llama" else Qwen2Config)(**shape, tie_word_embeddings=tied, bos_token_id=1,
                                                               eos_token_id=2)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    made = {}
    for name, arch, tied, dtype in [("llama", "llama", False, torch.float32), ("llama_tied", "llama", True, torch.float32),
                                    ("qwen2", "qwen2", False, torch.float32), ("llama_bf16_tied", "llama", True,
                                                                                torch.bfloat16)]:
        made[name] = _save_model(str(tmp_path_factory.mktemp(name)), arch, tied, dtype)
    return made


def _load(path: str, **config: object) -> LoadedModel:
    engine_config = EngineConfig(model=path, **config)
    model_config = load_model_config(path)
    backend = make_backend(resolve_config(engine_config).attention_backend, "cpu", torch.float32)
    return load_model(engine_config, model_config, iter_weights(path, model_config), backend, torch.device("cpu"))


def _held(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every named parameter and buffer, shared ones under each of their names."""
    return dict(itertools.chain(model.named_parameters(remove_duplicate=False),
                                model.named_buffers(remove_duplicate=False)))


def _rounded(model: nn.Module, bits: int, group_size: int | None) -> dict[str, torch.Tensor]:
    """What a quantized load of float32 ``model``'s checkpoint should hold (``_held``): every linear weight and the
    embedding rounded whole (``pack_groups(*quantize_groups(...))``), a linear layer's blocks interleaved where its
    rows are tiles of 16 (``gguf_activations="int8"``, the default), a tied embedding sharing the head's blocks."""
    held = _held(model)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        rows, in_features = layer_shape(module)
        group = layer_group_size(in_features, group_size)
        blocks = pack_groups(*quantize_groups(module.weight, bits, group), bits)
        if isinstance(module, nn.Linear) and rows % 16 == 0:
            torch.ops.pagedllm.quantized_interleave_(blocks, bits, group, in_features)
        del held[f"{name}.weight"]
        held[f"{name}.qweight"] = blocks
    if model.lm_head.weight is model.model.embed_tokens.weight:
        held["model.embed_tokens.qweight"] = held["lm_head.qweight"]
    return held


@pytest.mark.parametrize(("quantization", "group_size"), [("int8", None), ("int8", 32), ("int4", None), ("int4", 32)])
@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "llama_bf16_tied"])
def test_quantized_while_loading_equals_rounding_the_float32_model(
    name: str, quantization: str, group_size: int | None, checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Byte for byte: the blocks, biases, norms and tables of the load against each whole weight of the model
    loaded in float32 rounded at once (``_rounded``), for tied and untied heads, biases, a bf16 checkpoint, and
    chunks of 3 rows (boundaries inside every tensor and inside the fused q/k/v and gate/up parts)."""
    monkeypatch.setattr(quantized_linear, "LOAD_CHUNK_BYTES", 3 * 4 * 128)
    path = checkpoints[name]
    new = _load(path, quantization=quantization, quantization_group_size=group_size)
    old = _load(path, linear_backend="torch")  # float32 weights kept as loaded
    weight_group_size = EngineConfig(model=path, quantization=quantization,
                                     quantization_group_size=group_size).weight_group_size
    want, got = _rounded(old.model, 8 if quantization == "int8" else 4, weight_group_size), _held(new.model)
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert torch.equal(got[key].contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8)), key
    embedding, head = new.model.model.embed_tokens, new.model.lm_head
    assert type(embedding.quant_method).__name__ == "QuantizedEmbeddingMethod"
    assert (head.qweight is embedding.qweight) == name.endswith("_tied")
    assert any(getattr(m, "interleaved", False) for m in new.model.modules())  # the integer path's layout
    # a head of 1000 rows (not tiles of 16) keeps the groups' order; an untied embedding only looks rows up
    assert head.interleaved == (head.out_features % 16 == 0)
    assert embedding.interleaved == (name.endswith("_tied") and head.interleaved)
    assert all(getattr(m, "weight", None) is None for m in new.model.modules() if hasattr(m, "qweight"))
    assert new.num_params == old.num_params
    named = {id(t) for t in _held(old.model).values()}
    attributes = [t for t in model_tensors(old.model) if id(t) not in named]  # tensors held as attributes (RoPE)
    assert new.weight_bytes == resident_bytes(list(want.values()) + attributes)


def test_a_wrong_shape_is_a_value_error(tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import load_file, save_file

    path = _save_model(str(tmp_path), "llama", tied=False)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:, :32].contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj.weight: checkpoint shape \(32, 32\) != model \(32, 64\)"):
        _load(path, quantization="int4")


# The load in a process of its own: VmHWM reset (clear_refs 5) just before load_model, so the peak is the load's.
# The model is built once on the meta device first: the first construction imports and initializes ~70 MiB of
# torch machinery, a cost of the process and not of the load.
_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from pagedllm.config import EngineConfig
    from pagedllm.kernels import load_kernels
    from pagedllm.layers.attention import make_backend
    from pagedllm.loader import iter_weights, load_model_config
    from pagedllm.models.registry import model_class
    from pagedllm.resolved_config import resolve_config
    from pagedllm.runner.model_loader import load_model

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    path, quantization = sys.argv[1:]
    load_kernels()
    config, model_config = EngineConfig(model=path, quantization=quantization), load_model_config(path)
    backend = make_backend(resolve_config(config).attention_backend, "cpu", torch.float32)
    with torch.device("meta"):
        model_class(model_config)(model_config, backend, None)
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    loaded = load_model(config, model_config, iter_weights(path, model_config), backend, torch.device("cpu"))
    print(json.dumps({"growth": status("VmHWM") - before, "weight_bytes": loaded.weight_bytes}))
""")


def _clear_refs_resets_the_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _clear_refs_resets_the_peak(),
                    reason="reads the peak RSS from /proc/self/status after resetting it")
@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_the_load_peak_is_the_blocks_plus_one_checkpoint_tensor(quantization: str, tmp_path) -> None:  # noqa: ANN001
    """A 112 MiB float32 checkpoint (two 32 MiB vocabulary tables): the resident set grows during the load by
    at most the blocks, the largest checkpoint tensor in float32, a few chunks' temporaries and 8 MiB of
    allocator slack; quantizing a float32 model after loading it peaked at 152 MiB here (int4)."""
    from safetensors import safe_open

    path = _save_model(str(tmp_path), "llama", tied=False, vocab_size=16384, hidden_size=512,
                       intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        sizes = [4 * math.prod(f.get_slice(name).get_shape()) for name in f.keys()]  # float32 bytes
    float_bytes, largest = sum(sizes), max(sizes)
    # the child imports this checkout's pagedllm, whatever the installed one is
    root = os.path.dirname(os.path.dirname(os.path.dirname(quantized_linear.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, path, quantization], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    bound = measured["weight_bytes"] + largest + 6 * quantized_linear.LOAD_CHUNK_BYTES + (8 << 20)
    assert bound < 0.75 * float_bytes  # the model is large enough for the bound to tell the two loads apart
    assert measured["growth"] <= bound, (measured, bound, float_bytes)
