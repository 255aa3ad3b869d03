"""The one blockwise codec of qwZ and qgZ (:mod:`hybrid.zero.quantize`, issue 41 item 5): both
layouts at both widths round-trip within the docstring's bound, ``max|x over its block| /
(2 qmax)`` times ``1 + 2**-16`` (fp32 rounding of ``x / s`` and ``q * s``), their sizes are the
docstring's formulas, and qwZ's payload is the codec's tight int8 layout in blocks of 2048, byte
for byte (qgZ's own codec tests are in ``tests/test_qgz.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid.zero import qwz
from hybrid.zero.quantize import dequantize, payload_bytes, qmax, quantize


def _bound(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    rows, m = x.shape
    blocks = math.ceil(m / block)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * block - m)).view(rows, blocks, block)
    step = (padded.abs().amax(-1, keepdim=True) / qmax(bits)).expand(-1, -1, block)
    return step.reshape(rows, -1)[:, :m] / 2 * (1 + 2**-16)


@pytest.mark.parametrize("tight", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 7, 40, 41, 2048, 2049])
def test_both_layouts_round_trip_within_half_a_step(m, bits, tight):
    g = torch.Generator().manual_seed(m * 10 + bits)
    x = (torch.randn(3, m, generator=g) * torch.tensor([[1e-3], [1.0], [50.0]])).bfloat16()
    p = quantize(x, bits, 16, tight)
    assert p.dtype == torch.uint8 and p.shape == (3, payload_bytes(m, bits, 16, tight))
    y = dequantize(p, m, bits, 16, tight)
    assert y.dtype == torch.float32 and y.shape == (3, m)
    assert ((y - x.float()).abs() <= _bound(x, bits, 16)).all()
    assert torch.equal(quantize(x, bits, 16, tight), p)  # deterministic


def test_layout_sizes_and_the_tight_layouts_padding():
    blocks = math.ceil(41 / 16)
    assert payload_bytes(41, 4, 16) == blocks * (8 + 4)  # whole blocks of codes, then scales
    assert payload_bytes(41, 8, 16) == blocks * (16 + 4)
    assert payload_bytes(41, 4, 16, tight=True) == 4 * blocks + 24  # 21 code bytes -> 24
    assert payload_bytes(41, 8, 16, tight=True) == 4 * blocks + 44  # 41 code bytes -> 44
    x = torch.arange(1, 42, dtype=torch.float32)[None]
    p = quantize(x, 4, 16, tight=True)
    scales = p[0, :4 * blocks].view(torch.float32)
    assert torch.equal(scales, torch.tensor([16.0, 32.0, 41.0]) / 7)  # the scales come first
    assert p[0, 4 * blocks + 21:].tolist() == [0, 0, 0]  # zero bytes up to a multiple of 4
    assert p[0, 4 * blocks + 20].item() >> 4 == 8  # the odd element's partner: code 0, as q + 8


def test_qwz_is_the_codecs_tight_int8_layout():
    g = torch.Generator().manual_seed(3)
    for n in (5, qwz.BLOCK, qwz.BLOCK + 905):
        x = torch.randn(n, generator=g).bfloat16()
        p = qwz.quantize(x)
        assert torch.equal(p, quantize(x[None], 8, 2048, tight=True)[0])
        assert p.numel() == qwz.payload_numel(n) == payload_bytes(n, 8, 2048, tight=True)
        out = torch.empty(n, dtype=torch.bfloat16)
        assert torch.equal(qwz.dequantize(p, out),
                           dequantize(p[None], n, 8, 2048, tight=True)[0].bfloat16())


def test_a_payload_of_the_wrong_size_is_refused():
    p = quantize(torch.ones(1, 4), 8, 16, tight=True)
    with pytest.raises(ValueError, match="payload of 8 bytes per row does not encode 5 elements "
                                         "at int8, block 16, tight \\(12 bytes\\)"):
        dequantize(p, 5, 8, 16, tight=True)
