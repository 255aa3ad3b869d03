"""The checkpoint-format door: what a format decides, and the reader it hands back.

A checkpoint is one protocol, the same for every format, and one format. Shared by every format:

- the save directory: ``iter_N.tmp`` staging, the atomic rename to ``iter_N``,
  ``latest_checkpointed_iteration.txt`` (Megatron-LM's name), retention and the save lock
  (:mod:`hybrid.checkpoint.directory`, :mod:`hybrid.checkpoint.published`,
  :mod:`hybrid.checkpoint.retention`, :mod:`hybrid.checkpoint.lock`);
- the ranks' agreement on each step of a save, and the one-line failure
  (:mod:`hybrid.checkpoint.agree`);
- ``metadata.json``, the contract every reader and tool relies on: grid, ZeRO stage, loop
  counters, loss scaler, optimizer step, every parameter's full shape, split dimension and
  padded size, model, tokenizer, config, ``save_sequence``, the files the ranks wrote
  (``shards``) and the format's name (:data:`FORMAT_KEY`);
- what is saved: each rank's fp32 ``master``, ``exp_avg`` and ``exp_avg_sq`` of the fragments
  it owns (:func:`hybrid.zero.state.owned_state`) and its RNG states; and how a load fills the
  engine (:func:`hybrid.zero.state.import_state`, from :meth:`Reader.read_local`).

A format (:class:`CheckpointFormat`) decides the bytes only: which tensors one rank's part holds
(:meth:`~CheckpointFormat.part`), how they become files in the staging directory
(:meth:`~CheckpointFormat.write`, also from ``--async-save``'s thread), which files a complete
checkpoint has, the keys it adds to ``metadata.json``, which ``metadata.json`` it reads, and a
:class:`Reader`. ``--ckpt-format`` names the format a job saves in
(:mod:`hybrid.checkpoint.registry`); loading, consolidation and export take the format that
``metadata.json`` names, so a run may resume in one format and save in another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from hybrid.checkpoint.stream import Entry
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.tp_spec import TPSpec
    from hybrid.zero.engine import ZeroEngine

FORMAT_KEY = "ckpt_format"
"""The ``metadata.json`` key naming the format (``--ckpt-format``'s value when it was saved)."""


@dataclass(frozen=True)
class RankPart:
    """One rank's part of a checkpoint, not yet written.

    ``--async-save`` copies every entry's tensor to host memory and hands the format the same
    part with entries reading the copies, so :meth:`CheckpointFormat.write` must take its
    tensors from ``entries`` alone (``header`` is plain strings)."""

    entries: list[Entry]
    """The tensors, each produced on demand (:class:`hybrid.checkpoint.stream.Entry`)."""
    header: dict[str, str]
    """The format's strings that go with them (e.g. where each fragment lies)."""


class Reader(Protocol):
    """A published checkpoint opened by its format: any rank's range of any grid, whole tensors
    one at a time, and a saved rank's RNG states. ``meta`` is its ``metadata.json``."""

    root: Path
    iteration: int
    meta: dict
    bytes_read: int
    """Tensor bytes read so far (the resume line prints rank 0's)."""
    reads: int
    """Reads issued so far."""

    def read_local(self, name: str, kind: str, spec: TPSpec, start: int, stop: int,
                   out: torch.Tensor) -> None:
        """Elements ``[start, stop)`` of the flattened, padded TP-local tensor of ``spec`` (a TP
        rank of any TP size; padding zero) of state ``kind`` into the 1-D fp32 ``out``."""

    def full_tensor(self, name: str, kind: str = "master") -> torch.Tensor:
        """The full, unpadded fp32 tensor of parameter ``name`` (shape ``full_shape``)."""

    def rng_states(self, rank: int) -> dict[str, torch.Tensor]:
        """The RNG states saved by global rank ``rank`` (restored on the same grid only)."""


class CheckpointFormat(ABC):
    """A checkpoint format: the bytes of each rank's part and the reader of a published
    checkpoint. One instance per format, stateless (the registry holds it)."""

    name: str = ""
    """``--ckpt-format``'s value, and ``metadata.json``'s :data:`FORMAT_KEY`."""
    description: str = ""
    """What it is, in a few words (``--help``, the refusal of a format not implemented)."""

    @abstractmethod
    def part(self, engine: ZeroEngine, grid: ProcessGrid,
             rng: dict[str, torch.Tensor]) -> RankPart:
        """This rank's part: its owned fragments (:func:`hybrid.zero.state.owned_state`) and
        ``rng`` (its RNG states; empty when only the size is wanted). Every rank calls it at
        the same point of a save, so a format may run a collective here; nothing is copied."""

    @abstractmethod
    def write(self, stage_dir: Path, rank: int, part: RankPart) -> None:
        """Write ``part`` of global rank ``rank`` into ``stage_dir`` (no collective: it may run in
        a background thread). A file appears under its final name only when complete.

        Raises:
            OSError: writing failed (a full disk: errno 28); it names the file.
        """

    @abstractmethod
    def files(self, world_size: int) -> list[str]:
        """The files a complete checkpoint of ``world_size`` ranks has in its directory (checked
        before publishing and before reading; ``metadata.json``'s ``shards``)."""

    @abstractmethod
    def reader(self, root: Path, iteration: int, meta: dict) -> Reader:
        """Open iteration ``iteration`` of save directory ``root`` (``meta``: its checked
        ``metadata.json``).

        Raises:
            hybrid.checkpoint.published.IncompleteCheckpointError: the files do not hold what
                ``meta`` describes.
        """

    def stamp(self) -> dict:
        """The keys this format adds to ``metadata.json`` (its name; a version)."""
        return {FORMAT_KEY: self.name}

    def claims(self, meta: dict) -> bool:
        """Whether ``metadata.json`` ``meta`` is of this format (by default: it names it)."""
        return meta.get(FORMAT_KEY) == self.name

    def check(self, meta: dict, where: Path) -> None:
        """Refuse a ``metadata.json`` this format claims but cannot read (``where``: its path).

        Raises:
            hybrid.checkpoint.published.IncompleteCheckpointError: an unreadable version.
        """
        return None  # a format with one version reads every metadata.json it claims
