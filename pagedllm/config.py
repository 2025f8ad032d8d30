"""The engine's one configuration record, validated when it is built.

Each field's type declares what it takes (``Literal`` choices, positive
numbers, non-empty paths: ``config_record.py``) and pydantic checks every
field against it, so a choice is written once, in the type, and the tuples
other modules import (``DTYPES``, ...) are read off it. What fields say about
each other is checked after that, in ``__post_init__``. The command-line flags
are generated from these fields and the ``Attributes:`` of the docstring
(``entrypoints/arg_fields.py``).

Values the engine computes while it starts (the number of KV blocks, the EOS
ids) are not written back here; they live on the objects that compute them
(``ModelRunner.num_kv_blocks``, ``Tokenizer.eos_token_ids``).
"""

from __future__ import annotations

import os
from typing import Annotated, Literal, get_args

from pydantic import BeforeValidator

from pagedllm.config_record import (
    NonEmptyStr,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    config_record,
    positive_multiple_of,
)
from pagedllm.distributed.cpu_bind import parse_cpu_bind
from pagedllm.pooler_config import PoolerConfig
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.structured_output.limits import GrammarLimits

Path = NonEmptyStr

# the choices of each string field: the field's type says them, these tuples are read off it
Dtype = Literal["float32", "bfloat16", "float16"]
KvCacheDtype = Literal["auto", "float32", "bfloat16", "float16", "int8", "int4", "fp8", "fp8_e4m3", "fp8_e5m2"]
Device = Literal["cpu", "cuda"]
AttentionBackend = Literal["auto", "cpu_paged", "sdpa", "reference"]
KvAllocator = Literal["paged", "contiguous"]
ContiguousReserve = Literal["max_tokens", "max_model_len"]
Quantization = Literal["none", "int8", "int4"]
GgufActivations = Literal["int8", "float32"]
LinearBackend = Literal["auto", "packed", "onednn", "torch"]
DistributedExecutor = Literal["auto", "mp", "torchrun"]
AllReduceBackend = Literal["auto", "shm", "gloo"]
Runner = Literal["generate", "pooling"]
Convert = Literal["auto", "embed", "classify", "score"]

DTYPES = get_args(Dtype)
KV_CACHE_DTYPES = get_args(KvCacheDtype)
DEVICES = get_args(Device)
ATTENTION_BACKENDS = get_args(AttentionBackend)
KV_ALLOCATORS = get_args(KvAllocator)
CONTIGUOUS_RESERVES = get_args(ContiguousReserve)
QUANTIZATIONS = (None, *get_args(Quantization))
GGUF_ACTIVATIONS = get_args(GgufActivations)
LINEAR_BACKENDS = get_args(LinearBackend)
DISTRIBUTED_EXECUTORS = get_args(DistributedExecutor)
ALL_REDUCE_BACKENDS = get_args(AllReduceBackend)


def _check_itl_target(value: object) -> object:
    """``itl_target_ms``: "auto", None or a positive number of milliseconds."""
    if value in ("auto", None):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"itl_target_ms must be 'auto', None or a positive number of milliseconds, got {value!r}")
    return float(value)


ItlTarget = Annotated[PositiveFloat | Literal["auto"] | None, BeforeValidator(_check_itl_target)]
GroupSize = Annotated[int | None, positive_multiple_of(32, optional=True)]
SpeculativeField = Annotated[SpeculativeConfig | None, BeforeValidator(SpeculativeConfig.parse)]
PoolerField = Annotated[PoolerConfig | None, BeforeValidator(PoolerConfig.parse)]


