"""The pretraining job's configuration: one typed dataclass tree (STYLE.md rule 6).

Each field's ``help`` is its one-line docstring; the CLI (``hybrid.cli``) is generated from
these dataclasses with Megatron-LM's flag names (``num_layers`` -> ``--num-layers``), and a
YAML/TOML ``--config`` file can supply the same fields. :func:`validate` does every
cross-field check before any process group starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def arg(default, help: str, **extra):
    """A config field: ``default`` value and its one-line ``help`` (also the CLI help)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=dict(help=help, **extra))
    return field(default=default, metadata=dict(help=help, **extra))


@dataclass
class ModelArgs:
    """Model shape (``models.gpt.GPTConfig``) or a preset name."""

    preset: str | None = arg(None, "model preset (models.presets), e.g. gpt2-124m; explicit flags override it")
    num_layers: int | None = arg(None, "number of transformer blocks")
    hidden_size: int | None = arg(None, "model width h")
    num_attention_heads: int | None = arg(None, "attention heads")
    ffn_hidden_size: int | None = arg(None, "MLP inner width (default 4 * hidden size)")
    seq_length: int = arg(1024, "tokens per training sample")
    max_position_embeddings: int | None = arg(None, "position table size (default: seq length, or the preset's)")
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this times the TP size")
    vocab_size: int | None = arg(None, "vocabulary size (default: the tokenizer's; required with --mock-data without a tokenizer)")
    hidden_dropout: float = arg(0.1, "dropout on embeddings and residual branches")
    attention_dropout: float = arg(0.1, "dropout on attention probabilities")
    init_method_std: float = arg(0.02, "std of the normal weight init")
    layernorm_epsilon: float = arg(1e-5, "LayerNorm epsilon")
    untie_embeddings_and_output_weights: bool = arg(False, "give the output layer its own weight")


@dataclass
class ParallelArgs:
    """Process grid, ZeRO and activation memory (ZeRO-R)."""

    tensor_model_parallel_size: int = arg(1, "tensor-model-parallel size (consecutive ranks, inside one node)")
    zero_stage: int = arg(1, "ZeRO stage over the data-parallel group: 0, 1, 2 or 3")
    reduce_bucket_size: int = arg(50_000_000, "gradient reduce bucket size, in elements")
    allgather_bucket_size: int = arg(50_000_000, "parameter all-gather bucket size, in elements")
    overlap_comm: bool = arg(True, "overlap gradient communication with backward")
    param_persistence_threshold: int = arg(100_000, "ZeRO-3 keeps parameters smaller than this (elements) unpartitioned")
    checkpoint_activations: bool = arg(False, "recompute each transformer block in backward (full activation checkpointing)")
    checkpoint_num_layers: int | None = arg(None, "checkpoint only the first N blocks (default: all)")
    partition_activations: bool = arg(False, "keep only this TP rank's 1/tp slice of each checkpoint (ZeRO-R Pa)")
    checkpoint_in_cpu: bool = arg(False, "keep the checkpoint slices in host memory (ZeRO-R Pa+cpu)")
    contiguous_checkpointing: bool = arg(False, "write checkpoints into one preallocated arena (ZeRO-R MD)")
    distributed_timeout_minutes: float = arg(10.0, "collective timeout, in minutes")
    dry_run_world_size: int | None = arg(None, "dry run: build one rank of an N-rank job with a fake process group and fake tensors, run one step, print its memory (no devices, no data)")
    dry_run_rank: int = arg(0, "the rank the dry run builds (0 .. N-1)")


