"""Activation checkpointing and ZeRO-R activation options: the ``activation`` section of the
config tree (Megatron-LM / DeepSpeed flag names)."""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.config_fields import ConfigError, arg, check_int

RECOMPUTE_GRANULARITIES = ("full", "selective")
"""Megatron-LM's ``--recompute-granularity``: whole blocks, or the attention core only
(2205.05198 §5)."""
RECOMPUTE_METHODS = ("uniform", "block")
"""Megatron-core's ``--recompute-method`` for full recompute."""


@dataclass
class ActivationConfig:
    """Activation checkpointing and ZeRO-R P_a / P_a+cpu / M_D (arXiv 1910.02054 §6.1, §6.3).

    Megatron-core's ``--recompute-granularity full --recompute-method block
    --recompute-num-layers N`` checkpoints the first N blocks and keeps every activation of the
    others (the memory/compute trade-off when a few blocks fit without recompute; N is
    :attr:`first_blocks`). DeepSpeed's equivalent knob is ``number_checkpoints``, which also
    sizes its contiguous buffers, as N sizes our arena.
    """

    checkpoint_activations: bool = arg(
        False, "recompute each transformer block in backward (full activation checkpointing)")
    partition_activations: bool = arg(
        False, "keep only this TP rank's 1/tp slice of each checkpoint (ZeRO-R Pa)")
    checkpoint_in_cpu: bool = arg(
        False, "keep the partitioned checkpoint slices in host memory (ZeRO-R Pa+cpu)")
    contiguous_checkpointing: bool = arg(
        False, "write checkpoints into one preallocated arena (ZeRO-R MD)")
    recompute_granularity: str | None = arg(
        None, "'full' recomputes whole blocks (= --checkpoint-activations, see "
              "--recompute-method); 'selective' recomputes only each block's attention core "
              "(arXiv 2205.05198 §5)",
        choices=RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = arg(
        None, "with --recompute-granularity full: 'uniform' checkpoints the input of every chunk "
              "of --recompute-num-layers blocks, 'block' checkpoints only the first "
              "--recompute-num-layers blocks (default: uniform)", choices=RECOMPUTE_METHODS)
    recompute_num_layers: int | None = arg(
        None, "uniform: blocks per recomputed chunk (only 1 is implemented); block: how many of "
              "the first blocks are recomputed (default 1 for uniform, every block for block)")

    def __post_init__(self) -> None:
        if self.recompute_granularity == "full":
            self.checkpoint_activations = True
        self._apply_recompute_method()
        self.validate()

    def _apply_recompute_method(self) -> None:
        """Check Megatron-core's ``--recompute-method``/``--recompute-num-layers``."""
        given = [f"--{k.replace('_', '-')} {getattr(self, k)}"
                 for k in ("recompute_method", "recompute_num_layers")
                 if getattr(self, k) is not None]
        if not given:
            return
        if self.recompute_granularity != "full":
            raise ConfigError(f"{' '.join(given)} needs --recompute-granularity full")
        check_int(self, "recompute_num_layers", 1, optional=True)
        n = self.recompute_num_layers
        if n is not None and n < 1:
            raise ConfigError(f"--recompute-num-layers {n} must be >= 1")
        if (self.recompute_method or "uniform") == "uniform":
            if n not in (None, 1):
                raise ConfigError(
                    f"--recompute-method uniform --recompute-num-layers {n} (one checkpoint per "
                    f"chunk of {n} blocks) is not implemented; use --recompute-num-layers 1 (every "
                    f"block) or --recompute-method block --recompute-num-layers {n} (only the "
                    f"first {n} blocks)")

    @property
    def first_blocks(self) -> int | None:
        """N of ``--recompute-method block --recompute-num-layers N``: only the first N blocks are
        checkpointed; None: every block is (when checkpointing at all)."""
        return self.recompute_num_layers if self.recompute_method == "block" else None

    @property
    def selective_recompute(self) -> bool:
        """Recompute only the attention core of every block (``--recompute-granularity
        selective``)."""
        return self.recompute_granularity == "selective"

    def validate(self, num_layers: int | None = None) -> None:
        """Check field combinations (and :attr:`first_blocks` against ``num_layers``).

        Raises:
            ConfigError: naming the offending field and value.
        """
        n = self.first_blocks
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(f"--recompute-granularity {self.recompute_granularity!r}: valid "
                              "values are 'full', 'selective'")
        if self.selective_recompute and self.checkpoint_activations:
            raise ConfigError("--recompute-granularity selective and --checkpoint-activations "
                              "(full recompute) are alternatives: give one")
        if not self.checkpoint_activations:
            for name in ("partition_activations", "checkpoint_in_cpu", "contiguous_checkpointing"):
                if getattr(self, name):
                    flag = f"--{name.replace('_', '-')}"
                    raise ConfigError(f"{name}=True needs checkpoint_activations=True ({flag} "
                                      "needs --checkpoint-activations)")
        if self.checkpoint_in_cpu and not self.partition_activations:
            raise ConfigError("--checkpoint-in-cpu offloads the partitioned checkpoints: add "
                              "--partition-activations")
        if num_layers is not None and n is not None and n > num_layers:
            raise ConfigError(f"--recompute-num-layers {n} exceeds the model's "
                              f"num_layers={num_layers}")

    def num_checkpointed(self, num_layers: int) -> int:
        """How many of ``num_layers`` blocks are checkpointed."""
        if not self.checkpoint_activations:
            return 0
        return num_layers if self.first_blocks is None else self.first_blocks