@config_record
class EngineConfig:
    """Everything needed to start an engine.

    Attributes:
        model: path of a GGUF file or a Hugging Face model folder, or a
            Hugging Face repo id ("org/repo"; a GGUF repo as llama.cpp names
            it, "org/repo:Q4_K_M"), fetched through huggingface_hub's cache
            (HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN). A local path wins over
            a repo id; the engine keeps the resolved local path here.
        revision: the branch, tag or commit of a model named by repo id;
            None: "main".
        gguf_file: the GGUF file to load among several in a repo or a local
            folder (a split file by its first part); None: the one the repo id's
            ":QUANT" tag names, or the only one (else Q4_K_M).
        tokenizer: tokenizer folder or repo id; None takes the model's own.
        tokenizer_revision: the branch, tag or commit of a tokenizer named by
            repo id; None: "main".
        dtype: weights and activations dtype, "float32" (default), "bfloat16"
            or "float16". On the CPU, "bfloat16" rounds every weight to bf16
            but computes only the linear layers with bf16 operands (float32
            sums); activations between them stay float32 and the KV cache
            (``kv_cache_dtype="auto"``) stores bf16. Fast where the CPU has
            AVX512-BF16; see ``layers/quantization/bf16_linear.py``.
        device: "cpu" or "cuda".
        kv_cache_dtype: what the KV cache stores: "auto" (default: ``dtype``,
            except float16 where a GGUF file's blocks are kept, llama.cpp's
            default cache; resolved by ``resolve_kv_cache_dtype`` once the weights load),
            or "float32", "float16", "bfloat16". A 2-byte cache with float32
            activations halves the cache's memory (twice the blocks for the
            same bytes) and the bytes decode attention reads; K and V are
            rounded when written (float16 saturating at +-65504), so outputs
            differ slightly from a float32 cache. "int8" (CPU): each token's
            K and V per KV head as int8 with one float32 scale (max|x| / 127,
            symmetric; ``layers/kv_quant.py``), quantized when written and
            read in place by the attention kernels: about 1.9x the blocks of
            float16 for the same bytes (head_dim 64: 68 bytes a head row
            against 128). "int4" (CPU): each token's K and V per KV head
            rotated by a Walsh-Hadamard transform of the head dimension, then
            as 4-bit values in [-7, 7] with one float32 scale (max / 7;
            ``layers/kv_quant.py``), in a uint8 cache: 3.56x the blocks of
            float16 at head_dim 64 (36 bytes a head row), read in place (the
            kernel rotates the query and its output); needs an even
            head_dim. Less exact than int8: on the bundled SmolLM2-135M the
            perplexity of GPL-3's text rises by 12% (int8: 0.7%;
            docs/configuration.md). "fp8_e4m3" / "fp8_e5m2" (CPU, every x86
            variant): int8's layout with fp8 values (OCP E4M3FN, max 448; E5M2, max
            57344) scaled so each head's max|x| is the format's largest,
            rounded to nearest even; "fp8" is "fp8_e4m3", as in vLLM. Same
            rules as int8: +-inf saturates, a NaN makes its head read NaN.
            Attention still computes in ``dtype``.
        block_size: token slots per KV block.
        num_kv_blocks: exact pool size; overrides ``kv_cache_memory_bytes``.
        kv_cache_memory_bytes: memory for the KV pool; None picks a share of
            free memory (on the CPU half of what the weights leave, reserved and
            resident only where written; on a GPU a quarter, at most 2 GiB).
        max_model_len: longest sequence (prompt + output) in tokens.
        fit_max_model_len: lower max_model_len to what the KV pool holds, with a
            warning, where one sequence of it does not fit (llama.cpp's ``--fit``),
            rather than refuse to start. ``LLM`` and the commands turn it on where
            ``max_model_len`` is not given (the model's context is the start).
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens computed in one step; a prompt
            longer than what is left of it is prefilled in chunks over
            several steps (chunked prefill).
        itl_target_ms: how long a step that computes prompt tokens may keep
            running decodes waiting (their inter-token latency), in
            milliseconds: while sequences decode, a step takes only as many
            prompt tokens as fit this target by the step costs measured so
            far (``engine/step_budget.py``), so a long prompt prefills over
            more, shorter steps instead of freezing every stream. "auto"
            (default): 4x the measured step of the decodes alone, and at
            least 32 prompt tokens a step (a 4k prompt among 4 streams of the
            bundled model: 1.1-1.4x its time alone); None: no target, a
            step takes up to ``max_num_batched_tokens`` whatever it delays.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes;
            None means on for the paged allocator, off for the contiguous one.
        state_snapshot_interval: tokens between a hybrid model's periodic
            prefix-cache state snapshots, a multiple of ``block_size`` (0:
            none; None, the default: 1024, rounded down to a multiple of
            ``block_size``). With prefix caching, a prompt's state is also
            kept every this many tokens of its prefill (its last 4 such
            points, at most a quarter of the snapshot pool), so the second
            prompt sharing a system prompt with a cached one already hits it
            up to the last such point inside it, not only the third
            (docs/hybrid-models.md). A model without state layers refuses a
            value (it keeps no state to snapshot).
        kv_cache_dir: a folder where full prefix blocks are also kept on
            disk, named by their hash chain under a fingerprint of the model
            and KV format (docs/disk-prefix-cache.md): a prompt whose prefix
            RAM no longer holds (evicted, or the server restarted) reads its
            blocks back instead of recomputing them. None (default): off.
            Needs prefix caching and one process (no tensor parallelism).
        kv_cache_dir_max_bytes: the most bytes of block files the folder
            keeps (least recently used go first); None: unbounded.
        kv_allocator: "paged" (PagedAttention: blocks on demand) or
            "contiguous" (the baseline: one run reserved per request).
        contiguous_reserve: what a contiguous run covers: "max_tokens"
            (prompt + max_tokens, or max_model_len when max_tokens is None) or
            "max_model_len" (as when the output length is unknown).
        seed: seed of the random stream of requests that bring no seed.
        runner: "generate" (text generation) or "pooling" (embeddings,
            classification and scores: docs/pooling.md), as vLLM's ``--runner``.
        convert: what a pooling runner makes of the model (vLLM's
            ``--convert``): "embed" (vectors), "classify" (a
            sequence-classification head), "score" (a causal LM as a yes/no
            reranker, Qwen3-Reranker's) or "auto" ("classify" for a
            ``*ForSequenceClassification`` checkpoint, else "embed").
        pooler_config: a pooling runner's pooling type, normalisation and
            Matryoshka size, over what the checkpoint declares: a dict or
            JSON text (``pooler_config.py``).
        generation_config: where the default sampling settings come from
            (vLLM's ``--generation-config``): "auto" (default) the model's
            own, its ``generation_config.json`` (a GGUF file: its
            ``general.sampling.*`` metadata): temperature, top_p, top_k,
            min_p, repetition_penalty and max_new_tokens (as max_tokens);
            "vllm" ignores them (``SamplingParams``' own defaults); a folder
            path reads ``generation_config.json`` from there. A request's own
            values win; what it leaves unset takes these
            (``loader/generation_defaults.py``). The model's end-of-turn
            tokens stop generation whatever this says.
        attention_backend: "auto" (default: "cpu_paged" for float32 on the
            CPU when its native kernel builds, else "sdpa"), "cpu_paged"
            (decode reads KV blocks in place), "sdpa" (decode through torch
            SDPA on a gathered copy) or "reference" (plain per-sequence torch,
            for testing).
        num_threads: torch intra-op threads; None keeps torch's default.
        quantization: None (the checkpoint's own: a GGUF file's quantized
            tensors stay in their blocks where the native CPU kernels take
            their type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16), the
            rest in ``dtype``), "none" (every weight in ``dtype``: GGUF blocks
            dequantized at load), "int8" or "int4": weight-only, every linear
            layer and the token embedding rounded at load to int8 (symmetric)
            or int4 (asymmetric: a scale and a minimum) in groups of
            ``quantization_group_size`` inputs with float32 scales, and only
            those blocks kept (``layers/quantization/quantized_linear.py``); CPU only,
            activations in float32. A GGUF file's tensors are dequantized
            first and rounded again (a warning says so when they were
            quantized). Outputs differ slightly from the float model.
        quantization_group_size: weights per group of "int8" / "int4", a
            positive multiple of 32; None: 128 for int4, one group per output
            channel for int8. A layer whose in_features it does not divide
            takes the largest multiple of 32 below it that does (a warning
            names the layers), e.g. 96 for SmolLM2's 576 with 128.
        gguf_activations: what layers held in quantized blocks (a GGUF
            file's, and quantization="int8" / "int4") multiply: "int8"
            (default, llama.cpp's way: each row rounded to int8 per block of
            32 inputs, and the blocks, interleaved 16 rows at a time at load,
            multiplied with integer dot products, ``kernels/gguf_x16.h``;
            2-3x faster for one sequence) or "float32" (the blocks' own
            order, float32 activations: what transformers computes on the
            dequantized weights). int8 moves a
            token's log-probability by ~0.07 on average with the same
            perplexity (measured on the bundled model, docs/models-and-formats.md).
        linear_backend: "auto" (default: "packed" for float32 on the CPU
            when the native kernels build, and for bfloat16 when they do on a
            CPU with AVX512-BF16; else "onednn" when torch has oneDNN, else
            "torch"), "packed" (our kernel over weights packed once into
            column panels), "onednn" (weights packed once into oneDNN's
            layout) or "torch" (``F.linear``).
        enforce_eager: run every step through the model's modules; False
            (default) replays decode steps from graphs recorded from the
            model's own forward, without the Python between its kernels
            (``runner/capture/captured_decode.py``; CPU, ``cpu_paged`` attention).
        capture_min_decode_steps: when the decode step is traced: at the
            first step whose requests may still decode this many steps (their
            ``max_tokens``, or up to ``max_model_len``), or when the server
            starts (it always captures before serving). Until then decode
            steps run the modules. The trace costs about 4 s and ~150 MB in a
            fresh process (torch's tracer and sympy are imported for it) and
            saves ~7 ms per step on the bundled model, so it pays after some
            hundreds of steps, not for a 16-token ``pagedllm generate``.
            0: at the first decode step. Ignored under tensor parallelism
            (every rank captures at the first decode step, in step).
        tensor_parallel_size: ranks the model is split over (Megatron-style:
            attention by KV-head groups, the MLP by intermediate rows, the
            vocabulary by rows; ``pagedllm/distributed/``). Each rank is a
            process holding its slice of the weights and of every KV block.
        distributed_executor_backend: how ranks start: "auto" (default:
            "torchrun" inside a torchrun launch, else "mp"), "mp" (this
            process is rank 0 and spawns the others on this machine) or
            "torchrun" (torchrun started every rank, on one or more machines).
        cpu_bind: the cores of each rank, ranks separated by "|", e.g.
            "0-3|4-7" (as vLLM's ``VLLM_CPU_OMP_THREADS_BIND``); None: no
            binding. With ``num_threads`` None a rank runs one thread per
            bound core (unbound: this machine's cores / tensor_parallel_size).
        distributed_timeout_s: the longest any rank waits in one collective
            of a step (or rank 0 for a worker to take a step) before the
            engine stops with an error: a hung rank fails, not deadlocks.
        all_reduce_backend: how tensor-parallel ranks sum partial results:
            "auto" (default: through shared memory when every rank is on
            this machine, for steps of up to 256 tokens; the process group
            (gloo, NCCL) otherwise), "shm" (the same, refused when the ranks
            are not on one machine) or "gloo" (the process group always).
        grammar_limits: what one structured-output constraint may cost (its
            size, entries, depth and properties; compile time, memory and
            compiles at once) and the compiled-grammar cache's bytes
            (``structured_output/limits.py``); over a limit is a ValueError.
        batch_invariant: compute every request the same way whatever else
            the engine runs (docs/batch-invariance.md): a request's tokens,
            logprobs and prompt logprobs are bitwise the same alone or in
            any batch, however its prompt is chunked, after a prefix-cache
            hit or a preemption, captured or eager. Every prompt token's
            attention then reads the cache in the decode kernel's order
            (``kernels/attention/paged_prefill.cpp``) instead of the prefill kernel's
            tiles. None ("auto", the default): on wherever it can be, that is
            on the CPU, one or two ranks, float32 or bfloat16 weights, the native
            kernels built, ``cpu_paged`` attention and the packed or
            quantized-block linears (GGUF blocks and int8/int4 on either
            activations); off elsewhere. True where it cannot be
            is a ValueError when the engine starts (``resolve_config``, before
            the weights load); False turns it off.
        speculative_config: speculative decoding (docs/speculative-decoding.md):
            a ``SpeculativeConfig``, or a dict / JSON text with vLLM's keys,
            e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_min": 1, "prompt_lookup_max": 4}`` or
            ``{"method": "suffix"}``; None: off.
    """

    model: Path
    revision: NonEmptyStr | None = None
    gguf_file: NonEmptyStr | None = None
    tokenizer: Path | None = None
    tokenizer_revision: NonEmptyStr | None = None
    dtype: Dtype = "float32"
    device: Device = "cpu"
    kv_cache_dtype: KvCacheDtype = "auto"
    block_size: PositiveInt = 16
    num_kv_blocks: PositiveInt | None = None
    kv_cache_memory_bytes: PositiveInt | None = None
    max_model_len: PositiveInt = 2048
    fit_max_model_len: bool = False
    max_num_seqs: PositiveInt = 128
    max_num_batched_tokens: PositiveInt = 8192
    itl_target_ms: ItlTarget = "auto"
    enable_prefix_caching: bool | None = None
    state_snapshot_interval: NonNegativeInt | None = None
    kv_cache_dir: Path | None = None
    kv_cache_dir_max_bytes: PositiveInt | None = None
    kv_allocator: KvAllocator = "paged"
    contiguous_reserve: ContiguousReserve = "max_tokens"
    seed: int = 0
    generation_config: NonEmptyStr = "auto"
    attention_backend: AttentionBackend = "auto"
    num_threads: PositiveInt | None = None
    quantization: Quantization | None = None
    quantization_group_size: GroupSize = None
    gguf_activations: GgufActivations = "int8"
    linear_backend: LinearBackend = "auto"
    enforce_eager: bool = False
    capture_min_decode_steps: NonNegativeInt = 512
    tensor_parallel_size: PositiveInt = 1
    distributed_executor_backend: DistributedExecutor = "auto"
    cpu_bind: str | None = None
    distributed_timeout_s: PositiveFloat = 120.0
    all_reduce_backend: AllReduceBackend = "auto"
    grammar_limits: GrammarLimits = GrammarLimits()
    batch_invariant: bool | None = None
    speculative_config: SpeculativeField = None
    runner: Runner = "generate"
    convert: Convert = "auto"
    pooler_config: PoolerField = None

    @property
    def weight_group_size(self) -> int | None:
        """The group size of "int8" / "int4" once the default is resolved (None: one group per channel)."""
        # imported here: the resolver imports this module's types
        from pagedllm.resolved_config import weight_group_size

        return weight_group_size(self)

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on, once the default is resolved."""
        from pagedllm.resolved_config import prefix_caching

        return prefix_caching(self)

    def __post_init__(self) -> None:
        if self.runner != "pooling" and (self.convert != "auto" or self.pooler_config is not None):
            raise ValueError("convert and pooler_config apply to runner='pooling' only")
        # pydantic checked each field against its declared type (choices, positive numbers, paths) and made
        # speculative_config's dict or JSON text the record; here: what fields say about each other
        if self.speculative_config is not None and self.kv_allocator != "paged":
            raise ValueError("speculative_config needs kv_allocator='paged' (drafts take and return blocks)")
        if self.kv_allocator == "paged" and self.contiguous_reserve != "max_tokens":
            raise ValueError("contiguous_reserve applies to kv_allocator='contiguous' only")
        if self.kv_allocator == "contiguous" and self.enable_prefix_caching:
            raise ValueError("the contiguous allocator has no prefix caching; leave enable_prefix_caching unset")
        if self.kv_cache_dir is not None or self.kv_cache_dir_max_bytes is not None:
            self._check_kv_cache_dir()
        if self.state_snapshot_interval is not None:
            self._check_snapshot_interval()
        if self.quantization in ("int8", "int4"):
            self._check_weight_only()
        elif self.quantization_group_size is not None:
            raise ValueError("quantization_group_size applies to quantization='int8' or 'int4' only, "
                             f"got quantization={self.quantization!r}")
        if self.linear_backend in ("packed", "onednn") and (self.device != "cpu" or self.dtype == "float16"):
            raise ValueError(f"linear_backend={self.linear_backend!r} runs float32 or bfloat16 weights on the CPU only")
        if self.cpu_bind is not None:
            parse_cpu_bind(self.cpu_bind, self.tensor_parallel_size)
        if self.kv_cache_dtype in ("int8", "int4", "fp8", "fp8_e4m3", "fp8_e5m2") and self.device != "cpu":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is a CPU cache (the CPU kernels quantize and "
                             f"read its blocks); use a float kv_cache_dtype with device={self.device!r}")
        if (self.num_kv_blocks is not None and not self.fit_max_model_len
                and self.num_kv_blocks * self.block_size < self.max_model_len):
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks} of {self.block_size} tokens cannot hold one "
                f"sequence of max_model_len={self.max_model_len}; raise num_kv_blocks or lower max_model_len"
            )

    def _check_kv_cache_dir(self) -> None:
        """ValueError for what kv_cache_dir cannot run with."""
        if self.kv_cache_dir is None:
            raise ValueError("kv_cache_dir_max_bytes bounds kv_cache_dir: set kv_cache_dir too")
        if not self.prefix_caching:
            raise ValueError("kv_cache_dir keeps prefix-cache blocks: it needs prefix caching (the paged allocator, "
                             "enable_prefix_caching not False)")
        if self.tensor_parallel_size > 1:
            raise ValueError("kv_cache_dir runs in one process; tensor_parallel_size > 1 splits each block's heads "
                             "over ranks")
        if os.path.exists(self.kv_cache_dir) and not os.path.isdir(self.kv_cache_dir):
            raise ValueError(f"kv_cache_dir={str(self.kv_cache_dir)!r} exists and is not a folder")

    def _check_snapshot_interval(self) -> None:
        """ValueError for a state_snapshot_interval the block manager cannot use."""
        if self.state_snapshot_interval % self.block_size:
            raise ValueError(f"state_snapshot_interval={self.state_snapshot_interval} must be a multiple of "
                             f"block_size={self.block_size} (a snapshot is kept at the end of a block)")
        if not self.prefix_caching:
            raise ValueError("state_snapshot_interval places prefix-cache state snapshots: it needs prefix caching "
                             "(the paged allocator, enable_prefix_caching not False)")

    def _check_weight_only(self) -> None:
        """ValueError for what quantization='int8' / 'int4' cannot run."""
        q = self.quantization
        if self.device != "cpu":
            raise ValueError(f"quantization={q!r} runs on the CPU only (its kernel is native CPU code)")
        if self.dtype != "float32":
            raise ValueError(f"quantization={q!r} computes in float32; leave dtype at 'float32', got {self.dtype!r}")
        if self.linear_backend != "auto":
            raise ValueError(f"linear_backend applies to float weights; with quantization={q!r} every linear layer "
                             f"runs the quantized kernel: leave it at 'auto', got {self.linear_backend!r}")

