"""Blockwise symmetric integer quantization of gradients for the wire (ZeRO++ qgZ, arXiv
2306.10209 §3.3; the block-based quantizer of §3.1).

Each row of a ``[rows, m]`` tensor is cut into blocks of ``block`` elements (the last one padded
with zeros); every block gets one fp32 scale ``s = max|x| / qmax`` with ``qmax = 2**(bits-1) - 1``
(7 for int4, 127 for int8) and its elements become ``q = round(x / s)`` in ``[-qmax, qmax]``.
Dequantization is ``q * s``. Per element the round-trip error is at most half a step:

    |x - q s| <= s / 2 = max|x over its block| / (2 qmax)

(plus fp32 rounding of ``x / s`` and ``q * s``, about 1e-7 relative). A block whose maximum is
not finite (an fp16 overflow) dequantizes to NaN everywhere, so the loss scaler still sees it.

On the wire a row is one ``uint8`` *payload*: the quantized values (int8: one byte each; int4:
two per byte, the even element in the low nibble, stored as ``q + 8``), then the block scales'
fp32 bytes. :func:`payload_bytes` is its length, so a payload's bytes per element are
``bits / 8 + 4 / block`` (int4, block 256: 0.516; int8: 1.016).
"""

from __future__ import annotations

import math

import torch

QUANT_BITS = (4, 8)
"""Supported widths (DeepSpeed's qgZ sends int4; int8 halves the error bound's step count)."""
DEFAULT_BITS = 4
"""DeepSpeed's qgZ width (``zero_quantized_gradients`` quantizes to int4)."""
BLOCK = 256
"""Elements per quantization block (one fp32 scale each: 4 / 256 = 0.016 bytes per element)."""


def qmax(bits: int) -> int:
    """Largest magnitude of a ``bits``-wide symmetric code (7 for int4, 127 for int8)."""
    return 2 ** (bits - 1) - 1


def _check(bits: int, block: int) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"quantization bits {bits!r}: valid widths are {QUANT_BITS}")
    if block < 8 or block % 8:
        raise ValueError(f"quantization block {block!r}: must be a positive multiple of 8")


def payload_bytes(m: int, bits: int, block: int = BLOCK) -> int:
    """Bytes of one quantized row of ``m`` elements: packed codes plus one fp32 scale per block.

    Raises:
        ValueError: ``bits`` not in :data:`QUANT_BITS` or ``block`` not a multiple of 8.
    """
    _check(bits, block)
    blocks = math.ceil(m / block)
    return blocks * block * bits // 8 + 4 * blocks


def quantize(x: torch.Tensor, bits: int = DEFAULT_BITS, block: int = BLOCK) -> torch.Tensor:
    """Quantize each row of ``x`` (``[rows, m]``, any float dtype) blockwise.

    Returns:
        ``uint8 [rows, payload_bytes(m, bits, block)]`` on ``x``'s device (see the module
        docstring for the layout and the error bound).

    Raises:
        ValueError: ``x`` not 2-D, or bad ``bits`` / ``block``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize expects a [rows, m] tensor, got shape {tuple(x.shape)}")
    _check(bits, block)
    rows, m = x.shape
    blocks = math.ceil(m / block)
    xf = x.float()
    if blocks * block != m:
        xf = torch.nn.functional.pad(xf, (0, blocks * block - m))
    xb = xf.view(rows, blocks, block)
    top = qmax(bits)
    scale = xb.abs().amax(-1, keepdim=True) / top  # [rows, blocks, 1]
    denom = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero block: q = 0
    q = torch.nan_to_num(torch.round(xb / denom), nan=0.0, posinf=0.0, neginf=0.0)
    q = q.clamp_(-top, top).to(torch.int8).view(rows, blocks * block)
    if bits == 4:
        u = (q + 8).to(torch.uint8).view(rows, -1, 2)
        codes = u[..., 0] | (u[..., 1] << 4)
    else:
        codes = q.view(torch.uint8)
    return torch.cat([codes, scale.view(rows, blocks).contiguous().view(torch.uint8)], dim=1)


def dequantize(payload: torch.Tensor, m: int, bits: int = DEFAULT_BITS,
               block: int = BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``uint8 [rows, payload_bytes(m)]`` -> fp32 ``[rows, m]``.

    Raises:
        ValueError: the payload's width is not ``payload_bytes(m, bits, block)``.
    """
    rows, width = payload.shape
    if width != payload_bytes(m, bits, block):
        raise ValueError(f"payload of {width} bytes per row does not hold {m} elements at "
                         f"int{bits}, block {block} ({payload_bytes(m, bits, block)} bytes)")
    blocks = math.ceil(m / block)
    ncode = blocks * block * bits // 8
    codes, scale = payload[:, :ncode], payload[:, ncode:].contiguous().view(torch.float32)
    if bits == 4:
        q = torch.stack([codes & 15, codes >> 4], dim=-1).view(rows, -1).to(torch.int8) - 8
    else:
        q = codes.contiguous().view(torch.int8)
    x = q.view(rows, blocks, block).float() * scale.view(rows, blocks, 1)
    return x.view(rows, blocks * block)[:, :m]
