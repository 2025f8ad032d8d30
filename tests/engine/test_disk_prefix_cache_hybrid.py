"""The prefix cache on disk for hybrid models (tiny random LFM2 and Qwen3.5): states beside the K/V blocks.

A hybrid model's disk hit needs the state after its last block: each state
snapshot is written to a state store of its own (its folder's fingerprint
holds the state layout) under the hash of the block it follows, and a lookup
is cut to the longest prefix whose last block has a state (docs/hybrid-models.md).
The reference of every engine comparison is an engine without a cache folder
that computes the whole prompt; a new engine on the folder plays a restarted
server.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.block_manager import extend_block_hashes
from pagedllm.engine.sequence import Sequence
from pagedllm.kv_disk.open_store import open_state_disk_store
from pagedllm.runner.state_slot_bytes import read_state_bytes, state_slot_nbytes, write_state_bytes

BLOCK = 4
ENGINE = dict(block_size=BLOCK, num_kv_blocks=200, max_model_len=256, kv_cache_dtype="float32", max_num_seqs=4)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
FIRST = 41  # its state is snapshotted after 40 tokens (its last full block), and written to disk
TAIL = 9


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


FIRST_IDS = _prompt(FIRST, 0)
NEXT_IDS = FIRST_IDS + _prompt(TAIL, 1)  # the next turn: extends the first prompt
HIT = (FIRST - 1) // BLOCK  # blocks: the first prompt's snapshot point


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5"])
def folder(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_dir")


def _run(llm: LLM, ids: list[int]) -> tuple[list[int], list[float], int]:
    """Tokens, their logprobs, and the prompt tokens this request computed (checked against the tokens its
    output reports cached); the stores flushed after."""
    engine = llm.llm_engine
    before = engine.num_prompt_tokens_computed
    request = llm.generate([{"prompt_token_ids": ids}], PARAMS, use_tqdm=False)[0]
    out = request.outputs[0]
    for store in (engine.kv_disk, engine.state_disk):
        if store is not None:
            store.flush()
    computed = engine.num_prompt_tokens_computed - before
    assert request.num_cached_tokens == len(ids) - computed
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)], computed


def _idle(llm: LLM) -> bool:
    bm = llm.llm_engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and bm.state_slots.num_used == 0


@pytest.fixture(scope="module")
def reference(folder: str) -> tuple[list[int], list[float]]:
    """The next turn's tokens and logprobs computed whole (no cache folder)."""
    llm = LLM(folder, **ENGINE)
    tokens, logprobs, computed = _run(llm, NEXT_IDS)
    assert computed == len(NEXT_IDS)
    return tokens, logprobs


