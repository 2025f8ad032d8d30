"""Large weights materialised in transparent huge pages (``runner/huge_pages.py``): a 2 MiB-aligned start, the
``MADV_HUGEPAGE`` advice on the tensor's whole huge pages only (so its resident size is its own), torch's allocator
for the rest, and a GGUF model loaded that way holds the same blocks.
"""

from __future__ import annotations

import gc

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.kernels import load_kernels
from pagedllm.layers.attention import make_backend
from pagedllm.loader import iter_weights, load_model_config
from pagedllm.resolved_config import resolve_config
from pagedllm.runner.huge_pages import HUGE_PAGE_BYTES, empty_weight, huge_pages_available
from pagedllm.runner.model_loader import load_model

needs_linux = pytest.mark.skipif(not huge_pages_available(), reason="madvise(MADV_HUGEPAGE) is Linux's")


def _vma(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding ``address``: its fields, and "range" / "VmFlags"."""
    entry: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
                if inside:
                    entry = {"range": head}
            elif inside:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    return entry


@needs_linux
def test_a_large_tensor_starts_on_a_huge_page_and_asks_for_huge_pages() -> None:
    t = empty_weight((3 * HUGE_PAGE_BYTES // 4 + 1000, 2), (2, 1), torch.float16)
    assert t.shape == (3 * HUGE_PAGE_BYTES // 4 + 1000, 2) and t.stride() == (2, 1) and t.dtype == torch.float16
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    flags = _vma(t.data_ptr() + HUGE_PAGE_BYTES)["VmFlags"].split()
    assert "hg" in flags  # MADV_HUGEPAGE: the kernel may back it with 2 MiB pages
    assert "hg" not in _vma(t.data_ptr() + t.numel() * 2 - 1)["VmFlags"].split()  # the tail: small pages


@needs_linux
def test_the_resident_size_is_the_tensors_own_and_the_memory_outlives_its_mapping_object() -> None:
    num_bytes = 3 * HUGE_PAGE_BYTES + 12345
    t = empty_weight((num_bytes,), (1,), torch.uint8)
    t.fill_(7)  # every byte touched, the mapping's slack never
    gc.collect()  # the tensor alone holds the mapping
    assert int(t.sum()) == 7 * num_bytes
    advised = _vma(t.data_ptr())  # the whole huge pages, a mapping of their own once advised
    assert advised["range"] == f"{t.data_ptr():x}-{t.data_ptr() + 3 * HUGE_PAGE_BYTES:x}"
    assert int(advised["Rss"].split()[0]) * 1024 == 3 * HUGE_PAGE_BYTES  # huge pages or small, never more


def test_small_or_strided_tensors_come_from_torch() -> None:
    small = empty_weight((100, 64), (64, 1), torch.float32)
    assert small.shape == (100, 64) and small.stride() == (64, 1)
    strided = empty_weight((HUGE_PAGE_BYTES, 2), (1, HUGE_PAGE_BYTES), torch.float32)  # column-major: as asked
    assert strided.stride() == (1, HUGE_PAGE_BYTES) and strided.shape == (HUGE_PAGE_BYTES, 2)


@pytest.mark.skipif(load_kernels() is None, reason="GGUF blocks need the native build")
@needs_linux
def test_a_loaded_gguf_model_holds_its_large_blocks_in_huge_pages(smollm_path: str) -> None:
    config = EngineConfig(model=smollm_path)
    model_config = load_model_config(smollm_path)
    backend = make_backend(resolve_config(config).attention_backend, "cpu", torch.float32)
    model = load_model(config, model_config, iter_weights(smollm_path, model_config), backend,
                       torch.device("cpu")).model
    table = model.model.embed_tokens.qweight  # 49152 x 576 in Q4_1 blocks: 17.7 MB
    assert table.numel() > 4 * HUGE_PAGE_BYTES and table.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in _vma(table.data_ptr())["VmFlags"].split()
    # the blocks are the file's (interleaved as the loader does): the first token's row reads back as the file's
    ids = torch.tensor([0, 1, 49151])
    rows = model.model.embed_tokens(ids)
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(smollm_path)
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(dequantize(t.data[[0, 1, 49151]], t.tensor_type).copy())
    torch.testing.assert_close(rows, expected, rtol=0, atol=1e-6)
