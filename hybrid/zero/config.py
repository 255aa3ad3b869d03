"""Configuration of the ZeRO engine and of its AdamW optimizer: two sections of the config tree.

``PretrainConfig.zero`` and ``PretrainConfig.optimizer`` are these classes; their fields are
also the command-line flags (``hybrid.job.cli``). Units: bucket sizes and thresholds are counts of
*elements*, never bytes (as in DeepSpeed's ``reduce_bucket_size``). Validation runs in
``__post_init__`` and raises :class:`hybrid.config_fields.ConfigError` (a ``ValueError``)
naming the flag, the field and the bad value, before any process group is touched.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from hybrid.config_fields import arg, check_choice, check_int, check_number, fail
from hybrid.zero.quantize import QUANT_BITS
from hybrid.zero.stage import GRAD_REDUCE_OPS, ZERO_STAGES, StagePlan, stage_plan

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Training precision name -> parameter/compute dtype (master weights and gradients stay fp32)."""

STAGE_SETTINGS = {
    "optimizer_cpu_offload": (1, False),
    "overlap_param_gather": (1, False),
    "quantized_gradients": (2, False),
    "hpz_partition_size": (3, 1),
    "quantized_weights": (3, False),
}
"""The settings only some ZeRO stages take: field -> (the lowest stage that takes it, its value
when off). Every higher stage takes it too, so a search over stages (``hybrid.plan``) validates
its settings once at the highest stage it searches and plans each lower stage with
:meth:`ZeroConfig.at_stage`; :meth:`ZeroConfig.validate` refuses a setting below its stage."""


