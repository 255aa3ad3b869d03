"""Format-1 checkpoints: the one backward compatibility the checkpoint code keeps, all of it.

Format 1 of ``--ckpt-format safetensors``, written before partition-wise saving (format 2,
:mod:`hybrid.checkpoint.safetensors_format`), stored for every TP rank each parameter's unpadded
local tensor, flattened and cut into ``dp`` equal ranges (data-parallel rank ``d`` wrote range
``d``), and wrote replicated parameters on *every* TP rank. Its fragments are placed the same
way as format 2's (ranges of one source TP rank's real-local tensor,
:mod:`hybrid.checkpoint.fragments`), so one reader reads both; what differs is handled here:

- the copies of replicated parameters on TP ranks other than 0 repeat TP rank 0's:
  :func:`redundant_fragment` tells the reader to skip them;
- ``metadata.json`` says ``format_version: 1``: :data:`VERSION` is among the readable ones
  (``hybrid.checkpoint.safetensors_format.READABLE_VERSIONS``);
- its shard layouts also name each fragment's ``local_shape``, which nothing reads.

Dropping format 1 means deleting this module and its two uses.
"""

from __future__ import annotations

VERSION = 1
"""``format_version`` of these checkpoints in ``metadata.json``."""


def redundant_fragment(split_dim: int | None, tp_rank: int) -> bool:
    """Whether a stored fragment is a format-1 copy to skip: a replicated parameter
    (``split_dim`` None) from a TP rank other than 0 (format 2 stores those on TP rank 0 only,
    so this never skips a format-2 fragment)."""
    return split_dim is None and tp_rank != 0
