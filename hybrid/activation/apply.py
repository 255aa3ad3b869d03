"""ZeRO-R on the activation side: checkpointing, P_a, P_a+cpu and the contiguous arena (M_D).

Applied by ``hybrid.parallelize.parallelize`` after the tensor-parallel swap and before ZeRO
wrapping (the handle is ``engine.activation_checkpointing``)::

    engine = parallelize(model, grid, PretrainConfig(activation=ActivationConfig(
        checkpoint_activations=True, partition_activations=True)))

Checkpoints sit at transformer-block inputs ``[b, s, h]`` (``model.layers[i]``), full
recompute. Selective recompute (``selective_recompute``, 2205.05198 §5) instead recomputes only
each block's attention core (:mod:`hybrid.activation.selective`); the two are alternatives, as
Megatron-LM's ``--recompute-granularity full|selective``.

With sequence parallelism (``parallelize_gpt(..., sequence_parallel=True)``) a block input is
already this rank's ``[b, s/t, h]`` slice, ``1/t`` of the replicated input P_a was made for:
the checkpoint is ``B sbh / t`` without P_a, and ``partition_activations`` adds nothing (it is
not applied again, which would mix different ranks' slices; logged). ``checkpoint_in_cpu`` and
the arena work on the slice as they do on P_a's piece. Mechanics are in
:mod:`hybrid.activation.recompute` (checkpoint Function, RNG, P_a gather, host copy) and
:mod:`hybrid.activation.arena` (M_D); the measurement in :mod:`hybrid.activation.saved_bytes`.

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
from typing import TYPE_CHECKING

import torch.nn as nn

from hybrid.activation.config import ActivationConfig
from hybrid.activation.recompute import ActivationStore, CheckpointedForward, CheckpointStats
from hybrid.activation.saved_bytes import format_saved_bytes, measure_saved_bytes  # noqa: F401 (public API)
from hybrid.activation.selective import SelectiveCore
from hybrid.parallel.rng import RNGTracker

if TYPE_CHECKING:
    from hybrid.parallel.grid import ProcessGrid

logger = logging.getLogger(__name__)


class ActivationCheckpointing:
    """The handle returned by :func:`apply_activation_checkpointing`.

    Attributes:
        config: the applied :class:`ActivationConfig`.
        blocks: indices of the checkpointed blocks in ``model.layers``.
        partitioned: whether P_a is in effect (False at tp = 1 even when asked for).
        store: the :class:`hybrid.activation.recompute.ActivationStore` (arena, host copies,
            gathers).
    """

    def __init__(self, model: nn.Module, config: ActivationConfig, store: ActivationStore,
                 blocks: list[int]):
        self.model = model
        self.config = config
        self.store = store
        self.blocks = blocks
        self.partitioned = store.partition
        self._wrappers: list[CheckpointedForward] = []
        self._selective: list[SelectiveCore] = []

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
        if self._selective:
            return (f"selective recompute: attention core of {len(self._selective)}/"
                    f"{len(self.model.layers)} blocks, {s.selective_recomputes} recomputes")
        arena_text = ("off" if not c.contiguous_checkpointing
                      else f"{arena.nbytes} bytes" if arena else "unallocated")
        return (f"activation checkpointing: {len(self.blocks)}/{len(self.model.layers)} blocks, "
                f"partitioned={self.partitioned} (tp={self.store.tp_size}), "
                f"in_cpu={c.checkpoint_in_cpu}, "
                f"arena={arena_text}; {s.checkpoints} checkpoints, {s.recomputes} "
                f"recomputes, {s.allgathers} all-gathers")

    def remove(self) -> None:
        """Undo the wrapping: blocks run their plain forward again."""
        for w in self._wrappers:
            if w.block.__dict__.get("forward") is w:
                del w.block.forward
                if w.replaced is not None:
                    w.block.forward = w.replaced
        self._wrappers.clear()
        for core in self._selective:
            core.remove()
        self._selective.clear()


def _find_tracker(model: nn.Module, tracker: RNGTracker | None) -> RNGTracker | None:
    found = {id(t): t for m in model.modules()
             if isinstance(t := getattr(m, "tracker", None), RNGTracker)}
    if tracker is not None:
        found.pop(id(tracker), None)
        if found:
            raise ValueError("the model's TP-region dropout uses a different RNGTracker than the "
                             "one passed to apply_activation_checkpointing; pass that tracker")
        return tracker
    if len(found) > 1:
        raise ValueError(f"the model uses {len(found)} RNGTrackers; pass the one to save and "
                         "restore")
    return next(iter(found.values()), None)


def apply_activation_checkpointing(model: nn.Module, grid: ProcessGrid, config: ActivationConfig,
                                   tracker: RNGTracker | None = None) -> ActivationCheckpointing:
    """Checkpoint ``model.layers[i]`` for the first ``config.num_checkpointed(L)`` blocks, or
    with ``config.selective_recompute`` wrap every block's attention core, in place.

    Call after ``parallelize_gpt`` and before ZeRO wrapping. Parameter names are unchanged.

    Args:
        model: a (tensor-parallel) GPT whose ``layers`` take and return one ``[b, s, h]`` tensor.
        grid: the :class:`hybrid.parallel.grid.ProcessGrid` (P_a uses ``grid.tp_group``).
        config: the options; validated against ``len(model.layers)``.
        tracker: the TP dropout stream; None means the model's own (found on its modules).

    Returns:
        An :class:`ActivationCheckpointing` handle (counters, arena,
        :meth:`~ActivationCheckpointing.measure`).

    Raises:
        ValueError: inconsistent config, or a tracker different from the model's.
        RuntimeError: the model is already checkpointed.
    """
    layers = model.layers
    config.validate(len(layers))
    tracker = _find_tracker(model, tracker)
    n = config.num_checkpointed(len(layers))
    if any(isinstance(b.__dict__.get("forward"), CheckpointedForward)
           or isinstance(b.attn.__dict__.get("core"), SelectiveCore) for b in layers):
        raise RuntimeError("model.layers are already checkpointed; call handle.remove() first")
    sequence_parallel = any(getattr(m, "sequence_parallel", False) for m in model.modules())
    store = ActivationStore(grid.tp_group, config.partition_activations, config.checkpoint_in_cpu,
                            n if config.contiguous_checkpointing and n else None, tracker,
                            sequence_parallel=sequence_parallel)
    if config.partition_activations and not store.partition:
        logger.info("partition_activations: no effect at tensor-model-parallel size 1 "
                    "(each rank keeps the whole checkpoint)" if store.tp_size == 1 else
                    "partition_activations: no effect with sequence parallelism (each block input "
                    "is already this rank's 1/tp sequence slice)")
    handle = ActivationCheckpointing(model, config, store, list(range(n)))
    if config.selective_recompute:
        for block in layers:
            core = SelectiveCore(block.attn, store)
            block.attn.core = core
            handle._selective.append(core)
    for i in handle.blocks:
        wrapper = CheckpointedForward(layers[i], i, store)
        layers[i].forward = wrapper
        handle._wrappers.append(wrapper)
    if n or config.selective_recompute:
        logger.info(handle.summary())
    return handle