@dataclass
class ZeroConfig:
    """ZeRO data parallelism over the grid's data-parallel group (arXiv 1910.02054 §5)."""

    stage: int = arg(
        1, "ZeRO stage over the data-parallel group: 0 (plain data parallel), 1 (+ fp32 master "
           "and Adam moments partitioned), 2 (+ gradients reduce-scattered during backward), "
           "3 (+ parameters partitioned, gathered per transformer block)", flag="--zero-stage")
    reduce_bucket_size: int = arg(
        50_000_000, "gradient reduce bucket size, in elements (all ranks' chunks together)")
    allgather_bucket_size: int = arg(
        50_000_000, "parameter all-gather bucket size, in elements (all ranks' chunks)")
    grad_reduce: str = arg(
        "reduce_scatter", "ZeRO 1-3 gradient collective: reduce_scatter (the ZeRO paper's Psi "
                          "per step; on gloo an all-to-all + sum) or all_reduce keeping the owned "
                          "slices (2 Psi)",
        choices=GRAD_REDUCE_OPS)
    overlap_comm: bool = arg(
        True, "overlap gradient communication with backward (off: reduce after backward); "
              "Megatron-LM's --overlap-grad-reduce, on by default here (off, ZeRO-2/3 would hold "
              "every gradient until backward ends)", alt_flags=("--overlap-grad-reduce",))
    overlap_param_gather: bool = arg(
        False, "ZeRO 1-3: launch the all-gather of the updated parameters after the optimizer "
               "step and wait for each unit's in the next forward's pre-hook (Megatron-LM's "
               "meaning and default; off: gathered before step() returns)")
    gradient_accumulation_fusion: bool = arg(
        True, "gradients accumulate straight into the flat main-grad buffer (stage 0/1: "
              "p.grad is a view of it when the dtypes agree; stage 1 reduce-scatters each unit "
              "in place; stage 2/3 stage once and average after the reduce-scatter); off: one "
              "add per parameter and staging copies (Megatron-LM's flag and default)")
    grad_reduce_in_bf16: bool = arg(
        False, "--bf16 only: gradients are held, accumulated and reduced in bf16 (half the "
               "bytes); the optimizer still steps fp32 master weights (Megatron-LM's meaning)")
    optimizer_cpu_offload: bool = arg(
        False, "ZeRO 1-3: the fp32 master weights and Adam moments of this rank's partition live "
               "in host memory (pinned on CUDA) and AdamW steps on the host; reduced gradients "
               "go device->host per unit as their reduction ends, updated parameters come back "
               "(Megatron-LM's flag; ZeRO-Offload, arXiv 2101.06840)")
    optimizer_offload_fraction: float = arg(
        1.0, "with --optimizer-cpu-offload: the share of the partition's optimizer states "
             "offloaded (0-1; units taken in flat order until the share is reached, the rest "
             "stays on the device; Megatron-LM's flag and default)")
    optimizer_cpu_threads: int = arg(
        0, "with --optimizer-cpu-offload: torch threads of the host AdamW step (0: the "
           "process's torch.get_num_threads(), i.e. OMP_NUM_THREADS)")
    quantized_gradients: bool = arg(
        False, "ZeRO++ qgZ (arXiv 2306.10209 §3.3): ZeRO-2/3 gradient reduce-scatter as blockwise "
               "int4/int8 (fp32 scale per 256 elements) over a hierarchical all-to-all, intra-node "
               "then inter-node; error <= sum of the ranks' max |g| / qmax per element "
               "(DeepSpeed's zero_quantized_gradients; --bf16 / --fp16)",
        flag="--zero-quantized-gradients")
    quantized_gradients_bits: int = arg(
        4, "qgZ code width: 4 (DeepSpeed's int4, qmax 7) or 8 (int8, qmax 127: 18x tighter "
           "bound, twice the bytes)", flag="--zero-quantized-gradients-bits", choices=QUANT_BITS)
    param_persistence_threshold: int = arg(
        100_000, "ZeRO-3 keeps parameters with fewer local elements than this unpartitioned "
                 "(0: none)")
    hpz_partition_size: int = arg(
        1, "ZeRO++ hpZ (arXiv 2306.10209 §3.2): keep a secondary ZeRO-3 parameter shard over this "
           "many data-parallel ranks of one node, so backward gathers stay inside the node; 1: "
           "off (DeepSpeed's zero_hpz_partition_size; --zero-stage 3, exact)",
        flag="--zero-hpz-partition-size")
    quantized_weights: bool = arg(
        False, "ZeRO++ qwZ (arXiv 2306.10209 §3.1): ZeRO-3 parameter all-gathers in blockwise "
               "int8 with an fp32 scale per 2048 elements (error <= scale/2 per element); the "
               "master weights stay exact (DeepSpeed's zero_quantized_weights; --zero-stage 3, "
               "--bf16 / --fp16)", flag="--zero-quantized-weights")
    precision: str = arg(
        "fp32", "parameter/compute dtype; master weights stay fp32, gradients too unless "
                "--grad-reduce-in-bf16 (--bf16 / --fp16 set it)", choices=tuple(PRECISIONS),
        aliases={"--bf16": "bf16", "--fp16": "fp16"})
    loss_scale: float | None = arg(None, "static loss scale for fp16 (default: dynamic)")
    initial_loss_scale: float = arg(2.0**32, "initial dynamic fp16 loss scale (a power of two)")
    loss_scale_window: int = arg(
        1000, "fp16: clean steps after the last overflow before the scale doubles")
    hysteresis: int = arg(
        2, "fp16: overflows tolerated (each still skips its step) before the scale halves")
    min_loss_scale: float = arg(1.0, "fp16: the dynamic loss scale never goes below this")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of ``precision``."""
        return PRECISIONS[self.precision]

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are accumulated and reduced in (bf16 with ``grad_reduce_in_bf16``,
        else fp32)."""
        return torch.bfloat16 if self.grad_reduce_in_bf16 else torch.float32

    @property
    def offload_fraction(self) -> float:
        """The share of the optimizer partition kept in host memory (0 without offload)."""
        return self.optimizer_offload_fraction if self.optimizer_cpu_offload else 0.0

    @property
    def plan(self) -> StagePlan:
        """What this stage partitions and how it reduces (:func:`hybrid.zero.stage.stage_plan`)."""
        return stage_plan(self.stage, self.grad_reduce, self.param_persistence_threshold)

    def at_stage(self, stage: int, **changes) -> ZeroConfig:
        """This config at ZeRO ``stage``, with the settings that stage does not take
        (:data:`STAGE_SETTINGS`) off and ``changes`` (other fields) applied: what a search over
        stages plans at each one.

        Raises:
            ConfigError: as :meth:`validate`, e.g. a bad stage, or ``changes`` the stage refuses.
        """
        off = {name: value for name, (lowest, value) in STAGE_SETTINGS.items() if stage < lowest}
        return dataclasses.replace(self, stage=stage, **{**off, **changes})

    def _below_stage(self, name: str) -> bool:
        """Setting ``name`` (of :data:`STAGE_SETTINGS`) is on at a stage that does not take it."""
        lowest, off = STAGE_SETTINGS[name]
        return getattr(self, name) != off and self.stage < lowest

    def _check_qgz(self) -> None:
        """qgZ against the stage, the gradient collective and the precision."""
        check_choice(self, "quantized_gradients_bits", QUANT_BITS)
        if not self.quantized_gradients:
            return
        if self._below_stage("quantized_gradients"):
            fail(self, "quantized_gradients", "qgZ quantizes the ZeRO-2/3 gradient "
                 f"reduce-scatter; --zero-stage is {self.stage} (use --zero-stage 2 or 3)")
        if self.grad_reduce != "reduce_scatter":
            fail(self, "quantized_gradients", "qgZ replaces the gradient reduce-scatter; "
                 f"--grad-reduce is {self.grad_reduce} (use reduce_scatter)")
        if self.precision == "fp32":
            fail(self, "quantized_gradients", "qgZ replaces 16-bit gradient reduce-scatters; an "
                 "fp32 run would lose its exactness for nothing (use --bf16 or --fp16)")

    def validate(self) -> None:
        """Check every field.

        Raises:
            ConfigError: naming the first bad field, its flag and its value.
        """
        check_choice(self, "stage", ZERO_STAGES)
        for name in ("reduce_bucket_size", "allgather_bucket_size", "loss_scale_window",
                     "hysteresis"):
            check_int(self, name, 1)
        check_int(self, "param_persistence_threshold", 0)
        check_choice(self, "precision", tuple(PRECISIONS))
        check_number(self, "loss_scale", 0.0, strict=True, optional=True)
        s = self.initial_loss_scale
        if not (isinstance(s, int | float) and math.isfinite(s) and s >= 1
                and 2 ** round(math.log2(s)) == s):
            fail(self, "initial_loss_scale", "must be a power of two >= 1")
        check_number(self, "min_loss_scale", 0.0, strict=True)
        if self.loss_scale is not None and self.precision != "fp16":
            fail(self, "loss_scale", "a loss scale applies to fp16 only; precision is "
                 f"{self.precision}, which trains without one (drop --loss-scale, or use --fp16)")
        if self.loss_scale is None and self.min_loss_scale > self.initial_loss_scale:
            fail(self, "min_loss_scale", "must be <= --initial-loss-scale "
                 f"{self.initial_loss_scale!r}, where the dynamic loss scale starts")
        check_choice(self, "grad_reduce", GRAD_REDUCE_OPS)
        if self.grad_reduce_in_bf16 and self.precision != "bf16":
            fail(self, "grad_reduce_in_bf16", "bf16 gradients need bf16 training (--bf16); "
                 f"precision is {self.precision}, whose gradients stay fp32")
        f = self.optimizer_offload_fraction
        if not (isinstance(f, int | float) and not isinstance(f, bool) and 0.0 <= f <= 1.0):
            fail(self, "optimizer_offload_fraction", "must be a number in [0, 1] (the share "
                 "of the optimizer states in host memory)")
        check_int(self, "optimizer_cpu_threads", 0)
        if self._below_stage("optimizer_cpu_offload"):
            fail(self, "optimizer_cpu_offload", "offloads the partition of ZeRO 1-3; stage 0 "
                 "keeps every optimizer state on every rank (dp copies of the host memory): "
                 "use --zero-stage 1, 2 or 3")
        if self._below_stage("overlap_param_gather"):
            fail(self, "overlap_param_gather", "stage 0 gathers no parameters (it copies the "
                 "whole master); use --zero-stage 1, 2 or 3 (Megatron-LM: the distributed "
                 "optimizer)")
        self._check_zeropp()
        if self.overlap_param_gather and not self.overlap_comm:
            fail(self, "overlap_param_gather", "needs --overlap-grad-reduce (as in Megatron-LM); "
                 "drop --no-overlap-grad-reduce")
        self._check_qgz()

    def _check_zeropp(self) -> None:
        """ZeRO++ settings against the stage and precision (the node fit is checked against the
        world by :func:`hybrid.zero.topology.NodeTopology.check_intra_size`)."""
        check_int(self, "hpz_partition_size", 1)
        if self._below_stage("hpz_partition_size"):
            fail(self, "hpz_partition_size", "hpZ partitions the ZeRO-3 parameters a second "
                 f"time; --zero-stage is {self.stage} (use --zero-stage 3, or size 1 for off)")
        if self._below_stage("quantized_weights"):
            fail(self, "quantized_weights", "qwZ quantizes the ZeRO-3 parameter gathers; "
                 f"--zero-stage is {self.stage} (use --zero-stage 3)")
        if self.quantized_weights and self.precision == "fp32":
            fail(self, "quantized_weights", "qwZ replaces 16-bit parameter gathers; an fp32 run "
                 "would lose its exactness for nothing (use --bf16 or --fp16)")


