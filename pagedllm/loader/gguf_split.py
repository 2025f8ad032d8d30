"""GGUF models split over several files, as llama.cpp's ``gguf-split`` writes them.

``gguf-split`` names the parts ``<prefix>-00001-of-00003.gguf`` ... and
writes ``split.no`` (0-based), ``split.count`` and ``split.tensors.count``
into every part; the first part holds the model's metadata (architecture,
tokenizer), every part holds its share of the tensors. A model is named by
its first part; the loader reads the tensors of every part in order.
"""

from __future__ import annotations

import os
import re

SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_part_name(prefix: str, part_no: int, num_parts: int) -> str:
    """The file name of part ``part_no`` (0-based) of ``num_parts``, in gguf-split's naming."""
    return f"{prefix}-{part_no + 1:05d}-of-{num_parts:05d}.gguf"


def split_part_paths(path: str, metadata: dict[str, object]) -> list[str]:
    """Every part of the model whose first file is ``path`` (just ``[path]`` for a file not split).

    ``metadata`` is the first file's. ValueError when ``path`` is not the first
    part, the name does not follow gguf-split's pattern, or a part is missing.
    """
    num_parts = int(metadata.get("split.count", 1) or 1)
    if num_parts <= 1:
        return [path]
    part_no = int(metadata.get("split.no", 0))
    match = SPLIT_RE.match(os.path.basename(path))
    if part_no != 0 or match is None:
        raise ValueError(f"{path} is part {part_no + 1} of a model split in {num_parts} files: "
                         "name its first part, <name>-00001-of-NNNNN.gguf")
    folder = os.path.dirname(path)
    paths = [os.path.join(folder, split_part_name(match["prefix"], i, num_parts)) for i in range(num_parts)]
    missing = [os.path.basename(p) for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"{path} is split in {num_parts} files; missing beside it: {', '.join(missing)}")
    return paths
