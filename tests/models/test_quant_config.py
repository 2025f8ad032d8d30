"""The quantization config is asked by every layer when built, and a new method plugs in without the loader.

``register_quant_method`` adds a rule the config consults first; a load of
a real tiny model then runs the method's three steps in order for the
layers it picked (create_weights at build, weight_loader per checkpoint
tensor, process_weights_after_loading once), and nothing else changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from pagedllm.layers.quantization.quant_config import QuantConfig, register_quant_method

PICKED = "model.layers.1.mlp.down_proj"


class _RecordingMethod(LinearMethod):
    """``F.linear`` on the loaded weight, kept as a copy of its own; records each step it is asked to take."""

    name = "recording"

    def __init__(self, log: list[tuple[str, str]], prefix: str) -> None:
        self.log, self.prefix = log, prefix

    def create_weights(self, layer: Linear) -> None:
        self.log.append(("create_weights", self.prefix))

    def weight_loader(self, layer: nn.Module, name: str, tensor: torch.Tensor, offset: int, rows: int | None) -> None:
        self.log.append(("weight_loader", name))
        super().weight_loader(layer, name, tensor, offset, rows)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.log.append(("process_weights_after_loading", self.prefix))
        layer.register_buffer("own_weight", layer.weight.detach().clone())

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.own_weight, layer.bias)


def test_config_answers_by_layer_kind_and_prefix() -> None:
    """Rules first; then float layers get the float method and embeddings their default (None)."""
    seen: list[str] = []
    method = UnquantizedLinearMethod()

    def rule(layer: nn.Module, prefix: str) -> LinearMethod | None:
        seen.append(prefix)
        return method if prefix == "a" else None

    config = QuantConfig(rules=(rule,))
    with torch.device("meta"):
        picked, other = Linear(32, 32, quant_config=config, prefix="a"), Linear(32, 32, quant_config=config, prefix="b")
        embedding = nn.Embedding(8, 32)
    assert picked.quant_method is method and seen == ["a", "b"]
    assert type(other.quant_method) is UnquantizedLinearMethod
    assert config.get_quant_method(embedding, "model.embed_tokens") is None


def test_a_registered_method_is_built_loaded_and_processed_in_order(tiny_model_dirs: dict[str, str]) -> None:
    """A method registered outside the loader is picked for one layer of a real load, takes its three steps in
    order (build, load, after loading), and the model's greedy tokens are those of the plain load."""
    kw = {"num_kv_blocks": 32, "max_model_len": 128, "block_size": 8}
    prompt = [{"prompt_token_ids": [1, 400, 3000, 77, 12, 5]}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(tiny_model_dirs["llama"], **kw).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids

    log: list[tuple[str, str]] = []
    unregister = register_quant_method(
        lambda layer, prefix: _RecordingMethod(log, prefix) if prefix == PICKED else None
    )
    try:
        llm = LLM(tiny_model_dirs["llama"], **kw)
    finally:
        unregister()
    assert log == [("create_weights", PICKED), ("weight_loader", "weight"), ("process_weights_after_loading", PICKED)]
    model = llm.llm_engine.model_runner.model
    assert model.get_submodule(PICKED).quant_method.name == "recording"
    assert model.model.layers[0].mlp.down_proj.quant_method.name != "recording"
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == plain
