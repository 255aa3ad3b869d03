"""Sharded safetensors as transformers writes them: ``model-0000k-of-0000n.safetensors`` plus
``model.safetensors.index.json``, or one ``model.safetensors`` when everything fits in a shard.

Tensors are produced one at a time (:mod:`hybrid.checkpoint.stream`), so writing a model holds
one tensor at a time, whatever its size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from hybrid.checkpoint.stream import Entry, write_safetensors

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10,
          "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""transformers' ``save_pretrained`` default."""


def parse_size(text: str | int) -> int:
    """Bytes of ``"5GB"`` (10^9, as transformers), ``"500MiB"`` (2^20) or a plain integer.

    Raises:
        ValueError: not a positive size; the message gives the accepted forms.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: give a positive size such as 5GB, 500MB, "
                         "2GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def plan_shards(entries: Sequence[Entry], max_bytes: int) -> list[list[Entry]]:
    """Greedy shards in entry order, as transformers: a new shard starts when the next tensor
    would take the current one past ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_sharded(directory: str | Path, entries: Sequence[Entry], max_bytes: int,
                  metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``entries`` into ``directory`` in shards of at most ``max_bytes`` (one tensor over
    it gets a shard of its own); returns the file names written."""
    directory = Path(directory)
    shards = plan_shards(entries, max_bytes)
    if len(shards) == 1:
        write_safetensors(directory / "model.safetensors", shards[0], metadata)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(directory / name, shard, metadata)
        weight_map.update({e.key: name for e in shard})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
             "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*names, "model.safetensors.index.json"]
