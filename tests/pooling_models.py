"""Tiny random checkpoints of the pooling tests: a Qwen3 decoder, a Qwen3 sequence classifier (a
cross-encoder) and the same decoder read as a Qwen3-Reranker-shaped yes/no judge; saved with SmolLM2's tokenizer."""

from __future__ import annotations

import json
import os

import torch


def qwen3_config(**extra: object):  # noqa: ANN201
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=2, **extra)


def save_decoder(path: str, tokenizer) -> torch.nn.Module:  # noqa: ANN001
    """A tiny random Qwen3ForCausalLM saved at ``path``; the transformers model (the oracle)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(qwen3_config()).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def save_classifier(path: str, tokenizer, num_labels: int,  # noqa: ANN001
                    id2label: dict[int, str] | None = None) -> torch.nn.Module:
    """A tiny random Qwen3ForSequenceClassification with ``num_labels`` labels (no LM head saved)."""
    from transformers import Qwen3ForSequenceClassification

    torch.manual_seed(99)
    labels = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}
    model = Qwen3ForSequenceClassification(qwen3_config(num_labels=num_labels, pad_token_id=49151,
                                                        **labels)).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


def add_sentence_transformers(path: str, pooling: str, normalize: bool) -> None:
    """sentence-transformers' ``modules.json`` and ``1_Pooling/config.json`` for ``pooling`` (mean/cls/lasttoken)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    keys = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken"}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **keys}, f)
