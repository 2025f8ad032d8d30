"""A chat request's ``thinking_token_budget`` (vLLM's field), turned into the engine's forced block end.

The engine counts and forces tokens (``pagedllm/thinking_budget.py``); what
it needs from the server is which markers open and close the reasoning, and
those are the server's reasoning parser's (``think_markers``): ``<think>`` /
``</think>`` and a blank line for ``qwen3`` and ``deepseek_r1``, Granite's
thought and response markers for ``granite``, harmony's analysis header and
the final channel's for ``gpt_oss`` (``harmony/thinking.py``: the prompt opens
the analysis message, structured outputs are refused). Without a reasoning
parser the field is a 400, as vLLM refuses it without a reasoning configuration. With ``response_format``,
``structured_outputs`` or a forced ``tool_choice`` the grammar holds from where
the reasoning block ends (the engine's ``ThinkingBudget.grammar_start``).
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import bad_request
from pagedllm.entrypoints.openai.reasoning_parsers import GptOssReasoningParser, ReasoningParser
from pagedllm.harmony.thinking import set_budget_markers
from pagedllm.sampling_params import SamplingParams


def apply_thinking_budget(params: SamplingParams, budget: int, parser: type[ReasoningParser] | None) -> None:
    """Set ``params``' budget and the parser's markers; APIError (400) when the server cannot enforce one."""
    if parser is None or parser.think_markers is None:
        what = "no reasoning parser" if parser is None else f"the {parser.name} reasoning parser"
        raise bad_request(
            f"thinking_token_budget needs a reasoning parser with markers (qwen3, deepseek_r1, granite, gpt_oss); "
            f"this server runs {what} (--reasoning-parser)", "thinking_token_budget",
        )
    params.thinking_token_budget = budget
    if parser.name == GptOssReasoningParser.name:
        try:
            set_budget_markers(params)
        except ValueError as e:
            raise bad_request(str(e), "thinking_token_budget") from e
        return
    params.think_start_str, params.think_end_str = parser.think_markers