@dataclass
class OptimizerConfig:
    """AdamW (torch.optim.AdamW, arXiv 1711.05101) with global gradient-norm clipping."""

    lr: float = arg(
        3e-4, "peak learning rate (the schedule's; ZeroEngine.step(lr) sets it every step)")
    weight_decay: float = arg(
        0.01, "AdamW decoupled weight decay (not applied to biases and norms)")
    decoupled_lr: float | None = arg(
        None, "peak learning rate of the word embedding and the output layer (Megatron-LM's "
              "decoupled learning rate; default --lr)")
    adam_beta1: float = arg(0.9, "AdamW beta1 (first-moment decay)")
    adam_beta2: float = arg(0.999, "AdamW beta2 (second-moment decay)")
    adam_eps: float = arg(1e-8, "AdamW epsilon")
    clip_grad: float = arg(
        1.0, "global gradient-norm clip, L2 over every distinct element (0 disables)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field.

        Raises:
            ConfigError: naming the first bad field, its flag and its value.
        """
        for name in ("lr", "weight_decay", "adam_eps", "clip_grad"):
            check_number(self, name, 0.0)
        check_number(self, "decoupled_lr", 0.0, optional=True)
        for name in ("adam_beta1", "adam_beta2"):
            check_number(self, name, 0.0, high=1.0)
