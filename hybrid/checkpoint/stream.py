"""A safetensors file written one tensor at a time (the library's ``save_file`` needs them all).

``safetensors.torch.save_file`` turns every tensor into a ``bytes`` object before writing, so its
peak is the sum of the tensors. A checkpoint shard or a consolidated model is far larger than
what a rank may stage, so this writer takes the tensors' dtypes and shapes first (the header
needs them), then asks for each tensor in turn and writes its bytes straight from the tensor's
memory: the extra memory is the one tensor being produced. The file follows the safetensors
format (an 8-byte little-endian header size, a JSON header padded with spaces to 8 bytes, the
data in header order) and is read back by ``safetensors.safe_open``; nothing is pickled.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8",
           torch.bool: "BOOL"}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: ``produce()`` returns it (``dtype``, ``shape``) when its turn
    comes."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def staged(entries: Sequence[Entry]) -> Iterator[torch.Tensor]:
    """Each entry's tensor in turn, checked against its declaration, as contiguous CPU memory
    (what :func:`write_safetensors` writes; the dry run measures a save's staging with it).

    Raises:
        ValueError: a produced tensor's dtype or shape differs from its entry.
    """
    for e in entries:
        t = e.produce()
        if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
            raise ValueError(f"{e.key}: produced {t.dtype} {tuple(t.shape)}, declared {e.dtype} "
                             f"{tuple(e.shape)}")
        yield t.detach().cpu().contiguous()
        del t


def write_safetensors(path: str | os.PathLike, entries: Sequence[Entry],
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``entries`` to ``path`` (fsynced; the caller renames it into place).

    Returns:
        Bytes written.

    Raises:
        ValueError: a produced tensor's dtype or shape differs from its entry, an unsupported
            dtype, or a duplicate key.
        OSError: writing failed (a full disk: errno 28, ENOSPC); it names ``path``, and its
            ``needed_bytes`` is the size the file needed.
    """
    if sys.byteorder != "little":
        raise ValueError("safetensors files are little-endian; this host is big-endian")
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in entries:
        if e.dtype not in _DTYPES:
            raise ValueError(f"{e.key}: dtype {e.dtype} is not one of {sorted(map(str, _DTYPES))}")
        if e.key in header:
            raise ValueError(f"duplicate tensor key {e.key!r}")
        header[e.key] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    try:
        with open(Path(path), "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for t in staged(entries):
                if t.numel():
                    f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                del t
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # file.write's errors (ENOSPC, EIO, EDQUOT) do not name the file
        named = OSError(e.errno, e.strerror, str(path)) if e.filename is None else e
        named.needed_bytes = 8 + len(blob) + offset  # what the file needed: a full disk's figure
        if named is e:
            raise
        raise named from e
    return 8 + len(blob) + offset
