"""The per-parameter tensor-parallel spec: which dimension of a parameter is split over the TP
group (or none, replicated), the full unpadded shape and the padded size along the split.

Every parameter of a tensor-parallel model carries a :class:`TPSpec` (``param.tp_spec``, set by
the TP layers and :func:`hybrid.parallel.tp_plan.parallelize_gpt`). ZeRO, gradient clipping,
checkpoints and consolidation read it instead of re-deriving the sharding (Megatron-LM paper,
arXiv 1909.08053, §3, for the splits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPSpec:
    """How one parameter is laid out over the tensor-parallel group.

    Attributes:
        split_dim: dimension split across TP ranks, or ``None`` for a replicated parameter.
        full_shape: global shape without padding (what a single-process model holds).
        padded_size: global size along ``split_dim`` after padding to a multiple of ``tp_size``
            (equal to ``full_shape[split_dim]`` when nothing is padded).
        tp_rank: this rank's index in the TP group.
        tp_size: TP group size.
    """

    split_dim: int | None
    full_shape: tuple[int, ...]
    padded_size: int
    tp_rank: int
    tp_size: int

    @property
    def replicated(self) -> bool:
        return self.split_dim is None

    def local_range(self) -> tuple[int, int]:
        """``[start, stop)`` of this rank's shard along ``split_dim``, in padded coordinates."""
        if self.replicated:
            return 0, 0
        per = self.padded_size // self.tp_size
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def real_local_size(self) -> int:
        """Rows of this rank's shard that are real (not padding) along ``split_dim``."""
        start, stop = self.local_range()
        return max(0, min(stop, self.full_shape[self.split_dim]) - start)

    def real_numel(self) -> int:
        """Elements of the local shard that are not padding (all of them when replicated)."""
        n = 1
        for d, size in enumerate(self.full_shape):
            n *= self.real_local_size() if d == self.split_dim else size
        return n

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's (zero-padded) shard of the full tensor ``full`` (shape ``full_shape``)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a tensor of shape {self.full_shape}, got "
                             f"{tuple(full.shape)}")
        if self.replicated:
            return full
        start, stop = self.local_range()
        real = self.real_local_size()
        shape = list(full.shape)
        shape[self.split_dim] = stop - start
        out = full.new_zeros(shape)
        if real > 0:
            out.narrow(self.split_dim, 0, real).copy_(full.narrow(self.split_dim, start, real))
        return out


def get_tp_spec(param: torch.Tensor) -> TPSpec:
    """The parameter's :class:`TPSpec`; a plain parameter counts as replicated on one rank."""
    spec = getattr(param, "tp_spec", None)
    if spec is None:
        spec = TPSpec(None, tuple(param.shape), 0, 0, 1)
    return spec


def set_tp_spec(param: torch.Tensor, spec: TPSpec) -> None:
    """Attach ``spec`` to ``param`` (``param.tp_spec``)."""
    param.tp_spec = spec
