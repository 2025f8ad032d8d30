"""How many prompt tokens a step may compute while other sequences decode.

A step computes every running decode and some prompt tokens (chunked
prefill), and every decode waits for the whole step. On a 2-core CPU a
2,048-token chunk is a ~4 s step: one long prompt froze every stream for
that long. vLLM (``long_prefill_token_threshold``) and SGLang (the
chunked-prefill size) leave the cap to the user; here it follows from a
latency target and this machine's measured costs::

    step time  ~  decode_s (the running decodes' step)  +  prompt_tokens x token_s
    target     =  itl_target_ms, or AUTO_ITL_FACTOR x decode_s ("auto")
    cap        =  (target - decode_s) / token_s   prompt tokens, at least MIN_PREFILL_TOKENS

``decode_s`` (for these B decodes) and ``token_s`` come from the engine's one
fitted model of a step's time (``pagedllm/step_time.py``, which the drafting
cost reads too): nothing to calibrate, and the fit forgets older steps, so
it follows a prompt's growing attention cost chunk by chunk. A step with no decode has no one to keep
waiting, so it takes the whole ``max_num_batched_tokens``.

Why a factor of ``AUTO_ITL_FACTOR``: with steps k times a decode step, a
prompt gets (k - 1)/k of the machine, so its time to first token is about
k/(k - 1) of its time alone (1.33x at k = 4) while the decodes' gap grows
k-fold only while it prefills. That is a floor too: no policy keeps both
the gap within k decode steps and the prompt within less than k/(k - 1) of
its time alone. Where a decode step is cheap next to a prompt token (a small
model on a slow core) ``MIN_PREFILL_TOKENS`` sets the step instead, and the
gap during a prefill is that chunk's step. Plain Python: the scheduler reads the cap,
the engine feeds the timings to the step-time model; no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.step_time import StepTimeModel

# "auto": a step with prompt tokens may take this many decode steps' time
AUTO_ITL_FACTOR = 4.0
# prompt tokens a step always may take, so a prompt progresses whatever the decodes cost.
# A step with prompt tokens has a fixed cost of its own beyond the decodes' (it runs
# eager, not captured): ~15 ms on a 2-core EPYC, where a prompt token at 4k context
# costs ~4 ms. At 16 tokens a step gave a third of its time to that overhead and a
# 4k prompt took 1.65x its time alone; at 32, 1.1-1.4x (BENCHMARKS.md).
MIN_PREFILL_TOKENS = 32
# prompt tokens of the first mixed step, before any cost was measured
INITIAL_PREFILL_TOKENS = 64
# prompt tokens one step computes of a sequence that scores its prompt (prompt logprobs, or
# echo with logprobs), whatever the step's budget: each such token needs a full-vocabulary
# row of logits and its top-k. A 6k-token echo request computed in one step held ~1.2 GB of
# logits and kept every request arriving meanwhile waiting for 37-48 s (issue 53); in chunks
# of 256 a request arriving meanwhile waits for one chunk's step (about a second for the
# bundled model on a 2-core EPYC, BENCHMARKS.md), and the steps' fixed cost (~15 ms each) adds
# ~2% to the prompt's time
MAX_SCORED_PROMPT_TOKENS = 256


@dataclass
class StepCostModel:
    """The prompt tokens a step may add to its decodes, from the fitted step time.

    Args:
        itl_target_ms: the longest step (the decodes' inter-token gap) a step
            with prompt tokens should take, in milliseconds; None:
            ``AUTO_ITL_FACTOR`` times the measured decode step.
        times: the engine's step-time model (the engine feeds it every timed step).
    """

    itl_target_ms: float | None = None
    times: StepTimeModel = field(default_factory=StepTimeModel)

    def __post_init__(self) -> None:
        t = self.itl_target_ms
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"itl_target_ms must be a positive number of milliseconds or None, got {t!r}")

    def decode_s(self, num_decodes: int) -> float | None:
        """A step of ``num_decodes`` decodes alone, as fitted; None until a step of decodes alone was seen."""
        return self.times.predict(num_decodes, 0) if self.times.num_plain_steps else None

    @property
    def token_s(self) -> float | None:
        """What one prompt token adds to a step, as fitted; None until a step with prompt tokens was seen."""
        return self.times.prompt_token_s

    def target_s(self, num_decodes: int) -> float | None:
        """The step time aimed at while ``num_decodes`` decodes run; None until such a step was measured ("auto")."""
        if self.itl_target_ms is not None:
            return self.itl_target_ms / 1000.0
        decode_s = self.decode_s(num_decodes)
        return None if decode_s is None else AUTO_ITL_FACTOR * decode_s

    def max_prefill_tokens(self, num_decodes: int) -> int | None:
        """Prompt tokens a step with ``num_decodes`` decodes may compute; None: no cap (no decode waits)."""
        if num_decodes == 0:
            return None
        target, token_s = self.target_s(num_decodes), self.token_s
        if target is None or token_s is None:
            return INITIAL_PREFILL_TOKENS
        spare = target - (self.decode_s(num_decodes) or 0.0)
        return max(MIN_PREFILL_TOKENS, int(spare / max(token_s, 1e-9)))
