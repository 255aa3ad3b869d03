"""ZeRO-R on the activation side: checkpointing, P_a, P_a+cpu and the contiguous arena (M_D).

Applied by the parallelism plan after the tensor-parallel swap and before ZeRO wrapping
(STYLE.md rule 2)::

    parallelize_gpt(model, grid.tp_group, tracker)
    handle = apply_activation_checkpointing(model, grid, ActivationConfig(
        checkpoint_activations=True, partition_activations=True), tracker)
    engine = ZeroEngine(model, grid, ...)

Checkpoints sit at transformer-block inputs ``[b, s, h]`` (``model.layers[i]``), full
recompute. Mechanics are in :mod:`hybrid.activation.recompute` (checkpoint Function, RNG, P_a gather, host
copy) and :mod:`hybrid.activation.arena` (M_D); the measurement in :mod:`hybrid.activation.saved_bytes`.

The arena and ZeRO's flat gradient buffers are the same M_D idea (ZeRO paper §6.3) applied to
the two kinds of long-lived tensors: parameter gradients live for a whole step and their
buffer is sized by the parameter layout (elements of this rank's partition); checkpoints live
from a block's forward to its backward and their arena is sized by the activations (checkpointed
blocks x ``b*s*h / t`` elements), leased per micro-batch. Both are allocated once, before the
short-lived tensors of the first micro-batch, and written by copy; a memory planner adds
``arena.nbytes`` next to the gradient buffer's bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.nn as nn

from hybrid.activation.recompute import ActivationStore, CheckpointedForward, CheckpointStats
from hybrid.activation.saved_bytes import format_saved_bytes, measure_saved_bytes  # noqa: F401 (public API)
from hybrid.parallel.rng import RNGTracker

logger = logging.getLogger(__name__)


@dataclass
class ActivationConfig:
    """Activation checkpointing and ZeRO-R activation options (Megatron-LM / DeepSpeed names).

    ``checkpoint_num_layers = N`` checkpoints the first N blocks and keeps every activation of
    the others: Megatron-core's ``--recompute-granularity full --recompute-method block
    --recompute-num-layers N`` (the memory/compute trade-off when a few blocks fit without
    recompute). DeepSpeed's equivalent knob is ``number_checkpoints``, which also sizes its
    contiguous buffers, as N sizes our arena.
    """

    checkpoint_activations: bool = False
    """Checkpoint transformer-block inputs and recompute each block in backward (``--checkpoint-activations``)."""
    partition_activations: bool = False
    """P_a: each TP rank keeps 1/tp of each checkpoint, all-gathered before recompute (``--partition-activations``)."""
    checkpoint_in_cpu: bool = False
    """P_a+cpu: keep the (partitioned) checkpoints in host memory (``--checkpoint-in-cpu``)."""
    contiguous_checkpointing: bool = False
    """M_D: copy a micro-batch's checkpoints into one preallocated arena (``--contiguous-checkpointing``)."""
    checkpoint_num_layers: int | None = None
    """Checkpoint only the first N blocks, the rest keep all activations; None = every block (``--recompute-method block --recompute-num-layers``)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, num_layers: int | None = None) -> None:
        """Check field combinations (and ``checkpoint_num_layers`` against ``num_layers``).

        Raises:
            ValueError: naming the offending field and value.
        """
        n = self.checkpoint_num_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"checkpoint_num_layers must be a positive integer or None, got {n!r}")
        if not self.checkpoint_activations:
            for name in ("partition_activations", "checkpoint_in_cpu", "contiguous_checkpointing"):
                if getattr(self, name):
                    raise ValueError(f"{name}=True needs checkpoint_activations=True "
                                     f"(--{name.replace('_', '-')} needs --checkpoint-activations)")
            if n is not None:
                raise ValueError(f"checkpoint_num_layers={n} needs checkpoint_activations=True")
        if num_layers is not None and n is not None and n > num_layers:
            raise ValueError(f"checkpoint_num_layers={n} exceeds the model's num_layers={num_layers}")

    def num_checkpointed(self, num_layers: int) -> int:
        """How many of ``num_layers`` blocks are checkpointed."""
        if not self.checkpoint_activations:
            return 0
        return num_layers if self.checkpoint_num_layers is None else self.checkpoint_num_layers


class ActivationCheckpointing:
    """The handle returned by :func:`apply_activation_checkpointing`.

    Attributes:
        config: the applied :class:`ActivationConfig`.
        blocks: indices of the checkpointed blocks in ``model.layers``.
        partitioned: whether P_a is in effect (False at tp = 1 even when asked for).
        store: the :class:`hybrid.activation.recompute.ActivationStore` (arena, host copies, gathers).
    """

    def __init__(self, model: nn.Module, config: ActivationConfig, store: ActivationStore,
                 blocks: list[int]):
        self.model = model
        self.config = config
        self.store = store
        self.blocks = blocks
        self.partitioned = store.partition
        self._wrappers: list[CheckpointedForward] = []

    @property
    def stats(self) -> CheckpointStats:
        """Cumulative counters (checkpoints, recomputes, all-gathers, allocations)."""
        return self.store.stats

    @property
    def arena(self):
        """The :class:`hybrid.activation.arena.CheckpointArena`, or None (no M_D, or no
        checkpoint written yet)."""
        return self.store.arena

    def measure(self, fn) -> dict[str, int]:
        """:func:`measure_saved_bytes` of ``fn`` on this model, including the recompute peak."""
        return measure_saved_bytes(fn, self.model, self)

    def summary(self) -> str:
        """One human line describing what is in effect."""
        c, s = self.config, self.stats
        arena = self.arena
        return (f"activation checkpointing: {len(self.blocks)}/{len(self.model.layers)} blocks, "
                f"partitioned={self.partitioned} (tp={self.store.tp_size}), in_cpu={c.checkpoint_in_cpu}, "
                f"arena={'off' if not c.contiguous_checkpointing else (arena.nbytes if arena else 'unallocated')}"
                f"{' bytes' if arena else ''}; {s.checkpoints} checkpoints, {s.recomputes} recomputes, "
                f"{s.allgathers} all-gathers")

    def remove(self) -> None:
        """Undo the wrapping: blocks run their plain forward again."""
        for w in self._wrappers:
            if w.block.__dict__.get("forward") is w:
                del w.block.forward
                if w.replaced is not None:
                    w.block.forward = w.replaced
        self._wrappers.clear()


def _find_tracker(model: nn.Module, tracker: RNGTracker | None) -> RNGTracker | None:
    found = {id(t): t for m in model.modules() if isinstance(t := getattr(m, "tracker", None), RNGTracker)}
    if tracker is not None:
        found.pop(id(tracker), None)
        if found:
            raise ValueError("the model's TP-region dropout uses a different RNGTracker than the one "
                             "passed to apply_activation_checkpointing; pass that tracker")
        return tracker
    if len(found) > 1:
        raise ValueError(f"the model uses {len(found)} RNGTrackers; pass the one to save and restore")
    return next(iter(found.values()), None)


def apply_activation_checkpointing(model: nn.Module, grid, config: ActivationConfig,
                                   tracker: RNGTracker | None = None) -> ActivationCheckpointing:
    """Checkpoint ``model.layers[i]`` for the first ``config.num_checkpointed(L)`` blocks, in place.

    Call after ``parallelize_gpt`` and before ZeRO wrapping. Parameter names are unchanged.

    Args:
        model: a (tensor-parallel) GPT whose ``layers`` take and return one ``[b, s, h]`` tensor.
        grid: the :class:`hybrid.parallel.grid.ProcessGrid` (P_a uses ``grid.tp_group``).
        config: the options; validated against ``len(model.layers)``.
        tracker: the TP dropout stream; None means the model's own (found on its modules).

    Returns:
        An :class:`ActivationCheckpointing` handle (counters, arena, :meth:`~ActivationCheckpointing.measure`).

    Raises:
        ValueError: inconsistent config, or a tracker different from the model's.
        RuntimeError: the model is already checkpointed.
    """
    layers = model.layers
    config.validate(len(layers))
    tracker = _find_tracker(model, tracker)
    n = config.num_checkpointed(len(layers))
    if any(isinstance(b.__dict__.get("forward"), CheckpointedForward) for b in layers):
        raise RuntimeError("model.layers are already checkpointed; call handle.remove() first")
    store = ActivationStore(grid.tp_group, config.partition_activations, config.checkpoint_in_cpu,
                            n if config.contiguous_checkpointing and n else None, tracker)
    if config.partition_activations and not store.partition:
        logger.info("partition_activations: no effect at tensor-model-parallel size 1 "
                    "(each rank keeps the whole checkpoint)")
    handle = ActivationCheckpointing(model, config, store, list(range(n)))
    for i in handle.blocks:
        wrapper = CheckpointedForward(layers[i], i, store)
        layers[i].forward = wrapper
        handle._wrappers.append(wrapper)
    if n:
        logger.info(handle.summary())
    return handle
