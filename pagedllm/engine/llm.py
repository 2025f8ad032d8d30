"""The offline API: ``LLM(...).generate(prompts, params)``, as in vLLM.

It lives beside ``LLMEngine``, which it drives step by step until its
requests finish, rather than in ``entrypoints/`` (where vLLM has it): the
benchmarks run the engine through it, and they sit below the entry points
(the CLI imports ``bench``, so ``bench`` may not import ``entrypoints``).
``pagedllm.LLM`` and ``pagedllm.entrypoints.llm`` name the same objects.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.chat_content import content_text
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.pooling_methods import PoolingMethods
from pagedllm.engine.vllm_args import translate_vllm_args
from pagedllm.loader import load_model_config, resolve_model_path, resolve_tokenizer_path
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | dict[str, Any]


# the CPU figure is measured (throughput workload, 512-8192 tokens: 532, 557,
# 555, 552, 481, 464 output tok/s for 512, 1024, 1536, 2048, 4096, 8192);
# the GPU one is vLLM's offline default, not measured here
_DEFAULT_CPU_BATCHED_TOKENS = 2048
_DEFAULT_GPU_BATCHED_TOKENS = 8192


def make_engine_config(
    model: str | None = None,
    *,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    **kwargs: Any,
) -> EngineConfig:
    """The ``EngineConfig`` that ``LLM(model, ...)`` builds its engine from, with the same defaults.

    Reads the model's configuration only, not its weights (``pagedllm serve
    --data-parallel-size`` hands it to the replica processes).
    """
    path = resolve_model_path(model, revision=kwargs.get("revision"), gguf_file=kwargs.get("gguf_file"))
    kwargs = translate_vllm_args(path, kwargs)  # dtype="auto", gpu_memory_utilization, trust_remote_code
    if kwargs.get("tokenizer") is not None:
        kwargs["tokenizer"] = resolve_tokenizer_path(kwargs["tokenizer"], revision=kwargs.get("tokenizer_revision"))
    if max_model_len is None:
        # the model's context, lowered to what the KV pool holds where it does not fit (resolved_config.py)
        max_model_len = load_model_config(path).max_position_embeddings
        kwargs.setdefault("fit_max_model_len", True)
    if max_num_batched_tokens is None:
        on_gpu = kwargs.get("device", "cpu") == "cuda"
        max_num_batched_tokens = _DEFAULT_GPU_BATCHED_TOKENS if on_gpu else _DEFAULT_CPU_BATCHED_TOKENS
    unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown LLM arguments: {sorted(unknown)}")
    return EngineConfig(
        model=path,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        **kwargs,
    )


class LLM(PoolingMethods):
    """Batch generation with a paged KV cache.

    Args:
        model: a ``.gguf`` file, a Hugging Face folder or a Hugging Face
            repo id (``org/repo``, ``org/repo:Q4_K_M`` for a GGUF repo;
            ``revision=``, ``gguf_file=``); None loads the bundled
            SmolLM2-135M-Instruct.
        max_model_len: longest prompt + output; None takes the model's, lowered
            (with a warning) to what the KV cache holds where one sequence of it
            does not fit (``fit_max_model_len``); a value given that does not fit
            is refused.
        max_num_batched_tokens: token budget per step; longer prompts are
            prefilled in chunks. None takes 2048 on the CPU (measured best
            for throughput there: activations stay in cache, BENCHMARKS.md)
            and 8192 on a GPU.
        **kwargs: any other ``EngineConfig`` field (block_size, num_kv_blocks,
            kv_cache_memory_bytes, max_num_seqs, enable_prefix_caching, dtype,
            kv_cache_dtype, device, seed, attention_backend, num_threads, quantization,
            quantization_group_size, linear_backend, enforce_eager, batch_invariant, tokenizer), and vLLM's
            ``dtype="auto"``, ``gpu_memory_utilization`` and ``trust_remote_code``
            (``engine/vllm_args.py``; docs/coming-from-vllm.md).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        config = make_engine_config(
            model, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, **kwargs
        )
        self.llm_engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this engine started (nothing to do in one process); no call may follow."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def weight_bytes(self) -> int:
        """Bytes the loaded model holds in memory (weights as stored for its linear method, RoPE tables)."""
        return self.llm_engine.model_runner.weight_bytes

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, as vLLM's ``LLM.reset_prefix_cache``; an idle pool gives their pages back."""
        self.llm_engine.reset_prefix_cache()

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache tensor (every block of the pool, K and V, every layer)."""
        return self.llm_engine.model_runner.kv_cache_bytes

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling a request gets when it sets nothing, as vLLM's: ``SamplingParams()`` with the model's
        defaults (its ``generation_config.json`` or GGUF ``general.sampling.*``; none with
        ``generation_config="vllm"``)."""
        return self.llm_engine.generation_defaults.sampling_params()

    def get_tokenizer(self) -> Any:
        """The underlying Hugging Face tokenizer."""
        return self.llm_engine.tokenizer.hf

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, ``{"prompt": str}`` or ``{"prompt_token_ids":
        [...]}``. Every prompt is validated before any is queued, so a bad
        one raises ValueError and leaves nothing behind.
        """
        if self.llm_engine.config.runner == "pooling":
            raise ValueError("a runner='pooling' LLM embeds and scores; generate needs runner='generate'")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(
                f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        # what a request leaves unset takes the model's defaults (generation_config.json); its own values win
        defaults = self.llm_engine.generation_defaults
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [defaults.apply(sampling_params)] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts"
                )
            for p in params_list:
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            params_list = [defaults.apply(p) for p in params_list]
        engine = self.llm_engine
        # validated (and tokenized, once) before anything is queued
        prompts = self._validated(prompts, params_list)
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                rid = engine.new_request_id()
                engine.add_request(rid, prompt, params)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            engine.abort_request(ids)
            raise

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        reasoning_effort: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one or many conversations, then generate.

        ``tools``: function tools in OpenAI's form, for the template to list
        (as vLLM's ``LLM.chat``); the output is text, read for calls by the
        server's ``tool_parsers``, not here. A gpt-oss (harmony) model's
        conversations are rendered by openai-harmony instead of the template
        (``harmony/prompt.py``), with ``reasoning_effort`` (``low``,
        ``medium``, ``high``), and stop at ``<|return|>`` / ``<|call|>``;
        ``reasoning_parsers.parse_reply`` splits such an output's tokens into
        reasoning, content and calls.

        A message's ``content`` may be a list of parts, as in OpenAI's API: its
        text parts are joined by newlines (as vLLM does); an image or other
        media part is a ValueError (the model reads text only).
        ``chat_template_kwargs``: more variables for the template, e.g.
        ``{"enable_thinking": False}`` for Qwen3.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = messages if isinstance(messages[0], list) else [messages]
        conversations = [_text_messages(c) for c in conversations]
        if chat_template is None and self._is_harmony():
            return self._harmony_chat(conversations, sampling_params, use_tqdm, tools, reasoning_effort)
        prompts = [
            self.llm_engine.tokenizer.apply_chat_template(
                c, add_generation_prompt, chat_template, tools=tools, chat_template_kwargs=chat_template_kwargs
            )
            for c in conversations
        ]
        # the template already holds the BOS/special tokens it wants
        token_prompts = [
            {"prompt": p, "prompt_token_ids": self.llm_engine.tokenizer.encode(p, add_special_tokens=False)}
            for p in prompts
        ]
        return self.generate(token_prompts, sampling_params, use_tqdm)

    def _is_harmony(self) -> bool:
        from pagedllm.harmony.detect import is_harmony_model

        arch = self.llm_engine.model_config
        template = getattr(self.llm_engine.tokenizer.hf, "chat_template", None)
        return is_harmony_model(arch.architecture, arch.architectures, template if isinstance(template, str) else None)

    def _harmony_chat(
        self, conversations: list[list[dict[str, Any]]], sampling_params: SamplingParams | SequenceABC[SamplingParams]
        | None, use_tqdm: bool, tools: list[dict[str, Any]] | None, reasoning_effort: str | None,
    ) -> list[RequestOutput]:
        """``chat`` for a harmony model: openai-harmony's prompt tokens, harmony's stop tokens added.

        A ``thinking_token_budget`` binds the analysis channel: harmony's markers replace the
        ``think_*`` ones, and the prompt opens the analysis message (``harmony/thinking.py``;
        its text is the output's ``prompt``, for ``parse_reply(..., prompt_text=out.prompt)``).
        """
        from pagedllm.harmony import thinking
        from pagedllm.harmony.prompt import render_prompt
        from pagedllm.harmony.vocab import harmony_encoding

        for c in conversations:
            if not isinstance(c, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in c):
                raise ValueError("each conversation must be a list of {'role': str, 'content': str} dicts")
        rendered = [render_prompt(c, tools, reasoning_effort) for c in conversations]
        stops = set(harmony_encoding().stop_tokens_for_assistant_actions())
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        many = not isinstance(sampling_params, SamplingParams)
        params = [
            p.model_copy(update={"stop_token_ids": sorted(set(p.stop_token_ids or ()) | stops)})
            if isinstance(p, SamplingParams) else p
            for p in (sampling_params if many else [sampling_params])
        ]
        if many and len(params) != len(rendered):
            raise ValueError(f"{len(params)} sampling params for {len(rendered)} conversations")
        prompts: list[dict[str, Any]] = []
        for i, ids in enumerate(rendered):
            p = params[i if many else 0]
            if isinstance(p, SamplingParams) and p.thinking_token_budget is not None:
                thinking.set_budget_markers(p)  # a copy (above): the caller's params are left as they were
                ids = thinking.open_analysis(ids)
                prompts.append({"prompt": harmony_encoding().decode(ids), "prompt_token_ids": ids})
            else:
                prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, params if many else params[0], use_tqdm)

    def beam_search(
        self, prompts: PromptType | SequenceABC[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt; beams share KV blocks and fork copy-on-write.

        Scoring and stopping follow transformers' ``generate(num_beams=...,
        length_penalty=...)``. Each output lists up to ``beam_width`` finished
        beams, best first.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        engine = self.llm_engine
        prompts = self._validated(prompts)
        ids: list[str] = []
        try:
            for prompt in prompts:
                rid = engine.new_request_id()
                engine.add_beam_search_request(rid, prompt, params)
                ids.append(rid)
            outs = self._run(ids, use_tqdm)
        except BaseException:
            engine.abort_request(ids)
            raise
        results = []
        for out in outs:
            scores = out.metrics["beam_scores"]
            results.append(
                BeamSearchOutput(
                    [
                        BeamSearchSequence(
                            tokens=out.prompt_token_ids + c.token_ids,
                            text=c.text,
                            cum_logprob=c.cumulative_logprob,
                            score=score,
                            finish_reason=c.finish_reason,
                            num_output_tokens=len(c.token_ids),
                        )
                        for c, score in zip(out.outputs, scores)
                    ]
                )
            )
        return results

    def _validated(
        self, prompts: list[PromptType], params: list[SamplingParams] | None = None
    ) -> list[dict[str, Any]]:
        """Each prompt as {"prompt", "prompt_token_ids"}; ValueError on the first bad one."""
        out = []
        for i, prompt in enumerate(prompts):
            if params is not None and not isinstance(params[i], SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(params[i]).__name__}")
            if params is not None and params[i].output_kind is RequestOutputKind.DELTA:
                # generate returns each request's last output: with deltas that would be its last piece
                raise ValueError("output_kind DELTA is for streaming clients (LLMEngine.step); generate returns "
                                 "whole outputs")
            text, token_ids = self.llm_engine.process_prompt(prompt, None if params is None else params[i])
            if params is not None:
                self.llm_engine.logits_rules(params[i])  # vocabulary checks, before anything is queued
                self.llm_engine.compile_grammar(params[i])  # a bad constraint too (compiled once: cached)
            out.append({"prompt": text, "prompt_token_ids": token_ids})
        return out

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(done) < len(request_ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
                if not engine.has_unfinished_requests() and len(done) < len(request_ids):
                    raise RuntimeError("the engine went idle before every request finished")
        finally:
            bar.close()
        outputs = [done[rid] for rid in request_ids]
        failed = [out for out in outputs if out.error is not None]
        if failed:
            # the others ran to the end; they travel with the error, not lost with it
            raise RequestFailedError(
                f"{len(failed)} of {len(outputs)} requests failed; the first: {failed[0].error}", outputs
            )
        return outputs


def _text_messages(conversation: object) -> object:
    """A conversation with each message's list-of-parts ``content`` joined into its text (``chat_content.py``);
    anything else is left for the template's own checks."""
    if not isinstance(conversation, list):
        return conversation
    out = []
    for i, message in enumerate(conversation):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message = {**message, "content": content_text(message["content"], f"messages[{i}].content")}
        out.append(message)
    return out


class RequestFailedError(RuntimeError):
    """Some requests of a ``generate`` call failed on their own inside a step.

    ``outputs`` holds every request's output in prompt order: the failed ones
    have ``error`` set (and finish_reason "abort"), the others are complete.
    """

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs
