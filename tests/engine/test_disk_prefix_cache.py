"""The prefix cache on disk (``--kv-cache-dir``): blocks outlive RAM eviction and the engine.

The reference of every engine comparison is a run that read nothing from
disk (it computed the whole prompt); the engine is batch-invariant, so a
prompt computed with a cached prefix gives the same bits as computed whole
(docs/batch-invariance.md) and tokens and logprobs compare exactly. The
store's own tests need no model: files are written, damaged and bounded by hand.
"""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.block_manager import extend_block_hashes
from pagedllm.kv_disk import store as store_module
from pagedllm.kv_disk.block_file import BlockFileError, decode_block, encode_block
from pagedllm.kv_disk.store import DiskBlockStore

BLOCK = 4
PAYLOAD = 64
FP = {"model": "m", "kv": "float32"}
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)


def payload_of(h: int) -> bytes:
    return bytes((h * 7 + i) % 256 for i in range(PAYLOAD))


def tokens_of(h: int) -> tuple[int, ...]:
    return tuple(range(h, h + BLOCK))


def fill(store: DiskBlockStore, hashes: range) -> None:
    for h in hashes:
        store.write(h, tokens_of(h), payload_of(h))
    store.flush()


# --- the store, no model -----------------------------------------------------
def test_block_file_round_trip_and_damage():
    data = encode_block(5, tokens_of(5), payload_of(5))
    assert decode_block(data, 5, tokens_of(5)) == payload_of(5)
    with pytest.raises(BlockFileError, match="header says"):
        decode_block(data[:-3], 5, tokens_of(5))  # torn
    flipped = bytearray(data)
    flipped[40] ^= 1
    with pytest.raises(BlockFileError, match="checksum"):
        decode_block(bytes(flipped), 5, tokens_of(5))
    with pytest.raises(BlockFileError, match="token ids"):
        decode_block(data, 5, (9, 9, 9, 9))  # same hash, other tokens: a collision is a miss
    with pytest.raises(BlockFileError, match="another block"):
        decode_block(data, 6, tokens_of(5))


def test_damaged_and_foreign_files_are_misses(tmp_path: Path):
    store = DiskBlockStore(tmp_path, FP, PAYLOAD)
    fill(store, range(1, 5))
    assert store.read_chain([1, 2], [tokens_of(1), tokens_of(2)]) == [payload_of(1), payload_of(2)]
    store.path(2).write_bytes(store.path(2).read_bytes()[:-10])  # truncated
    raw = bytearray(store.path(3).read_bytes())
    raw[-20] ^= 0xFF  # corrupted
    store.path(3).write_bytes(bytes(raw))
    assert store.read_chain([1, 2, 3], [tokens_of(h) for h in (1, 2, 3)]) == [payload_of(1)]
    assert store.read_chain([3], [tokens_of(3)]) == []
    assert (store.num_corrupt, store.num_misses) == (2, 2)
    assert not store.path(2).exists() and not store.path(3).exists()  # removed, to be written again
    # another fingerprint (another model or KV format) is another folder: nothing there
    other = DiskBlockStore(tmp_path, {**FP, "kv": "int8"}, PAYLOAD)
    assert other.dir != store.dir and not other.contains(1)
    assert other.read_chain([1], [tokens_of(1)]) == []
    # a file of another fingerprint copied in: its payload size or its bytes give it away
    os.link(store.path(4), other.path(4))
    assert DiskBlockStore(tmp_path, {**FP, "kv": "int4"}, PAYLOAD // 2).read_chain([4], [tokens_of(4)]) == []
    for s in (store, other):
        s.close()


def test_byte_bound_evicts_least_recently_used(tmp_path: Path):
    file_bytes = len(encode_block(0, tokens_of(0), payload_of(0)))
    store = DiskBlockStore(tmp_path, FP, PAYLOAD, max_bytes=5 * file_bytes)
    fill(store, range(1, 5))
    for h in range(1, 5):  # distinct, ordered mtimes: 1 oldest
        os.utime(store.path(h), (1000 + h, 1000 + h))
    assert store.read_chain([1], [tokens_of(1)]) == [payload_of(1)]  # 1 is now the most recently used
    fill(store, range(5, 9))
    names = sorted(p.name for p in store.dir.glob("*.kvb"))
    assert len(names) == 5 and store.num_evictions == 3
    assert sum(p.stat().st_size for p in store.dir.glob("*.kvb")) <= 5 * file_bytes
    assert store.contains(1) and not any(store.contains(h) for h in (2, 3, 4))
    store.close()
    # a restart under a lower bound evicts at once
    smaller = DiskBlockStore(tmp_path, FP, PAYLOAD, max_bytes=2 * file_bytes)
    assert len(list(smaller.dir.glob("*.kvb"))) == 2
    smaller.close()


def test_two_stores_writing_one_folder(tmp_path: Path):
    stores = [DiskBlockStore(tmp_path, FP, PAYLOAD) for _ in range(2)]
    # both write the same blocks at once (the same prompt on two servers), and some of their own
    threads = [threading.Thread(target=fill, args=(s, range(100 * i, 100 * i + 150))) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hashes = list(range(0, 250))
    for s in stores:
        assert s.read_chain(hashes, [tokens_of(h) for h in hashes]) == [payload_of(h) for h in hashes]
        assert s.num_corrupt == 0
        s.close()
    assert not list(stores[0].dir.glob("*.tmp")) and len(list(stores[0].dir.glob("*.kvb"))) == 250


def test_full_disk_turns_writing_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    store = DiskBlockStore(tmp_path, FP, PAYLOAD)
    fill(store, range(1, 3))

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_module, "open", full, raising=False)
    fill(store, range(3, 6))
    assert store.writes_disabled is not None and "No space" in store.writes_disabled
    assert len([r for r in caplog.records if "no longer written" in r.getMessage()]) == 1
    assert not list(store.dir.glob("*.tmp")) and not store.contains(3)
    assert store.read_chain([1, 2], [tokens_of(1), tokens_of(2)]) == [payload_of(1), payload_of(2)]  # reads go on
    store.close()


def test_config_refusals(tmp_path: Path):
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(model="m", kv_cache_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="set kv_cache_dir"):
        EngineConfig(model="m", kv_cache_dir_max_bytes=10)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        EngineConfig(model="m", kv_cache_dir=str(tmp_path / "f"))


# --- engines on a tiny model ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer) -> str:  # noqa: ANN001
    from conftest import save_tiny_models

    return save_tiny_models(("llama",), tmp_path_factory, smollm_tokenizer)["llama"]


def make_llm(model: str, cache_dir: Path | None, num_kv_blocks: int = 600, max_model_len: int = 1024) -> LLM:
    return LLM(model=model, block_size=BLOCK, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
               batch_invariant=True, kv_cache_dir=None if cache_dir is None else str(cache_dir))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def run(llm: LLM, ids: list[int]) -> tuple[list[int], list[float], int]:
    """Tokens, their logprobs, and the prompt tokens this request computed."""
    engine = llm.llm_engine
    before = engine.num_prompt_tokens_computed
    out = llm.generate([{"prompt_token_ids": ids}], PARAMS, use_tqdm=False)[0].outputs[0]
    if engine.kv_disk is not None:
        engine.kv_disk.flush()
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)], \
        engine.num_prompt_tokens_computed - before


@pytest.fixture(scope="module")
def warm(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One engine that computed a 901-token prompt whole, writing its blocks to a fresh folder."""
    cache_dir = tmp_path_factory.mktemp("kv-cache-dir")
    llm = make_llm(tiny_llama, cache_dir)
    ids = prompt(901, 0)
    tokens, logprobs, computed = run(llm, ids)
    assert computed == 901
    stats = llm.llm_engine.kv_disk
    # the prompt's 225 full blocks, and the one its first generated tokens filled
    assert stats.num_writes == 226 and stats.num_hits == 0
    llm.llm_engine.shutdown()
    return {"dir": cache_dir, "ids": ids, "tokens": tokens, "logprobs": logprobs}


def test_a_new_engine_reads_the_prefix_from_disk(tiny_llama: str, warm: dict):
    llm = make_llm(tiny_llama, warm["dir"])
    tokens, logprobs, computed = run(llm, warm["ids"])
    assert (tokens, logprobs) == (warm["tokens"], warm["logprobs"])
    assert computed == 901 - 225 * BLOCK  # the prefill skipped every cached block
    disk = llm.llm_engine.kv_disk
    assert disk.num_hits == 225 and disk.num_writes == 0 and disk.bytes_read > 0
    llm.llm_engine.shutdown()


def test_damaged_files_are_recomputed(tiny_llama: str, warm: dict, tmp_path: Path):
    # a copy of the folder, so the module's other tests keep theirs whole
    cache_dir = tmp_path / "copy"
    for src in warm["dir"].rglob("*"):
        if src.is_file():
            dst = cache_dir / src.relative_to(warm["dir"])
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    llm = make_llm(tiny_llama, cache_dir)
    disk = llm.llm_engine.kv_disk
    bm = llm.llm_engine.block_manager
    chain = extend_block_hashes([], (warm["ids"][i : i + BLOCK] for i in range(0, 900, BLOCK)))
    raw = bytearray(disk.path(chain[100]).read_bytes())
    raw[len(raw) // 2] ^= 0x55
    disk.path(chain[100]).write_bytes(bytes(raw))
    tokens, logprobs, computed = run(llm, warm["ids"])
    assert (tokens, logprobs) == (warm["tokens"], warm["logprobs"])
    assert computed == 901 - 100 * BLOCK and disk.num_corrupt == 1 and disk.num_hits == 100
    assert bm.num_free_blocks == bm.num_blocks
    llm.llm_engine.shutdown()


def test_blocks_evicted_from_ram_come_back_from_disk(tiny_llama: str, tmp_path: Path):
    # a pool of 120 blocks holds one 401-token prompt: the second prompt evicts the first's cached blocks
    llm = make_llm(tiny_llama, tmp_path, num_kv_blocks=120, max_model_len=480)
    first, second = prompt(401, 1), prompt(401, 2)
    ref = run(llm, first)
    run(llm, second)
    tokens, logprobs, computed = run(llm, first)
    assert (tokens, logprobs) == ref[:2]
    assert computed < 401 // 2  # most blocks came from disk (RAM had evicted them)
    assert llm.llm_engine.kv_disk.num_hits >= 100 // 2
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "uint8", "float8_e4m3fn"])
def test_block_bytes_round_trip(dtype: str):
    import torch

    from pagedllm.runner.kv_block_bytes import block_nbytes, read_block_bytes, write_block_bytes

    dt = getattr(torch, dtype)
    # [2 (K, V), layers, blocks, block_size, kv heads, width]
    src = (torch.randn(2, 3, 5, BLOCK, 2, 6) * 20).to(dt)
    dst = torch.zeros_like(src)
    blobs = read_block_bytes(src, [3, 1])
    assert [len(b) for b in blobs] == [block_nbytes(src)] * 2
    write_block_bytes(dst, [(0, blobs[0]), (4, blobs[1])])
    as_bytes = (lambda t: t.view(torch.uint8)) if dt.itemsize == 1 else (lambda t: t)
    assert torch.equal(as_bytes(dst[:, :, 0]), as_bytes(src[:, :, 3]))
    assert torch.equal(as_bytes(dst[:, :, 4]), as_bytes(src[:, :, 1]))
    assert not as_bytes(dst[:, :, 1:4]).any()
    with pytest.raises(ValueError, match="bytes, a block of this pool has"):
        write_block_bytes(dst, [(0, blobs[0][:-1])])


def test_an_engine_on_a_full_disk_keeps_serving(tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_module, "open", full, raising=False)
    llm = make_llm(tiny_llama, tmp_path, num_kv_blocks=64, max_model_len=256)
    ids = prompt(41, 3)
    first = run(llm, ids)
    disk = llm.llm_engine.kv_disk
    assert disk.writes_disabled is not None and disk.num_writes == 0
    again = run(llm, ids)  # the RAM prefix cache still serves it
    assert again[:2] == first[:2] and again[2] == 1
    assert not list(disk.dir.glob("*.kvb")) and not list(disk.dir.glob("*.tmp"))
    llm.llm_engine.shutdown()