@pytest.fixture(scope="module")
def warm(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder an engine wrote the first prompt's blocks and its state snapshot into."""
    cache_dir = tmp_path_factory.mktemp("kv-cache-dir-hybrid")
    llm = LLM(folder, kv_cache_dir=str(cache_dir), **ENGINE)
    _, _, computed = _run(llm, FIRST_IDS)
    assert computed == FIRST
    engine = llm.llm_engine
    assert engine.state_disk is not None and engine.state_disk.dir != engine.kv_disk.dir
    assert engine.kv_disk.num_writes >= HIT and engine.state_disk.num_writes == 1
    chain = extend_block_hashes([], (FIRST_IDS[i : i + BLOCK] for i in range(0, HIT * BLOCK, BLOCK)))
    assert engine.state_disk.path(chain[-1]).is_file()  # the state after 40 tokens, under block 10's hash
    assert _idle(llm)
    engine.shutdown()
    return cache_dir


def _state_file(engine, ids: list[int]) -> Path:  # noqa: ANN001
    """The state file of ``ids``' snapshot point (after ``HIT`` blocks) in ``engine``'s state store."""
    chain = extend_block_hashes([], (ids[i : i + BLOCK] for i in range(0, HIT * BLOCK, BLOCK)))
    return engine.state_disk.path(chain[-1])


def _copy(warm: Path, tmp_path: Path) -> Path:
    """A copy of the warm folder: each test's engine writes its own snapshots, the others keep the first's only."""
    cache_dir = tmp_path / "copy"
    shutil.copytree(warm, cache_dir)
    return cache_dir


def test_a_new_engine_starts_the_next_turn_from_disk(folder: str, warm: Path, reference: tuple,
                                                      tmp_path: Path) -> None:
    llm = LLM(folder, kv_cache_dir=str(_copy(warm, tmp_path)), **ENGINE)
    engine = llm.llm_engine
    bm = engine.block_manager
    assert bm.num_cached_prefix_tokens(Sequence(NEXT_IDS, BLOCK)) == HIT * BLOCK
    tokens, logprobs, computed = _run(llm, NEXT_IDS)
    assert computed == len(NEXT_IDS) - HIT * BLOCK  # the K/V of 10 blocks and the state after them from disk
    assert tokens == reference[0]
    assert logprobs == pytest.approx(reference[1], abs=1e-4)
    assert engine.kv_disk.num_hits == HIT and engine.state_disk.num_hits == 1
    assert engine.state_disk.num_writes == 1  # the next turn's own snapshot (after 48 tokens); none read back
    assert _idle(llm)
    engine.shutdown()


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_bad_state_file_is_recomputed(folder: str, warm: Path, reference: tuple, tmp_path: Path,
                                        damage: str) -> None:
    llm = LLM(folder, kv_cache_dir=str(_copy(warm, tmp_path)), **ENGINE)
    engine = llm.llm_engine
    path = _state_file(engine, NEXT_IDS)
    if damage == "corrupt":
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x55
        path.write_bytes(bytes(raw))
    else:
        path.unlink()
    tokens, logprobs, computed = _run(llm, NEXT_IDS)
    assert computed == len(NEXT_IDS)  # no state at any block boundary: computed from position 0
    assert tokens == reference[0]
    assert logprobs == pytest.approx(reference[1], abs=1e-4)
    assert engine.state_disk.num_corrupt == (damage == "corrupt")
    assert engine.state_disk.num_hits == 0 and engine.kv_disk.num_hits == 0
    assert _idle(llm)
    engine.shutdown()


def test_the_state_store_fingerprint_holds_the_state_layout(folder: str, warm: Path) -> None:
    llm = LLM(folder, kv_cache_dir=str(warm), **ENGINE)
    engine = llm.llm_engine
    runner = engine.model_runner
    shapes = runner.state_shapes
    try:
        # one state layer's shape other than the model's: another folder, never this one's files
        i = next(i for i, s in enumerate(shapes) if s is not None)
        runner.state_shapes = [*shapes[:i], tuple((*s[:-1], s[-1] + 1) for s in shapes[i]), *shapes[i + 1:]]
        other = open_state_disk_store(engine.config, engine.model_config, runner)
    finally:
        runner.state_shapes = shapes
    assert other.dir != engine.state_disk.dir and other.dir.parent == engine.state_disk.dir.parent
    other.close()
    engine.shutdown()


def test_state_slot_bytes_round_trip() -> None:
    # an attention layer (None) between two state layers of one and two tensors, 3 slots each
    src = [(torch.randn(3, 2, 5),), None, (torch.randn(3, 4), torch.randn(3, 2, 2, 3))]
    dst = [None if layer is None else tuple(torch.zeros_like(t) for t in layer) for layer in src]
    blobs = read_state_bytes(src, [2, 0])
    assert [len(b) for b in blobs] == [state_slot_nbytes(src)] * 2 == [4 * (10 + 4 + 12)] * 2
    write_state_bytes(dst, [(1, blobs[0]), (0, blobs[1])])
    for s_layer, d_layer in zip(src, dst):
        for s, d in zip(s_layer or (), d_layer or ()):
            assert torch.equal(d[1], s[2]) and torch.equal(d[0], s[0]) and not d[2].any()
    with pytest.raises(ValueError, match="bytes, a slot of these state layers has"):
        write_state_bytes(dst, [(0, blobs[0][:-4])])
