"""Assertions on written checkpoints shared by the checkpoint, async-save and ZeRO++ tests."""

from __future__ import annotations

import torch

from hybrid.checkpoint.shards import KINDS, CheckpointReader


def assert_same_full_tensors(saved: CheckpointReader, loaded: CheckpointReader) -> None:
    """Both checkpoints hold the same parameters and, for each, the same full tensor of every
    kind (parameters, fp32 master, Adam moments), bit for bit, whatever their grids."""
    assert saved.param_names() == loaded.param_names()
    for name in saved.param_names():
        for kind in KINDS:
            assert torch.equal(saved.full_tensor(name, kind),
                               loaded.full_tensor(name, kind)), (name, kind)
