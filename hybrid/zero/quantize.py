"""Blockwise symmetric integer quantization for the wire: the one codec of ZeRO++'s qwZ (weights,
:mod:`hybrid.zero.qwz`; the block-based quantizer of arXiv 2306.10209 §3.1) and qgZ (gradients,
:mod:`hybrid.zero.qgz`, §3.3). Block size, width and layout are parameters: qwZ sends int8 in
blocks of 2048 with the tight layout, qgZ int4 or int8 in blocks of :data:`BLOCK`.

Each row of a ``[rows, m]`` tensor is cut into blocks of ``block`` elements (the last one padded
with zeros); every block gets one fp32 scale ``s = max|x| / qmax`` with ``qmax = 2**(bits-1) - 1``
(7 for int4, 127 for int8) and its elements become ``q = round(x / s)`` (round half to even) in
``[-qmax, qmax]``, computed in fp32 from the input's values. Dequantization is ``q * s`` in fp32.

Error bound, per element: at most half a step of its block,

    |x - q s| <= s / 2 = max|x over its block| / (2 qmax)

plus the fp32 rounding of ``x / s`` and ``q * s``: at most a relative ``2**-16`` of the bound
(``|x| <= qmax s``), about 1e-7 of ``|x|``. A caller that casts the fp32 result to bf16 / fp16
adds at most half an ulp of that dtype. An all-zero block has ``s = 0`` and decodes to zeros; a
block whose maximum is not finite (an fp16 overflow, a NaN) decodes to NaN everywhere, so a loss
scaler still sees it. The codec is deterministic: the same input gives the same bytes.

On the wire a row is one ``uint8`` *payload* of :func:`payload_bytes` bytes. Codes: int8 one
byte each; int4 two per byte, the even element in the low nibble, stored as ``q + 8``. Layouts:

- default (qgZ): the codes of every block, padding included, then the fp32 scales:
  ``ceil(m / block) * (block * bits / 8 + 4)`` bytes (int4, block 256: 0.516 bytes per element;
  int8: 1.016);
- ``tight`` (qwZ): the fp32 scales first, then the codes of the ``m`` elements only (no padded
  block), zero bytes up to a multiple of 4: ``4 ceil(m / block) + 4 ceil(ceil(m bits / 8) / 4)``
  bytes, so that a short row costs its own bytes and every row's scales stay 4-byte aligned.
"""

from __future__ import annotations

import math

import torch

QUANT_BITS = (4, 8)
"""Supported widths (DeepSpeed's qgZ sends int4; int8 halves the error bound's step count)."""
DEFAULT_BITS = 4
"""DeepSpeed's qgZ width (``zero_quantized_gradients`` quantizes to int4)."""
BLOCK = 256
"""qgZ's elements per quantization block (one fp32 scale each: 4 / 256 = 0.016 bytes per
element); qwZ's is :data:`hybrid.zero.qwz.BLOCK`."""


def qmax(bits: int) -> int:
    """Largest magnitude of a ``bits``-wide symmetric code (7 for int4, 127 for int8)."""
    return 2 ** (bits - 1) - 1


def _check(bits: int, block: int) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"quantization bits {bits!r}: valid widths are {QUANT_BITS}")
    if block < 8 or block % 8:
        raise ValueError(f"quantization block {block!r}: must be a positive multiple of 8")


def _code_bytes(m: int, bits: int, block: int, tight: bool) -> int:
    """Bytes of a row's codes: of the ``m`` elements (``tight``) or of its whole blocks."""
    return -(-m * bits // 8) if tight else math.ceil(m / block) * block * bits // 8


def payload_bytes(m: int, bits: int = DEFAULT_BITS, block: int = BLOCK,
                  tight: bool = False) -> int:
    """Bytes of one quantized row of ``m`` elements: the codes plus one fp32 scale per block,
    in the default or the ``tight`` layout (module docstring).

    Raises:
        ValueError: ``bits`` not in :data:`QUANT_BITS` or ``block`` not a multiple of 8.
    """
    _check(bits, block)
    codes = _code_bytes(m, bits, block, tight)
    return 4 * math.ceil(m / block) + (4 * -(-codes // 4) if tight else codes)


def quantize(x: torch.Tensor, bits: int = DEFAULT_BITS, block: int = BLOCK,
             tight: bool = False) -> torch.Tensor:
    """Quantize each row of ``x`` (``[rows, m]``, any float dtype) blockwise.

    Returns:
        ``uint8 [rows, payload_bytes(m, bits, block, tight)]`` on ``x``'s device (see the module
        docstring for the layouts and the error bound).

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
    scales = scale.view(rows, blocks).contiguous().view(torch.uint8)
    if not tight:
        return torch.cat([codes, scales], dim=1)
    n = _code_bytes(m, bits, block, tight=True)
    pad = payload_bytes(m, bits, block, tight=True) - scales.shape[1] - n
    return torch.cat([scales, codes[:, :n], codes.new_zeros(rows, pad)], dim=1)


def dequantize(payload: torch.Tensor, m: int, bits: int = DEFAULT_BITS, block: int = BLOCK,
               tight: bool = False) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``uint8 [rows, payload_bytes(m, bits, block, tight)]`` ->
    fp32 ``[rows, m]``.

    Raises:
        ValueError: the payload's width is not ``payload_bytes(m, bits, block, tight)``.
    """
    rows, width = payload.shape
    expected = payload_bytes(m, bits, block, tight)
    if width != expected:
        raise ValueError(f"payload of {width} bytes per row does not encode {m} elements at "
                         f"int{bits}, block {block}{', tight' if tight else ''} ({expected} "
                         "bytes)")
    blocks = math.ceil(m / block)
    ncode = _code_bytes(m, bits, block, tight)
    if tight:
        scale, codes = payload[:, :4 * blocks], payload[:, 4 * blocks:4 * blocks + ncode]
    else:
        codes, scale = payload[:, :ncode], payload[:, ncode:]
    scale = scale.contiguous().view(torch.float32)
    if bits == 4:
        q = torch.stack([codes & 15, codes >> 4], dim=-1).view(rows, -1).to(torch.int8) - 8
    else:
        q = codes.contiguous().view(torch.int8)
    q = q.float()
    if q.shape[1] != blocks * block:  # tight: the codes of m elements (int4: m rounded up to 2)
        q = torch.nn.functional.pad(q[:, :m], (0, blocks * block - m))
    x = q.view(rows, blocks, block) * scale.view(rows, blocks, 1)
    return x.view(rows, blocks * block)[:, :m]
