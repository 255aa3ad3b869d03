"""Rotary position embeddings (RoPE; Su et al. 2021, arXiv 2104.09864, §3.4.2 Eq. 34).

Megatron-LM's conventions, which ``--position-embedding-type rope`` and its flags follow:

- The rotated width is ``r = int(kv_channels * rotary_percent)`` (``--rotary-percent``); the
  leading ``r`` channels of each head rotate, the other ``d - r`` pass through unchanged.
- Frequencies ``inv_freq[i] = rotary_base ** (-2i / r)`` for ``i < r/2`` (``--rotary-base``).
- Non-interleaved (the default, Llama / GPT-NeoX style, transformers' ``rotate_half``): channel
  ``j < r/2`` pairs with ``j + r/2``. ``--rotary-interleaved`` (RoFormer / GPT-J style): channel
  ``2i`` pairs with ``2i + 1``.
- ``--use-rope-scaling`` applies Llama 3.1's frequency scaling with ``--rope-scaling-factor``
  (default 8), low / high frequency factors 1 and 4 and an original context of 8192 tokens
  (:func:`llama3_scaled_frequencies`); without ``--use-rope-scaling`` the factor is ignored.

Nothing here has parameters. :class:`RotaryEmbedding` caches its cos/sin tables per
``(device, dtype, sequence length)``, so a forward pass builds them once and every layer's
attention reuses them; the cache lives on the model object, not in a module global.
"""

from __future__ import annotations

import math

import torch

LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def llama3_scaled_frequencies(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's RoPE frequency scaling (Llama 3 Herd of Models, arXiv 2407.21783 §3.3; the
    formula of Meta's reference code, as Megatron-LM and transformers' ``rope_type="llama3"``
    implement it).

    With wavelength ``w = 2 pi / f``, low/high frequency wavelengths ``8192 / 1`` and
    ``8192 / 4``: ``f / factor`` where ``w > 8192``; ``f`` where ``w < 2048``; in between the
    interpolation ``(1 - m) f / factor + m f`` with ``m = (8192 / w - 1) / (4 - 1)``.

    Args:
        inv_freq: ``[r/2]`` fp32 frequencies (radians per token).
        factor: ``--rope-scaling-factor`` (> 0).

    Returns:
        ``[r/2]`` scaled frequencies.
    """
    low_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x`` ``[..., r]`` with each rotation pair ``(x1, x2)`` replaced by ``(-x2, x1)``."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotate the leading ``r`` channels of ``x`` ``[b, heads, s, d]`` by the tables ``cos``,
    ``sin`` ``[s, r]`` (``x * cos + rotate_half(x) * sin``); channels ``r..d`` pass through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x, interleaved) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + rotate_half(rot, interleaved) * sin, rest), dim=-1)


class RotaryEmbedding:
    """The cos/sin tables of one model's RoPE, cached per device, dtype and sequence length.

    Args:
        head_dim: channels per head d (``kv_channels``).
        rotary_percent: fraction of ``d`` that rotates, in (0, 1].
        base: ``--rotary-base``.
        interleaved: ``--rotary-interleaved``.
        scaling_factor: Llama 3.1 scaling factor, or None for no scaling.

    Raises:
        ValueError: the rotated width ``int(d * rotary_percent)`` is not a positive even number.
    """

    def __init__(self, head_dim: int, rotary_percent: float = 1.0, base: float = 10000,
                 interleaved: bool = False, scaling_factor: float | None = None):
        self.dim = int(head_dim * rotary_percent)
        if self.dim < 2 or self.dim % 2:
            raise ValueError(f"rotary width int(kv_channels {head_dim} * rotary_percent "
                             f"{rotary_percent}) = {self.dim} must be a positive even number")
        self.base, self.interleaved, self.scaling_factor = base, interleaved, scaling_factor
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def inv_freq(self) -> torch.Tensor:
        """``[r/2]`` fp32 frequencies on CPU (scaled when ``scaling_factor`` is set)."""
        f = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
        return f if self.scaling_factor is None else llama3_scaled_frequencies(
            f, self.scaling_factor)

    def tables(self, seq_len: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[seq_len, r]`` in ``dtype`` on ``device``, for positions
        ``0 .. seq_len - 1`` (built in fp32 on first use, then cached)."""
        key = (torch.device(device), dtype, seq_len)
        if key not in self._tables:
            freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), self.inv_freq())
            if self.interleaved:
                freqs = freqs.repeat_interleave(2, dim=-1)
            else:
                freqs = torch.cat((freqs, freqs), dim=-1)
            self._tables[key] = (freqs.cos().to(device, dtype), freqs.sin().to(device, dtype))
        return self._tables[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on ``q`` ``[b, heads, s, d]`` and ``k`` ``[b, groups, s, d]`` (local heads), at
        positions ``0..s-1`` or ``positions`` ``[b, s]`` (each below ``s``: documents'
        restarting positions, ``models.documents``)."""
        cos, sin = self.tables(q.shape[-2], q.device, q.dtype)
        if positions is not None:  # [b, s, r] -> [b, 1, s, r], broadcast over the heads
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        return (apply_rotary(q, cos, sin, self.interleaved),
                apply_rotary(k, cos, sin, self.interleaved))
