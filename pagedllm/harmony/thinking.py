"""A thinking budget on harmony's ``analysis`` channel: its markers, and the prompt that opens the channel.

The engine's budget (``pagedllm/thinking_budget.py``) counts the tokens after
an opening marker and, past the budget, forces a closing text. On gpt-oss the
reasoning is the ``analysis`` message, so the markers are harmony's own:

- opening: ``<|channel|>analysis<|message|>`` (the analysis message's header,
  after ``<|start|>assistant``);
- closing: ``<|end|>``, the end of any message (the model may end its analysis
  itself within the budget and go on to a tool call or the final answer);
- forced past the budget: ``<|end|><|start|>assistant<|channel|>final<|message|>``,
  which ends the analysis and opens the final answer.

openai-harmony's prompt for a reply stops at ``<|start|>assistant``, and the
model chooses the channel. With a budget the prompt also opens the analysis
channel (``open_analysis``), so the budget counts from the first output token
and binds whatever the model would have written first; the model still ends
the analysis when it likes within the budget. A reply parser told the prompt
text (``opens_analysis``) reads the output as that message's text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.harmony.vocab import harmony_encoding

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams

ANALYSIS_OPEN = "<|channel|>analysis<|message|>"
END = "<|end|>"
FINAL_OPEN = "<|start|>assistant<|channel|>final<|message|>"


def set_budget_markers(params: SamplingParams) -> None:
    """Give ``params`` (with a ``thinking_token_budget``) harmony's markers; ValueError for what harmony cannot honour.

    A structured output would constrain the harmony headers the budget forces
    and the model writes (refused, as a forced tool call is refused for harmony).
    """
    if params.structured_outputs is not None:
        raise ValueError("thinking_token_budget with structured outputs (response_format, structured_outputs) is "
                         "not supported for harmony (gpt-oss) models: the grammar would hold over harmony's headers")
    params.think_start_str = ANALYSIS_OPEN
    params.think_end_str = END + FINAL_OPEN
    params.think_close_str = END


def open_analysis(prompt: list[int]) -> list[int]:
    """The harmony prompt ``prompt`` (ending at ``<|start|>assistant``) with the analysis channel opened."""
    return [*prompt, *analysis_header_ids()]


def opens_analysis(prompt_text: str | None) -> bool:
    """Whether a harmony prompt's text ends inside an opened analysis message (``open_analysis``)."""
    return prompt_text is not None and prompt_text.endswith(ANALYSIS_OPEN)


def analysis_header_ids() -> list[int]:
    """The token ids of the analysis header ``open_analysis`` appends (a reply parser reads them first)."""
    return harmony_encoding().encode(ANALYSIS_OPEN, allowed_special="all")
