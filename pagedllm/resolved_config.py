"""Every "auto" of an ``EngineConfig`` resolved, once, for this machine: ``resolve_config``.

``EngineConfig`` records what was asked; several fields may leave the choice to the engine ("auto" or
None: the attention and linear backends, the executor, the all-reduce, batch invariance, prefix caching, the int4 group
size, the latency target, the KV cache's dtype). ``resolve_config`` takes each of those choices here, in
one place, from the config, the device and what this machine's build offers (the native kernels,
oneDNN), and returns a frozen ``ResolvedConfig`` holding no "auto". The runner, the layers, the ``env``
report and ``/metrics`` read that record; none of them re-derives a choice. A combination the engine
cannot run (``batch_invariant=True`` where a kernel picks its order by shape) is refused here too, with a
ValueError, before any weight is read.

The one choice that needs the weights, the KV cache's dtype under "auto" (float16 where a GGUF file's
blocks are kept), is taken by ``resolve_kv_cache_dtype`` in this module once the runner knows that fact.

``all_reduce_backend`` is resolved here from what the launch tells this process (``_shm_refusal``): an
``mp`` launch puts every rank on this machine, torchrun's ``LOCAL_WORLD_SIZE`` says whether it did. What
one process cannot see is the other ranks themselves (another host's name, a rank whose kernels failed
to load): each rank resolves for itself, and when they meet (``distributed/launch.py: join_group``) they
only check their answers agree and share one host, refusing with a ValueError on every rank otherwise;
they choose nothing there.

torch and the kernels are imported inside the functions: the config module and the engine's
bookkeeping import this module's types without them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

from pagedllm.config_record import PositiveFloat, PositiveInt, config_record

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

ResolvedAttention = Literal["cpu_paged", "sdpa", "reference"]
ResolvedLinear = Literal["packed", "onednn", "torch", "int8", "int4"]
ResolvedExecutor = Literal["mp", "torchrun"]
ResolvedAllReduce = Literal["shm", "gloo"]
ResolvedKvCacheDtype = Literal["float32", "bfloat16", "float16", "int8", "int4", "fp8", "fp8_e4m3", "fp8_e5m2"]
# weights per group of int4 when quantization_group_size is None; int8 defaults to one group per channel
DEFAULT_INT4_GROUP_SIZE = 128
# a hybrid model's periodic state snapshot points when state_snapshot_interval is None, in tokens (rounded down
# to a multiple of block_size): the reasoning is in the block manager's docstring and docs/hybrid-models.md
DEFAULT_STATE_SNAPSHOT_INTERVAL = 1024


@config_record
class ResolvedConfig:
    """The engine's choices, each resolved (no "auto", no None standing for a default).

    Attributes:
        attention_backend: the attention backend every layer runs.
        linear_backend: what the linear layers run: "packed", "onednn" or
            "torch" for float weights, "int8" / "int4" for weight-only ones
            (a GGUF file's blocks run their own kernels whatever this says).
        distributed_executor_backend: how tensor-parallel ranks start.
        all_reduce_backend: how tensor-parallel ranks sum partial results:
            "shm" (shared memory, every rank on this machine) or "gloo" (the
            process group: gloo, or NCCL on a GPU; also one rank, which sums
            nothing).
        batch_invariant: whether every request is computed alike in any batch.
        prefix_caching: whether identical prompt prefixes share KV blocks.
        weight_group_size: weights per group of int8 / int4 (None: one
            group per output channel, int8's default, or no weight-only
            quantization).
        itl_target_ms: a fixed latency target of steps with prompt tokens
            while decodes run; None: none given (see ``itl_auto``).
        itl_auto: the target follows the measured decode steps (4x theirs).
        state_snapshot_interval: tokens between a hybrid model's periodic state snapshot points, a multiple
            of the block size (0: none; ``state_snapshot_interval``).
    """

    attention_backend: ResolvedAttention
    linear_backend: ResolvedLinear
    distributed_executor_backend: ResolvedExecutor
    all_reduce_backend: ResolvedAllReduce
    batch_invariant: bool
    prefix_caching: bool
    weight_group_size: PositiveInt | None
    itl_target_ms: PositiveFloat | None
    itl_auto: bool
    state_snapshot_interval: int


def _compute_dtype(config: EngineConfig) -> str:
    """What activations are computed in: ``dtype``, except bf16 on the CPU (only the linears multiply bf16)."""
    return "float32" if config.device == "cpu" and config.dtype == "bfloat16" else config.dtype


def _attention_backend(config: EngineConfig) -> str:
    if config.attention_backend != "auto":
        return config.attention_backend
    if config.device == "cpu" and _compute_dtype(config) == "float32":
        from pagedllm.kernels import kernels_available

        if kernels_available():
            return "cpu_paged"
    return "sdpa"


def _linear_backend(config: EngineConfig) -> str:
    if config.quantization in ("int8", "int4"):
        return config.quantization
    if config.linear_backend != "auto":
        return config.linear_backend
    if config.device != "cpu" or _compute_dtype(config) != "float32":
        return "torch"
    from pagedllm.kernels import load_kernels
    from pagedllm.layers.quantization.onednn_linear import onednn_available, onednn_bf16_supported
    from pagedllm.layers.quantization.packed_linear import packed_linear_bf16_native

    bf16 = config.dtype == "bfloat16"
    # float32: our packed-panel kernel measured 1.17-1.56x oneDNN at 1-64 rows here, oneDNN 2-4x MKL;
    # bf16: ours in vector code (AVX512-BF16's dot product, or AVX2 widening bf16 in registers);
    # oneDNN only where it has bf16 kernels (AVX-512), else its reorder raises
    if load_kernels() is not None and (not bf16 or packed_linear_bf16_native()):
        return "packed"
    if onednn_available() and (not bf16 or onednn_bf16_supported()):
        return "onednn"
    return "torch"


def _executor(config: EngineConfig) -> str:
    if config.distributed_executor_backend != "auto":
        return config.distributed_executor_backend
    from pagedllm.distributed.launch import launched_by_torchrun

    return "torchrun" if launched_by_torchrun() else "mp"


def _shm_refusal(config: EngineConfig, executor: str) -> str | None:
    """Why the ranks cannot sum through shared memory, as far as this process can tell (None: they can).

    The ranks share memory only on one machine: an ``mp`` launch starts every rank here; a ``torchrun``
    launch says so when its ``LOCAL_WORLD_SIZE`` (ranks on this node) equals ``WORLD_SIZE`` (without
    it, a hand-set ``RANK`` / ``WORLD_SIZE``, nothing says where the other ranks run).
    """
    from pagedllm.kernels import kernels_available

    if config.device != "cpu":
        return "needs device='cpu' (GPU ranks sum through NCCL)"
    if not kernels_available() or not os.path.isdir("/dev/shm"):
        return "needs the native kernels and /dev/shm on this machine"
    if executor == "torchrun" and os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):
        return ("needs every rank on this machine, and torchrun's LOCAL_WORLD_SIZE "
                f"({os.environ.get('LOCAL_WORLD_SIZE', 'unset')}) is not its WORLD_SIZE "
                f"({os.environ.get('WORLD_SIZE', 'unset')})")
    return None


def _all_reduce(config: EngineConfig, executor: str) -> str:
    """"auto": "shm" where ``_shm_refusal`` finds nothing against it, else "gloo"; "shm" refused (ValueError)
    where it finds something. One rank sums nothing: "gloo", whatever was asked."""
    if config.tensor_parallel_size == 1 or config.all_reduce_backend == "gloo":
        return "gloo"
    refusal = _shm_refusal(config, executor)
    if refusal is not None and config.all_reduce_backend == "shm":
        raise ValueError(f"all_reduce_backend='shm' {refusal}")
    return "gloo" if refusal is not None else "shm"


def _batch_invariant_refusals(config: EngineConfig, attention: str, linear: str) -> dict[str, tuple[bool, str]]:
    """What ``batch_invariant`` cannot cover: field -> (whether this config has it, why)."""
    return {
        "device": (config.device != "cpu", "the invariant kernels are CPU code"),
        "dtype": (config.dtype == "float16", "float16 runs torch's linears, which pick their kernels by shape"),
        # two ranks: each element of an all-reduce is one addition, the same bits in either order; more
        # ranks: rank order only through shared memory, which takes steps of up to 256 tokens
        "tensor_parallel_size": (
            config.tensor_parallel_size > 2
            and not (config.all_reduce_backend == "shm" and config.max_num_batched_tokens <= 256),
            "more than two ranks sum in a fixed (rank) order only through shared memory: use "
            "all_reduce_backend='shm' and max_num_batched_tokens <= 256",
        ),
        "attention_backend": (attention != "cpu_paged",
                              f"it resolves to {attention!r}: torch's attention picks its kernel by shape "
                              "(use 'auto' or 'cpu_paged', with the native kernels built)"),
        "linear_backend": (linear not in ("packed", "int8", "int4"),
                           f"it resolves to {linear!r}: oneDNN / MKL pick their kernels by shape (use 'auto' or "
                           "'packed', with the native kernels built)"),
    }


def _batch_invariant(config: EngineConfig, attention: str, linear: str) -> bool:
    """None: on wherever every kernel on the path computes a row alike in any batch; True: ValueError where
    one does not; False: off."""
    refusals = _batch_invariant_refusals(config, attention, linear)
    if config.batch_invariant is None:
        return not any(refused for refused, _ in refusals.values())
    if config.batch_invariant:
        for name, (refused, why) in refusals.items():
            if refused:
                raise ValueError(f"batch_invariant=True does not cover {name}={getattr(config, name)!r}: {why}")
    return config.batch_invariant


def weight_group_size(config: EngineConfig) -> int | None:
    """The group size of "int8" / "int4" once the default is resolved (None: one group per channel)."""
    if config.quantization_group_size is None and config.quantization == "int4":
        return DEFAULT_INT4_GROUP_SIZE
    return config.quantization_group_size


def state_snapshot_interval(config: EngineConfig) -> int:
    """Tokens between a hybrid model's periodic state snapshot points once the default is resolved (0: none).

    None: ``DEFAULT_STATE_SNAPSHOT_INTERVAL`` rounded down to a multiple of ``block_size``, at least one block.
    """
    if config.state_snapshot_interval is not None:
        return config.state_snapshot_interval
    bs = config.block_size
    return max(bs, DEFAULT_STATE_SNAPSHOT_INTERVAL // bs * bs)


def prefix_caching(config: EngineConfig) -> bool:
    """Whether prefix caching is on: ``enable_prefix_caching``, None meaning on for the paged allocator."""
    return config.kv_allocator == "paged" if config.enable_prefix_caching is None else config.enable_prefix_caching


def resolve_config(config: EngineConfig) -> ResolvedConfig:
    """Every choice ``config`` leaves open, taken for this machine; ValueError for a combination the engine
    cannot run. The engine calls it once, when it starts, and keeps the record (``LLMEngine.resolved_config``,
    ``ModelRunner.resolved``); the answer depends only on the config and this process's build (the native
    kernels load once per process)."""
    attention = _attention_backend(config)
    linear = _linear_backend(config)
    target = config.itl_target_ms
    executor = _executor(config)
    return ResolvedConfig(
        attention_backend=attention,
        linear_backend=linear,
        distributed_executor_backend=executor,
        all_reduce_backend=_all_reduce(config, executor),
        batch_invariant=_batch_invariant(config, attention, linear),
        prefix_caching=prefix_caching(config),
        weight_group_size=weight_group_size(config),
        itl_target_ms=None if target in ("auto", None) else float(target),
        itl_auto=target == "auto",
        state_snapshot_interval=state_snapshot_interval(config),
    )


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, keeps_gguf_blocks: bool) -> str:
    """What the KV cache stores (``EngineConfig.kv_cache_dtype``), "auto" resolved once the weights' format is known.

    "auto" is the model's ``dtype``, except where the weights stay GGUF blocks: float16 there, llama.cpp's
    default cache for the same file. The blocks already round the weights far coarser than float16 rounds
    K and V, and decode attention reads half the bytes.
    """
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "float16" if keeps_gguf_blocks else dtype


# --- the KV pool and max_model_len, once the weights' bytes are known -----------------------------------------

# the pool's budget when neither num_kv_blocks nor kv_cache_memory_bytes is given: on the CPU the pool is
# address space backed page by page as blocks are written (runner/kv_cache.py), so it may name half of what
# the weights leave: the other half stays for activations, the torch runtime and the rest of the machine
# (llama.cpp's --fit leaves a fixed margin free in the same spirit; vLLM's GPU default takes 90%)
DEFAULT_KV_SHARE = 0.5
# a GPU's pool is allocated whole, at once: a quarter of its free memory, at most 2 GiB
GPU_KV_SHARE = 0.25
GPU_KV_CAP_BYTES = 2 << 30
# the shortest context fitting lowers max_model_len to: below this the engine refuses to start, as a context
# of a few hundred tokens is rarely what was meant (llama.cpp's --fit has such a floor too, --fit-ctx)
MIN_FIT_MAX_MODEL_LEN = 2048


@config_record
class KvPoolPlan:
    """How large the KV pool is and how long a sequence may grow, resolved once the weights are loaded.

    Attributes:
        num_kv_blocks: blocks in the pool.
        max_model_len: the longest sequence the engine takes: the config's, or lower where
            ``fit_max_model_len`` fitted it to the pool.
        budget_bytes: the memory the pool was sized from (``kv_cache_memory_bytes`` or the default
            share of free memory); None where ``num_kv_blocks`` was given.
        requested_max_model_len: the config's ``max_model_len`` (the model's context where it was
            not given), kept to report a lowered one.
    """

    num_kv_blocks: PositiveInt
    max_model_len: PositiveInt
    budget_bytes: int | None
    requested_max_model_len: PositiveInt

    @property
    def lowered(self) -> bool:
        """Whether ``max_model_len`` was lowered to fit the pool."""
        return self.max_model_len < self.requested_max_model_len


def default_kv_budget(available_bytes: int, weight_bytes: int, lazy: bool = True) -> int:
    """The pool's budget when none is given: ``DEFAULT_KV_SHARE`` of the memory the weights leave where the
    pool is resident only where written (``lazy``: the CPU's), else (a GPU's, allocated whole) a quarter
    of it, at most 2 GiB.

    ``available_bytes`` is measured before the weights are loaded and ``weight_bytes`` is what the loaded
    model holds, so the budget follows the weights' real resident size (int4 blocks leave more room than
    float32 weights).
    """
    left = max(0, available_bytes - weight_bytes)
    if lazy:
        return int(left * DEFAULT_KV_SHARE)
    return min(int(left * GPU_KV_SHARE), GPU_KV_CAP_BYTES)


def kv_pool_blocks(
    config: EngineConfig, bytes_per_block: int, available_bytes: int, weight_bytes: int, lazy: bool = True,
    num_groups: int = 1,
) -> tuple[int, int | None]:
    """``(blocks, budget bytes or None)``: ``num_kv_blocks`` if given, else what the budget holds.

    The default budget (``default_kv_budget``) names no more blocks than ``max_num_seqs`` sequences of
    ``max_model_len`` tokens can ever hold at once: a small model's blocks are a few KiB, and a pool of
    millions of them would only cost the block manager's bookkeeping. A model with ``num_groups`` KV cache
    groups (``kv_groups.py``: sliding windows) holds a block table per group, and a window group keeps
    every block of a prompt its step computes at once, so a sequence may hold up to ``num_groups`` times
    its length's blocks. On the CPU each of
    ``tensor_parallel_size`` ranks (``weight_bytes``: its slice) measures the same free memory, so each
    takes its share of the default, not the whole of it.
    """
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, None
    budget = config.kv_cache_memory_bytes
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    if budget is None:
        ranks = config.tensor_parallel_size if lazy else 1  # a GPU rank has a GPU of its own
        budget = default_kv_budget(available_bytes, ranks * weight_bytes, lazy) // ranks
        return max(1, min(budget // bytes_per_block, config.max_num_seqs * num_groups * blocks_per_seq)), budget
    return max(1, budget // bytes_per_block), budget


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def fit_max_model_len(config: EngineConfig, num_blocks: int, bytes_per_block: int) -> int:
    """The longest sequence the engine takes with a pool of ``num_blocks``: ``max_model_len`` where one
    sequence of it fits; else, with ``fit_max_model_len``, the tokens the whole pool holds (a multiple of
    ``block_size``), where that is at least ``MIN_FIT_MAX_MODEL_LEN`` or the pool's size was given
    (``num_kv_blocks`` / ``kv_cache_memory_bytes``: the floor guards the default only). ValueError
    otherwise, naming the flags that change it."""
    requested = config.max_model_len
    needed = -(-requested // config.block_size)
    if num_blocks >= needed:
        return requested
    fitted = num_blocks * config.block_size
    pool_given = config.num_kv_blocks is not None or config.kv_cache_memory_bytes is not None
    if config.fit_max_model_len and (fitted >= MIN_FIT_MAX_MODEL_LEN or pool_given):
        return fitted
    # the ways out, with the flags of the commands and the arguments of LLM
    fix = ("pass a smaller --max-model-len (max_model_len=), or give the cache more memory with "
           "--kv-cache-memory-bytes (kv_cache_memory_bytes=) or --num-kv-blocks (num_kv_blocks=)")
    if config.fit_max_model_len:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks of {config.block_size} tokens ({fitted} tokens, "
            f"{_gib(num_blocks * bytes_per_block)}), not one sequence of max_model_len={requested}, and "
            f"max_model_len is lowered to fit no further than {MIN_FIT_MAX_MODEL_LEN} tokens; {fix}"
        )
    raise ValueError(
        f"max_model_len={requested} does not fit: one sequence needs {needed} KV blocks of {config.block_size} "
        f"tokens ({_gib(needed * bytes_per_block)}), the KV cache has room for {num_blocks} "
        f"({_gib(num_blocks * bytes_per_block)}); {fix}"
    )


def plan_kv_pool(
    config: EngineConfig, num_blocks: int, budget_bytes: int | None, bytes_per_block: int
) -> KvPoolPlan:
    """The pool of ``num_blocks`` (``kv_pool_blocks``, the same on every tensor-parallel rank) and the
    ``max_model_len`` it holds (``fit_max_model_len``)."""
    return KvPoolPlan(
        num_kv_blocks=num_blocks,
        max_model_len=fit_max_model_len(config, num_blocks, bytes_per_block),
        budget_bytes=budget_bytes,
        requested_max_model_len=config.max_model_len,
    )


def replica_kv_budget(config: EngineConfig, num_replicas: int, available_bytes: int, file_bytes: int) -> int | None:
    """The KV budget each of ``num_replicas`` data-parallel replicas on this machine gets where the config
    leaves the pool to the default (None: it does not, or one replica).

    Each replica would otherwise measure the same free memory (a pool takes none until written) and reserve
    the default share of it for itself, N times over: here the share of what N copies of the weights
    (``file_bytes`` each, the model's files: an estimate made before any replica loads) leave is split
    evenly.
    """
    if num_replicas <= 1 or config.num_kv_blocks is not None or config.kv_cache_memory_bytes is not None:
        return None
    return max(1, default_kv_budget(available_bytes, num_replicas * file_bytes, config.device == "cpu")
               // num_replicas)
