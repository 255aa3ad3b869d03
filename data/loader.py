"""Megatron-style data loading: each data-parallel rank takes its slice of every global micro-batch.

The dataset is already shuffled (its shuffle index), so sampling is sequential: global
micro-batch ``g`` is dataset indices ``[start + g * M * P, start + (g + 1) * M * P)`` with
``start = consumed_samples``, ``M`` the micro-batch size and ``P`` the data-parallel size, and
data-parallel rank ``r`` takes the ``r``-th block of ``M``. Hence

* different data-parallel ranks get disjoint micro-batches;
* tensor-parallel ranks of one data-parallel group pass the same ``data_parallel_rank`` and get
  identical batches by construction (the loader sees plain ints, never a process group);
* resuming from a consumed-samples count replays exactly the batches an uninterrupted run
  would have produced from there (with the same ``M * P``);
* a trailing incomplete global micro-batch is dropped, so every rank gets the same count.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class PretrainingSampler(torch.utils.data.Sampler[list[int]]):
    """Batch sampler yielding this data-parallel rank's dataset indices, one micro-batch at a time.

    Args:
        total_samples: dataset length.
        consumed_samples: samples already consumed by all ranks together (resume point).
        micro_batch_size: samples per rank per micro-batch.
        data_parallel_rank: this rank's index in ``[0, data_parallel_size)``.
        data_parallel_size: number of data-parallel ranks.

    Raises:
        ValueError: a non-positive size, a rank out of range, or ``consumed_samples`` outside
            ``[0, total_samples]``.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ):
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and data_parallel_size "
                f"({data_parallel_size}) must be >= 1"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})"
            )
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} not in [0, {total_samples}] "
                "(the dataset is too small for the run; build it with more samples)"
            )
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.rank, self.dp = micro_batch_size, data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.dp)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.mbs * self.dp
        for g in range(len(self)):
            first = self.consumed + g * step + self.rank * self.mbs
            yield list(range(first, first + self.mbs))


def collate_tokens(samples: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Stack samples' ``tokens`` into ``int64 [micro_batch, seq_length + 1]``."""
    return torch.stack([s["tokens"] for s in samples]).long()


def build_data_loader(
    dataset: torch.utils.data.Dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader:
    """A loader of ``int64 [micro_batch_size, seq_length + 1]`` token tensors for one rank.

    See the module docstring for which indices each rank gets. ``len(loader)`` is the same on
    every rank: ``(len(dataset) - consumed_samples) // (micro_batch_size * data_parallel_size)``.

    The loader owns its generator: every ``iter(loader)`` draws a worker base seed, and from
    the global CPU generator that draw would shift the dropout stream, so a resumed run (or
    one that evaluates more often) would draw other dropout masks than an uninterrupted one.

    Raises:
        ValueError: see :class:`PretrainingSampler`.
    """
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate_tokens,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(data_parallel_rank),
    )
