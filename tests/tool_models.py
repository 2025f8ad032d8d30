"""A tiny random-weight Qwen3 whose chat template has tool support, for tool-calling tests.

The bundled SmolLM2's template ignores ``tools``. This one is written in the
manner of Qwen2.5/Qwen3's (ChatML turns): with tools, a system turn lists
each tool as one JSON line inside ``<tools></tools>`` and asks for calls as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; assistant calls
render that way; consecutive ``tool`` results go into one user turn, each in
``<tool_response></tool_response>``. The tokenizer is SmolLM2's, which has
ChatML's ``<|im_start|>``/``<|im_end|>`` tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

TOOL_CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- else %}
        {{- 'You are a helpful assistant.\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call the functions below. Each one is described by a JSON object, one per line, inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, write its name and arguments as a JSON object inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role in ('user', 'system') %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".strip()


def save_tiny_tool_model(path: Path, tokenizer) -> str:  # noqa: ANN001 - a transformers tokenizer
    """Write the tiny Qwen3 (random weights, seeded) with ``tokenizer`` and the tool template into ``path``."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    previous = tokenizer.chat_template
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    try:
        tokenizer.save_pretrained(path)
    finally:
        tokenizer.chat_template = previous  # the session's shared tokenizer keeps its own template
    return str(path)