@dataclass
class OptimArgs:
    """Batch, optimiser, schedule and precision."""

    micro_batch_size: int = arg(1, "samples per rank per forward/backward")
    global_batch_size: int | None = arg(None, "samples per optimizer step (default: micro batch x data-parallel size)")
    train_iters: int = arg(100, "optimizer steps to run")
    lr: float = arg(3e-4, "peak learning rate")
    min_lr: float = arg(0.0, "learning rate at the end of the decay")
    lr_decay_style: str = arg("cosine", "learning-rate decay after warmup", choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = arg(0, "linear warmup steps")
    lr_warmup_fraction: float | None = arg(None, "warmup as a fraction of the decay steps (overrides --lr-warmup-iters)")
    lr_decay_iters: int | None = arg(None, "steps over which the LR decays (default: --train-iters)")
    weight_decay: float = arg(0.01, "AdamW weight decay (not applied to biases and norms)")
    adam_beta1: float = arg(0.9, "AdamW beta1")
    adam_beta2: float = arg(0.999, "AdamW beta2")
    adam_eps: float = arg(1e-8, "AdamW epsilon")
    clip_grad: float = arg(1.0, "global gradient-norm clip (0 disables)")
    bf16: bool = arg(False, "bf16 mixed precision (fp32 master weights)")
    fp16: bool = arg(False, "fp16 mixed precision with dynamic loss scaling")
    loss_scale: float | None = arg(None, "static loss scale for fp16 (default: dynamic)")
    initial_loss_scale: float = arg(2.0**32, "initial dynamic loss scale (a power of two)")
    loss_scale_window: int = arg(1000, "steps without overflow before the scale doubles")
    hysteresis: int = arg(2, "overflows tolerated before the scale halves")
    min_loss_scale: float = arg(1.0, "smallest dynamic loss scale")
    max_nan_iterations: int = arg(10, "stop after this many consecutive iterations with a NaN/inf loss")


@dataclass
class DataArgs:
    """Training data."""

    data_path: list[str] = arg([], "dataset prefixes, optionally weighted: 'A' or '0.3 A 0.7 B'", nargs="*")
    split: str = arg("969,30,1", "train,valid,test proportions of the documents")
    tokenizer_model: str | None = arg(None, "sentencepiece .model file")
    mock_data: bool = arg(False, "synthetic random tokens instead of --data-path")
    data_cache_path: str | None = arg(None, "where sample indices are cached (default: beside the data)")
    seed: int = arg(1234, "random seed for init, dropout and data shuffling")


@dataclass
class EvalArgs:
    """Evaluation."""

    eval_interval: int = arg(1000, "evaluate on the validation split every N steps")
    eval_iters: int = arg(10, "global batches per evaluation")


@dataclass
class LoggingArgs:
    """Metrics and tracking."""

    log_interval: int = arg(10, "steps between log lines / metrics records")
    metrics_file: str | None = arg(None, "JSONL file with one record per logged step and evaluation")
    wandb_project: str | None = arg(None, "wandb project (wandb is off when unset)")
    wandb_exp_name: str | None = arg(None, "wandb run name")
    wandb_save_dir: str | None = arg(None, "directory for wandb files (default: ./wandb)")


@dataclass
class CheckpointArgs:
    """Checkpoints and graceful stops."""

    save: str | None = arg(None, "directory to save checkpoints to (also where SIGTERM saves)")
    load: str | None = arg(None, "directory to resume from (its latest complete checkpoint; none there: start fresh)")
    save_interval: int | None = arg(None, "save every N iterations (default: only at the end and on a stop)")
    save_keep_last: int | None = arg(None, "keep only the newest K checkpoints (default: all)")
    no_load_optim: bool = arg(False, "load weights but not the optimizer state / loss scaler")
    no_load_rng: bool = arg(False, "do not restore the RNG states")
    finetune: bool = arg(False, "load weights only and start from iteration 0 (new optimizer, schedule, data order)")
    init_from_hf: str | None = arg(None, "start from a local Hugging Face GPT-2 directory's weights, as --finetune does "
                                   "(iteration 0, new optimizer); a checkpoint under --load wins when there is one")
    exit_duration_in_mins: float | None = arg(None, "save and exit cleanly after this many minutes")


@dataclass
class PretrainConfig:
    """Everything one pretraining job needs."""

    model: ModelArgs = field(default_factory=ModelArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    data: DataArgs = field(default_factory=DataArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)

    SECTIONS = ("model", "parallel", "optim", "data", "eval", "logging", "checkpoint")

    def to_dict(self) -> dict:
        """Nested plain dict (for printing, wandb and checkpoints)."""
        return dataclasses.asdict(self)

    def flat_fields(self):
        """``(section, field)`` for every leaf field."""
        for s in self.SECTIONS:
            for f in dataclasses.fields(getattr(self, s)):
                yield s, f
