"""Write a safetensors file one tensor at a time (peak memory: one tensor, not the model).

``safetensors.torch.save_file`` needs every tensor in memory at once. The format is simple
enough to stream: an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and ``[begin, end)`` byte range in the data section, then the raw little-endian
bytes in that order. The header is computed from the shapes before any tensor is read; the
result is read back by ``safetensors`` itself in the tests.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32"}


def write_safetensors(path: str | os.PathLike, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                      tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> int:
    """Stream ``tensors`` into the safetensors file ``path`` (written to ``path.partial`` and
    renamed when complete).

    Args:
        specs: ``(name, shape, dtype)`` of every tensor, in the order ``tensors`` yields them.
        tensors: ``(name, tensor)`` pairs, consumed one at a time.
        metadata: string pairs for the header's ``__metadata__`` (transformers wants
            ``{"format": "pt"}``).

    Returns:
        Bytes written.

    Raises:
        ValueError: a tensor's name, shape or dtype differs from its spec, or the counts differ;
            nothing is left at ``path``.
    """
    if sys.byteorder != "little":
        raise ValueError("safetensors stores little-endian data; this machine is big-endian")
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    out = Path(path)
    tmp = out.with_name(out.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            count = 0
            for (name, t), (want, shape, dtype) in zip(tensors, specs, strict=True):
                if name != want or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise ValueError(f"tensor {name} {tuple(t.shape)} {t.dtype} does not match its spec "
                                     f"{want} {tuple(shape)} {dtype}")
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                count += 1
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return 8 + len(blob) + offset
