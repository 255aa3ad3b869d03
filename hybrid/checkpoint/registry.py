"""Which checkpoint format: by ``--ckpt-format``'s name when saving, by ``metadata.json`` when
reading (:mod:`hybrid.checkpoint.format`).

A format joins with one module that defines its :class:`~hybrid.checkpoint.format.CheckpointFormat`
and one :func:`register_format` call (the built-in ones at the end of this module). Megatron-LM's
format names (``torch_dist``, its default, ``torch``, ``torch_dcp``, ``fsdp_dtensor``, and
``zarr`` of older versions) are known without being implemented: asking to save in one is
refused in one line naming what is implemented, never ignored (a checkpoint that Megatron-LM
cannot load would otherwise be found out only at the first load there).
"""

from __future__ import annotations

import os
from pathlib import Path

from hybrid.checkpoint.format import FORMAT_KEY, CheckpointFormat, Reader
from hybrid.checkpoint.names import iteration_dir
from hybrid.checkpoint.published import (
    FOREIGN_HINT,
    IncompleteCheckpointError,
    chosen_iteration,
    read_metadata,
)
from hybrid.checkpoint.safetensors_format import SAFETENSORS

DEFAULT_FORMAT = SAFETENSORS.name
"""``--ckpt-format``'s default: the one format implemented (Megatron-LM's default is
``torch_dist``)."""

MEGATRON_FORMATS = {
    "torch_dist": "Megatron-LM's distributed checkpoint format (its default)",
    "torch": "Megatron-LM's legacy format (torch.save files per model-parallel rank)",
    "torch_dcp": "the torch.distributed.checkpoint format",
    "fsdp_dtensor": "Megatron-FSDP's DTensor format",
    "zarr": "Megatron-LM's former zarr format",
}
"""Megatron-LM's ``--ckpt-format`` choices, named in the refusal until one is implemented."""

FORMATS: dict[str, CheckpointFormat] = {}
"""Name -> format. The one table filled at import (by :func:`register_format`), read after."""


class UnknownFormatError(ValueError):
    """``--ckpt-format`` names no implemented format; one line naming those implemented."""


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Make ``fmt`` available to ``--ckpt-format`` (by ``fmt.name``) and to readers (by
    :meth:`~hybrid.checkpoint.format.CheckpointFormat.claims`); returns it.

    Raises:
        ValueError: another format has that name.
    """
    if FORMATS.get(fmt.name, fmt) is not fmt:
        raise ValueError(f"checkpoint format {fmt.name!r} is registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


def implemented() -> str:
    """``safetensors (this trainer's format: ...)``, every implemented format."""
    return "; ".join(f"{name} ({fmt.description})" for name, fmt in FORMATS.items())


def format_named(name: str) -> CheckpointFormat:
    """The format ``--ckpt-format name`` saves in.

    Raises:
        UnknownFormatError: not implemented (Megatron-LM's formats named as such).
    """
    if name in FORMATS:
        return FORMATS[name]
    what = (f"{MEGATRON_FORMATS[name]} is not implemented here" if name in MEGATRON_FORMATS
            else "no such checkpoint format")
    raise UnknownFormatError(f"{what}; implemented: {implemented()}")


def format_of(meta: dict, where: Path) -> CheckpointFormat:
    """The format of ``metadata.json`` ``meta`` (``where``: its path), checked readable.

    Raises:
        IncompleteCheckpointError: no implemented format claims it, or it is a version its
            format does not read.
    """
    for fmt in FORMATS.values():
        if fmt.claims(meta):
            fmt.check(meta, where)
            return fmt
    name = meta.get(FORMAT_KEY) or meta.get("sharded_backend")  # Megatron-LM's key
    raise IncompleteCheckpointError(f"{where}: a checkpoint in format {name!r}, which this code "
                                    f"does not read; it reads: {', '.join(FORMATS)}; "
                                    f"{FOREIGN_HINT}")


def checked_metadata(root: str | os.PathLike, iteration: int) -> dict:
    """``metadata.json`` of iteration ``iteration`` under ``root``, complete and of a format
    this code reads (:func:`hybrid.checkpoint.published.read_metadata`, :func:`format_of`)."""
    meta = read_metadata(root, iteration)
    format_of(meta, iteration_dir(root, iteration) / "metadata.json")
    return meta


def open_checkpoint(root: str | os.PathLike, iteration: int | None = None) -> Reader:
    """A reader of iteration ``iteration`` (default: the latest complete one) under ``root``, by
    the format its ``metadata.json`` names.

    Raises:
        FileNotFoundError: no published checkpoint there (the message says what to give).
        IncompleteCheckpointError: metadata or a file is missing, or the format is unreadable.
    """
    iteration = chosen_iteration(root, iteration)
    meta = read_metadata(root, iteration)
    fmt = format_of(meta, iteration_dir(root, iteration) / "metadata.json")
    return fmt.reader(Path(root), iteration, meta)


register_format(SAFETENSORS)
