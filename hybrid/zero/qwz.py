"""qwZ: ZeRO-3 parameter all-gathers in blockwise int8 (ZeRO++, arXiv 2306.10209 §3.1).

Each rank quantizes its shard of a gather chunk with the blockwise codec
(:mod:`hybrid.zero.quantize`: int8, blocks of :data:`BLOCK` elements, the last block of a chunk
may be shorter; symmetric, one fp32 scale per block)::

    scale = max|x_block| / 127          q = round(x / scale) in [-127, 127]   (int8)
    x'    = q * scale                   |x' - x| <= scale / 2 per element

(computed in fp32, so the bound holds up to fp32 rounding of ``x / scale`` and ``q * scale``:
at most a relative ``2**-16`` of it, as ``|x| <= 127 scale``; an all-zero block has scale 0 and
decodes to zeros). The decoded value is then
rounded once more to the compute dtype (bf16 / fp16), adding at most half an ulp of it. The
payload of one rank is the codec's tight layout: the bytes of its fp32 scales followed by its
int8 values (padded to a multiple of 4 bytes, so that every rank's scales stay 4-byte aligned),
all-gathered as one ``uint8`` tensor: ``1 + 4 / BLOCK`` bytes per element instead of 2 (0.501x
of a bf16 gather).
Every rank decodes every rank's payload, its own included, so all ranks compute with identical
weights; quantizing is deterministic, so a backward re-gather reproduces the forward's
weights exactly. The fp32 master weights and the stored shard stay exact: only the gathered
working copy is quantized.

Block size: DeepSpeed's qwZ quantizes in groups sized by its kernels; 2048 keeps the scale
overhead at 0.2% of the int8 bytes.
"""

from __future__ import annotations

import torch

from hybrid.zero import quantize as codec
from hybrid.zero.comm import DPComm, Work

BLOCK = 2048
"""Elements per quantization block (one fp32 scale each)."""
BITS = 8
"""qwZ's width: int8 (``qmax`` 127)."""


def payload_numel(n: int) -> int:
    """Bytes of the payload encoding ``n`` elements: 4 per block, then ``n`` int8, rounded up
    to a multiple of 4 (the codec's tight layout)."""
    return codec.payload_bytes(n, BITS, BLOCK, tight=True)


@torch.no_grad()
def quantize(x: torch.Tensor) -> torch.Tensor:
    """Encode 1-D ``x`` (any float dtype, ``[n]``) as a ``uint8`` payload of
    :func:`payload_numel` ``(n)`` bytes: fp32 scales, then int8 values (see module docstring)."""
    return codec.quantize(x.reshape(1, -1), BITS, BLOCK, tight=True).view(-1)


@torch.no_grad()
def dequantize(payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode a :func:`quantize` payload into 1-D ``out`` (``[n]``, its dtype); returns ``out``.

    Raises:
        ValueError: the payload's size is not :func:`payload_numel` ``(out.numel())``.
    """
    n = out.numel()
    return out.copy_(codec.dequantize(payload.reshape(1, -1), n, BITS, BLOCK, tight=True).view(n))


def quantized_all_gather(comm: DPComm, slots: list[torch.Tensor], src: torch.Tensor,
                         async_op: bool = True):
    """All-gather ``src`` (this rank's ``[n]`` elements) into ``slots`` (one ``[n]`` tensor
    per rank of ``comm``'s group, rank order) through int8 payloads; the ledger counts the
    payload bytes under ``all_gather``. Returns a work handle whose ``wait`` decodes."""
    n = src.numel()
    mine = quantize(src)
    gathered = torch.empty(comm.size * mine.numel(), dtype=torch.uint8, device=src.device)
    work = comm.all_gather(gathered, mine, async_op=True)

    def decode():
        for r, slot in enumerate(slots):
            dequantize(gathered[r * mine.numel():(r + 1) * mine.numel()], slot.view(n))

    done = Work([work], decode)
    if not async_op:
        done.wait()
    return done
