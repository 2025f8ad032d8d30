"""Owns the model and the KV cache; turns a SchedulerOutput into sampled tokens."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.scheduler import ScheduledSequence, SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.kernels import load_kernels
from pagedllm.layers.attention import AttentionMetadata, make_backend
from pagedllm.layers.bf16_linear import use_bf16_linear
from pagedllm.layers.int8_linear import quantize_model_int8
from pagedllm.layers.native_ops import NativeOps
from pagedllm.layers.onednn_linear import onednn_available, onednn_bf16_supported, use_onednn_linear
from pagedllm.layers.packed_linear import packed_linear_bf16_native, use_packed_linear
from pagedllm.loader.model_config import ModelArchConfig
from pagedllm.models.registry import model_class
from pagedllm.runner.fused_decode import FusedDecode
from pagedllm.runner.input_batch import InputBatch
from pagedllm.runner.sampler import (
    Sampler,
    SamplingTensors,
    TokenLogprobs,
    logit_stats,
    token_logprobs,
)
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# when neither num_kv_blocks nor kv_cache_memory_bytes is given
_DEFAULT_KV_SHARE = 0.25
_DEFAULT_KV_CAP_BYTES = 2 << 30
_MIN_TEMPERATURE = 1e-5


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


class ModelRunner:
    """Loads the weights, allocates the KV cache once, runs steps.

    The cache is one tensor ``[2, num_layers, num_kv_blocks, block_size,
    num_kv_heads, head_dim]`` (K and V), zero-filled at start-up and never
    resized; ``num_kv_blocks`` is decided here and read by the engine.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelArchConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
    ) -> None:
        self.config = config
        self.model_config = model_config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device")
        self.dtype = _DTYPES[config.dtype]
        # what activations are computed in: the model's dtype, except bf16 on the CPU, where only
        # the linear layers multiply bf16 values and the rest stays float32 (layers/bf16_linear.py)
        self.bf16_matmul_only = self.device.type == "cpu" and self.dtype == torch.bfloat16
        self.compute_dtype = torch.float32 if self.bf16_matmul_only else self.dtype
        # what the cache stores ("auto": the model's dtype); resolved here, not in the config
        self.kv_cache_dtype = self.dtype if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype]
        self.backend = make_backend(config.attention_backend, self.device.type, self.compute_dtype)

        start = time.perf_counter()
        # built on the meta device: no time spent on random init of weights
        # that the checkpoint overwrites anyway
        with torch.device("meta"):
            model = model_class(model_config)(model_config, self.backend)
        model = model.to_empty(device="cpu")
        if model_config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.load_weights(weights)
        # every weight rounded to dtype once; with bf16 matmuls only, held as float32 after that (exact)
        model = model.to(device=self.device, dtype=self.dtype)
        self.model = model.to(dtype=self.compute_dtype).eval()
        # weights of the architecture (a tied embedding counted once), before any quantization
        self.num_params = sum(p.numel() for p in self.model.parameters())
        # "auto" resolved here; the decision lives on the runner, not in the config
        self.linear_backend = config.linear_backend
        if self.linear_backend == "auto":
            self.linear_backend = "torch"
            if self.device.type == "cpu" and self.compute_dtype == torch.float32:
                # float32: our packed-panel kernel measured 1.17-1.56x oneDNN at 1-64 rows here, oneDNN 2-4x MKL;
                # bf16: ours in vector code (AVX512-BF16's dot product, or AVX2 widening bf16 in
                # registers); oneDNN only where it has bf16 kernels (AVX-512), else its reorder raises
                if load_kernels() is not None and (not self.bf16_matmul_only or packed_linear_bf16_native()):
                    self.linear_backend = "packed"
                elif onednn_available() and (not self.bf16_matmul_only or onednn_bf16_supported()):
                    self.linear_backend = "onednn"
        self._warn_if_slow_half_precision()
        if config.quantization == "int8":
            quantize_model_int8(self.model, dense_backend=self.linear_backend)
        elif self.bf16_matmul_only:
            use_bf16_linear(self.model, self.linear_backend)
        elif self.linear_backend == "packed":
            use_packed_linear(self.model)
        elif self.linear_backend == "onednn":
            use_onednn_linear(self.model)
        # norms, RoPE and SiLU-and-multiply as single native calls where they build
        lib = load_kernels() if self.device.type == "cpu" and self.compute_dtype == torch.float32 else None
        self.native_ops = NativeOps(lib) if lib is not None else None
        self.model.use_native_ops(self.native_ops)
        # RoPE tables stay float32 whatever the model dtype
        self.model.model.rotary.float().build_tables()
        self.load_seconds = time.perf_counter() - start

        self.block_size = config.block_size
        self.num_kv_blocks = self._decide_num_kv_blocks()
        min_blocks = (config.max_model_len + self.block_size - 1) // self.block_size
        if self.num_kv_blocks < min_blocks:
            raise ValueError(
                f"the KV cache has room for {self.num_kv_blocks} blocks, fewer than one sequence of "
                f"max_model_len={config.max_model_len} needs ({min_blocks}); lower max_model_len or "
                "give the cache more memory"
            )
        mc = model_config
        # [2 (K, V), num_layers, num_kv_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            2, mc.num_hidden_layers, self.num_kv_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim,
            dtype=self.kv_cache_dtype, device=self.device,
        )
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(mc.num_hidden_layers)]
        self.sampler = Sampler()
        self.input_batch = InputBatch(self.block_size, self.device)
        # decode steps run the whole decoder in one native call (runner/fused_decode.py)
        # where its linear layers are int8 or packed panels; it reads the cache the
        # way cpu_paged does, so only with that backend, and only for the models it implements
        self.fused_decode: FusedDecode | None = None
        if (
            self.backend.name == "cpu_paged"
            and (config.quantization == "int8" or self.linear_backend == "packed")
            and FusedDecode.supports(self.model)
        ):
            self.fused_decode = FusedDecode(self.model, self.kv_caches, self.block_size)

    def _warn_if_slow_half_precision(self) -> None:
        """Say so when a 2-byte dtype on the CPU runs on a path far slower than float32."""
        if self.device.type != "cpu" or self.dtype == torch.float32:
            return
        fast = self.bf16_matmul_only and (
            (self.linear_backend == "packed" and packed_linear_bf16_native())
            or (self.linear_backend == "onednn" and onednn_bf16_supported())
        )
        if not fast:
            # measured here: a torch bf16 matmul on a Zen 3 core is ~300x slower than float32
            logger.warning(
                "dtype=%s on this CPU runs on a slow path (linear_backend=%s, no native bf16 kernel for it): "
                "expect it to be far slower than float32; dtype='float32' is the fast choice here",
                self.config.dtype, self.linear_backend,
            )

    # --- sizing --------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        elem = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        return 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * elem

    def _decide_num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = min(int(_available_memory_bytes(self.device) * _DEFAULT_KV_SHARE), _DEFAULT_KV_CAP_BYTES)
        return max(1, budget // self.kv_bytes_per_block)

    # --- one step ------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Build input ids, positions and attention metadata on the CPU (``runner/input_batch.py``).

        Sequences with more than one new token (prefills) go first, as the
        attention backends expect. The tensors are valid until the next call.
        """
        return self.input_batch.build(scheduled)

    @staticmethod
    def _temperature(p: SamplingParams) -> float:
        # below this, dividing logits by the temperature overflows: greedy
        return p.temperature if p.temperature >= _MIN_TEMPERATURE else 0.0

    def _draw_uniforms(self, rows: list[tuple[Sequence, SamplingParams]]) -> list[float]:
        """One uniform number per row from its sequence's own stream, drawn once per step.

        Greedy rows draw nothing, so they never disturb a seeded stream; the
        numbers are kept, so sampling a row again (alone, after a failure
        elsewhere in the batch) gives it the token it would have had.
        """
        return [seq.rng.random() if self._temperature(p) > 0 else 0.0 for seq, p in rows]

    def _sampling_tensors(self, rows: list[tuple[Sequence, SamplingParams]], uniforms: list[float]) -> SamplingTensors:
        vocab = self.model_config.vocab_size
        temps, top_ks, top_ps, min_ps = [], [], [], []
        for _, p in rows:
            temps.append(self._temperature(p))
            top_ks.append(min(p.top_k, vocab) if p.top_k > 0 else vocab)
            top_ps.append(p.top_p)
            min_ps.append(p.min_p)
        return SamplingTensors(
            temperatures=torch.tensor(temps, dtype=torch.float32),
            top_ks=torch.tensor(top_ks, dtype=torch.int64),
            top_ps=torch.tensor(top_ps, dtype=torch.float32),
            min_ps=torch.tensor(min_ps, dtype=torch.float32),
            uniforms=torch.tensor(uniforms, dtype=torch.float64),
            any_random=any(t > 0 for t in temps),
        )

    def _sample(
        self, logits: torch.Tensor, rows: list[tuple[Sequence, SamplingParams]], uniforms: list[float],
        num_top: list[int | None],
    ) -> list[TokenLogprobs]:
        """Sample one token per row of ``logits`` ``[len(rows), vocab]`` and score it."""
        stats = logit_stats(logits)
        tokens = self.sampler(logits, self._sampling_tensors(rows, uniforms), argmax=stats.argmax)
        return token_logprobs(logits, tokens, num_top, lse=stats.lse)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy K and V of every layer from source to destination blocks, in one op."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device)
        # kv_cache: [2, num_layers, num_kv_blocks, ...]; blocks are dim 2
        self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, params: list[SamplingParams], num_top: list[int | None]
    ) -> list[StepResult]:
        """Run one step. ``params[i]`` are the SamplingParams of ``output.scheduled[i]``,
        ``num_top[i]`` how many top candidates to report with each of its samples
        (None: the sampled token's logprob only).

        Returns one ``StepResult`` per scheduled sequence: a sampled token for
        it and for each of its forks when the step reaches its last token,
        and prompt logprobs when asked for.
        """
        self.copy_blocks(output.blocks_to_copy)
        order = sorted(range(len(output.scheduled)), key=lambda i: output.scheduled[i].num_new_tokens == 1)
        scheduled = [output.scheduled[i] for i in order]
        input_ids, positions, meta = self.prepare(scheduled)
        if self.fused_decode is not None and self.fused_decode.accepts(meta, input_ids.shape[0]):
            hidden = self.fused_decode(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)

        if len(params) != len(output.scheduled) or len(num_top) != len(output.scheduled):
            raise ValueError("execute needs one SamplingParams and one num_top per scheduled sequence")
        results = [StepResult() for _ in scheduled]
        self._sample_step(hidden, meta, scheduled, [params[i] for i in order], [num_top[i] for i in order], results)
        for i, s in enumerate(scheduled):
            p = params[order[i]]
            # every chunk that scores prompt tokens; a one-token prompt gets its empty list
            first_chunk = s.num_computed_tokens == 0
            if results[i].error is None and p.prompt_logprobs is not None and (
                first_chunk or s.num_computed_tokens < s.seq.num_prompt_tokens - 1
            ):
                try:
                    results[i].prompt_logprobs = self._prompt_logprobs(hidden, meta, i, s, p.prompt_logprobs)
                except Exception as e:  # this sequence's alone: the others keep theirs
                    results[i].error = e
                results[i].prompt_logprobs_start = s.num_computed_tokens + 1
        unordered: list[StepResult] = [StepResult()] * len(scheduled)
        for i, r in zip(order, results):
            unordered[i] = r
        return unordered

    def _sample_step(
        self, hidden: torch.Tensor, meta: AttentionMetadata, scheduled: list[ScheduledSequence],
        params: list[SamplingParams], num_top: list[int | None], results: list[StepResult],
    ) -> None:
        """Sample every sequence that reached its last token this step into ``results``.

        One batched call normally. If it raises, each scheduled sequence (with
        its forks) is sampled alone with the random numbers already drawn, so
        a failure caused by one request's settings lands in that sequence's
        ``StepResult.error`` and the others get the tokens they would have had.
        """
        rows: list[tuple[Sequence, SamplingParams]] = []  # one row per sample; forks reuse their parent's state
        row_num_top: list[int | None] = []
        hidden_rows: list[int] = []
        owners: list[int] = []  # the scheduled sequence of each row
        for i, s in enumerate(scheduled):
            if s.samples:
                for seq in (s.seq, *s.forks):
                    rows.append((seq, params[i]))
                    row_num_top.append(num_top[i])
                    hidden_rows.append(meta.query_start_loc[i + 1] - 1)
                    owners.append(i)
        if not rows:
            return
        uniforms = self._draw_uniforms(rows)
        index = torch.tensor(hidden_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[index]).cpu()  # [num_rows, vocab]
        try:
            samples = self._sample(logits, rows, uniforms, row_num_top)
        except Exception:
            logger.warning("sampling the batch failed; sampling its %d sequences one by one", len(set(owners)))
            samples = None
        if samples is not None:
            for owner, sample in zip(owners, samples):
                results[owner].samples.append(sample)
            return
        for i in sorted(set(owners)):
            mine = [r for r, owner in enumerate(owners) if owner == i]
            try:
                results[i].samples = self._sample(
                    logits[mine], [rows[r] for r in mine], [uniforms[r] for r in mine], [row_num_top[r] for r in mine]
                )
            except Exception as e:
                logger.exception("sequence %s failed while sampling", scheduled[i].seq.request_id)
                results[i].error = e

    def _prompt_logprobs(
        self, hidden: torch.Tensor, meta: AttentionMetadata, i: int, s: ScheduledSequence, num_top: int
    ) -> list[TokenLogprobs]:
        """Logprobs of the prompt tokens after this step's positions, each given the tokens before it.

        The step computes positions ``c .. c+k-1`` (a whole prompt, or one
        chunk of it); their logits score prompt tokens ``c+1 .. c+k``, those
        that exist.
        """
        first = s.num_computed_tokens
        last = min(first + s.num_new_tokens, s.seq.num_prompt_tokens - 1)  # exclusive
        start = meta.query_start_loc[i]
        logits = self.model.compute_logits(hidden[start : start + last - first]).cpu()  # [last - first, vocab]
        targets = torch.tensor(s.seq.token_ids[first + 1 : last + 1], dtype=torch.int64)
        return token_logprobs(logits, targets, [num_top] * len(targets))


@dataclass
class StepResult:
    """What one step produced for one scheduled sequence."""

    samples: list[TokenLogprobs] = field(default_factory=list)  # [seq, *forks] when it sampled
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 1  # the prompt position of prompt_logprobs[0]
    # set when this sequence alone failed (its sampling settings); the step's other results stand
    error: Exception | None = None
