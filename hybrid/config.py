"""The pretraining job's configuration: one typed dataclass tree.

:class:`PretrainConfig` has one section per component; the component configs *are* the
sections (``cfg.zero`` is the :class:`hybrid.zero.config.ZeroConfig` the engine receives,
``cfg.optimizer`` its :class:`OptimizerConfig`, ``cfg.activation`` the
:class:`ActivationConfig` of activation checkpointing). Every field is declared once with
:func:`hybrid.config_fields.arg` (default, one-line help, Megatron-LM flag name, aliases); the
CLI (``hybrid.job.cli``) and ``--help`` are generated from them, and a YAML/TOML ``--config`` file
can supply the same fields. Each section validates its own fields when built; the checks that
involve two sections, the files the config names or the world size live only in
``hybrid.job.config_checks``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hybrid.activation.config import ActivationConfig
from hybrid.config_fields import ConfigError, arg, check_choice, check_int, check_number, fail
from hybrid.devices import DEFAULT_RESERVED_GIB, device_memory_gib
from hybrid.fusion import FusionConfig
from hybrid.logging_config import LoggingConfig
from hybrid.parallel import sequence
from hybrid.schedule import DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES
from hybrid.zero.config import OptimizerConfig, ZeroConfig
from models.config import NORMALIZATIONS, POSITION_EMBEDDING_TYPES


@dataclass
class ModelConfig:
    """Model shape (``models.gpt.GPTConfig``) or a preset name."""

    preset: str | None = arg(None, "model preset (models.presets), e.g. gpt2-124m; explicit flags "
                                   "override it")
    num_layers: int | None = arg(None, "number of transformer blocks")
    hidden_size: int | None = arg(None, "model width h")
    num_attention_heads: int | None = arg(None, "attention heads")
    ffn_hidden_size: int | None = arg(None, "MLP inner width (default 4 * hidden size)")
    seq_length: int = arg(1024, "tokens per training sample")
    max_position_embeddings: int | None = arg(None, "position table size (default: seq length, or "
                                                    "the preset's)")
    make_vocab_size_divisible_by: int = arg(128, "pad the vocabulary to a multiple of this times "
                                                 "the TP size")
    vocab_size: int | None = arg(None, "vocabulary size (default: the tokenizer's; required with "
                                       "--mock-data without a tokenizer)")
    hidden_dropout: float = arg(0.1, "dropout on embeddings and residual branches")
    attention_dropout: float = arg(0.1, "dropout on attention probabilities")
    init_method_std: float = arg(0.02, "std of the normal weight init")
    layernorm_epsilon: float = arg(1e-5, "epsilon of every LayerNorm / RMSNorm",
                                   flag="--norm-epsilon", alt_flags=("--layernorm-epsilon",))
    untie_embeddings_and_output_weights: bool | None = arg(
        None, "give the output layer its own weight (default: the preset's, else tied)")
    # The architecture flags below default to None: the preset's value, else Megatron-LM's
    # default (models.gpt.GPTConfig); hybrid.job.config_checks resolves them.
    position_embedding_type: str | None = arg(
        None, "learned_absolute, rope or none (default: the preset's, else learned_absolute)",
        choices=POSITION_EMBEDDING_TYPES,
        aliases={"--use-rotary-position-embeddings": "rope"})
    rotary_base: int | None = arg(None, "RoPE base theta (default: the preset's, else 10000)")
    rotary_percent: float | None = arg(None, "fraction of each head's channels RoPE rotates, in "
                                             "(0, 1] (default: the preset's, else 1.0)")
    rotary_interleaved: bool | None = arg(None, "RoPE rotates (even, odd) channel pairs instead "
                                                "of the two halves of each head")
    use_rope_scaling: bool | None = arg(None, "Llama 3.1 RoPE frequency scaling (low/high "
                                              "frequency factors 1 and 4, original context 8192)")
    rope_scaling_factor: float | None = arg(None, "its factor (default: the preset's, else 8.0; "
                                                  "no effect without --use-rope-scaling)")
    normalization: str | None = arg(None, "LayerNorm or RMSNorm (default: the preset's, else "
                                          "LayerNorm)", choices=NORMALIZATIONS)
    swiglu: bool | None = arg(None, "SwiGLU MLP fc2(silu(gate(x)) * up(x)); --ffn-hidden-size is "
                                    "each half (default int(4h * 2/3 / 64) * 64)")
    group_query_attention: bool | None = arg(None, "grouped-query attention with "
                                                   "--num-query-groups K/V heads")
    num_query_groups: int | None = arg(None, "K/V heads under --group-query-attention (default: "
                                             "the preset's, else 1; ignored without it)")
    kv_channels: int | None = arg(None, "channels per attention head (default: hidden size / "
                                        "heads)")
    add_bias_linear: bool | None = arg(None, "biases on every linear layer (default: the preset's, "
                                             "else on)", aliases={"--disable-bias-linear": False})
    add_qkv_bias: bool | None = arg(None, "bias on the QKV projection even with "
                                          "--disable-bias-linear")
    qk_layernorm: bool | None = arg(None, "normalise q and k per head (the model's norm kind) "
                                          "before RoPE")
    apply_layernorm_1p: bool | None = arg(None, "zero-centred norm weights: every norm scales by "
                                                "1 + w, w initialised to 0 (Megatron-LM's)")

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "max_position_embeddings", "vocab_size", "num_query_groups", "kv_channels",
                     "rotary_base"):
            check_int(self, name, 1, optional=True)
        check_int(self, "seq_length", 1)
        check_int(self, "make_vocab_size_divisible_by", 1)
        for name in ("hidden_dropout", "attention_dropout"):
            check_number(self, name, 0.0, high=1.0)
        check_number(self, "layernorm_epsilon", 0.0, strict=True)
        check_number(self, "rope_scaling_factor", 0.0, strict=True, optional=True)
        for name, valid in (("position_embedding_type", POSITION_EMBEDDING_TYPES),
                            ("normalization", NORMALIZATIONS)):
            if getattr(self, name) is not None:
                check_choice(self, name, valid)
        p = self.rotary_percent
        if p is not None and not (isinstance(p, int | float) and 0 < p <= 1):
            fail(self, "rotary_percent", "must be in (0, 1] (the fraction of each head's "
                                         "channels that rotate)")


@dataclass
class GridConfig:
    """The process grid: tensor parallel inside a node, data parallel across (the rest of the
    world)."""

    tensor_model_parallel_size: int = arg(1, "tensor-model-parallel size (consecutive ranks, "
                                             "inside one node)")
    sequence_parallel: bool = arg(False, "shard LayerNorm/dropout activations along the sequence "
                                         "over the TP group (arXiv 2205.05198 §4.2.2; needs the "
                                         "seq length divisible by tp)")
    tp_comm_overlap: bool = arg(False, "pipeline SP's all-gather / reduce-scatter with the "
                                       "block GEMMs, chunk by chunk (collective matmul; needs "
                                       "--sequence-parallel and tp > 1)")
    distributed_timeout_minutes: float = arg(10.0, "collective timeout, in minutes")
    def __post_init__(self) -> None:
        check_int(self, "tensor_model_parallel_size", 1)
        if self.tp_comm_overlap and not self.sequence_parallel_active:
            fail(self, "tp_comm_overlap", sequence.TP_COMM_OVERLAP_NEEDS_SP + " (got "
                 f"--sequence-parallel {self.sequence_parallel}, --tensor-model-parallel-size "
                 f"{self.tensor_model_parallel_size})")
        check_number(self, "distributed_timeout_minutes", 0.0, strict=True)

    @property
    def sequence_parallel_active(self) -> bool:
        """``sequence_parallel`` as it takes effect: only when tp > 1
        (:func:`hybrid.parallel.sequence.sequence_parallel_active`)."""
        return sequence.sequence_parallel_active(self.sequence_parallel,
                                                 self.tensor_model_parallel_size)


@dataclass
class DryRunConfig:
    """The dry run (``hybrid.dryrun``): one rank of an N-rank job on fake tensors, and the GPU its
    memory verdict compares with."""

    dry_run_world_size: int | None = arg(None, "dry run: build one rank of an N-rank job with a "
                                               "fake process group and fake tensors, run one step, "
                                               "print its memory (no devices, no data)")
    dry_run_rank: int = arg(0, "the rank the dry run builds (0 .. N-1)")
    dry_run_device: str = arg("cpu", "dry run: the device of its fake tensors; cuda: fake "
                                     "cuda:LOCAL_RANK tensors on this CPU (a tensor on the wrong "
                                     "device fails as on a GPU; builds a small C++ extension)",
                              choices=("cpu", "cuda"))
    dry_run_micro_batches: int = arg(1, "dry run: micro-batches its step runs (the memory peak "
                                        "repeats per micro-batch once the buffers exist)")
    device: str | None = arg(None, "dry run: the GPU its verdict compares with, a hybrid.plan "
                                   "preset (default: A100-80GB)")
    gpu_memory_gib: float | None = arg(None, "dry run: GiB per GPU for its verdict (default: "
                                             "--device's)")
    reserved_gib: float = arg(DEFAULT_RESERVED_GIB, "dry run: GiB per GPU held back for the CUDA "
                                                    "context, as hybrid.plan --reserved-gib")

    def __post_init__(self) -> None:
        check_choice(self, "dry_run_device", ("cpu", "cuda"))
        check_int(self, "dry_run_micro_batches", 1)
        check_number(self, "gpu_memory_gib", 0.0, strict=True, optional=True)
        check_number(self, "reserved_gib", 0.0)
        try:
            device_memory_gib(self.device, self.gpu_memory_gib, self.reserved_gib)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.dry_run_device != "cpu" and self.dry_run_world_size is None:
            fail(self, "dry_run_device", "needs --dry-run-world-size N (a dry run)")


@dataclass
class TrainingConfig:
    """Batch, number of steps and the learning-rate schedule (its peak is ``optimizer.lr``)."""

    micro_batch_size: int = arg(1, "samples per rank per forward/backward")
    global_batch_size: int | None = arg(None, "samples per optimizer step (default: micro batch x "
                                              "data-parallel size)")
    train_iters: int | None = arg(None, "optimizer steps to run (default: --train-samples // "
                                        "global batch, else 100)")
    train_samples: int | None = arg(None, "samples to train on, instead of --train-iters "
                                          "(sample-based training, Megatron-LM's)")
    min_lr: float = arg(0.0, "learning rate at the end of the decay")
    decoupled_min_lr: float | None = arg(
        None, "learning rate of the embedding and output layer at the end of the decay (with "
              "--decoupled-lr; default --min-lr)")
    calculate_per_token_loss: bool = arg(
        False, "weigh every unmasked token of the global batch alike: each micro-batch's loss "
               "sum over the global batch's token count (default: the mean of micro-batch "
               "means, Megatron-LM's)")
    lr_decay_style: str = arg("linear", "learning-rate decay after warmup (Megatron-LM's styles)",
                              choices=DECAY_STYLES)
    lr_warmup_iters: int = arg(0, "linear warmup steps (from --lr-warmup-init to --lr)")
    lr_warmup_fraction: float | None = arg(None, "warmup as a fraction of the decay steps "
                                                 "(instead of --lr-warmup-iters)")
    rampup_batch_size: list[str] | None = arg(
        None, "START INCR SAMPLES: grow the global batch from START by INCR over SAMPLES samples "
              "(sample-based training)", nargs=3)
    lr_warmup_samples: int = arg(0, "linear warmup in samples (sample-based training)")
    lr_decay_samples: int | None = arg(None, "samples over which the LR decays (sample-based; "
                                             "default: --train-samples)")
    lr_wsd_decay_samples: int | None = arg(None, "samples of the WSD style's final anneal "
                                                 "(sample-based training)")
    lr_warmup_init: float = arg(0.0, "learning rate of the first iteration (warmup start)")
    lr_decay_iters: int | None = arg(None,
                                     "steps over which the LR decays (default: --train-iters)")
    lr_wsd_decay_style: str = arg("exponential", "anneal of the WSD style's final phase",
                                  choices=WSD_DECAY_STYLES)
    lr_wsd_decay_iters: int | None = arg(None, "steps of the WSD style's final anneal (the last "
                                               "ones of --lr-decay-iters)")
    start_weight_decay: float | None = arg(None, "weight decay at the start of a linear/cosine "
                                                 "--weight-decay-incr-style")
    end_weight_decay: float | None = arg(None, "weight decay at --train-iters of a linear/cosine "
                                               "--weight-decay-incr-style")
    weight_decay_incr_style: str = arg("constant", "weight decay increment (constant: "
                                                   "--weight-decay)", choices=WD_INCR_STYLES)
    max_nan_iterations: int = arg(10,
                                  "stop after this many consecutive iterations with a NaN/inf loss")

    def __post_init__(self) -> None:
        check_int(self, "micro_batch_size", 1)
        check_int(self, "global_batch_size", 1, optional=True)
        check_int(self, "train_iters", 1, optional=True)
        check_int(self, "train_samples", 1, optional=True)
        check_number(self, "min_lr", 0.0)
        check_number(self, "decoupled_min_lr", 0.0, optional=True)
        check_choice(self, "lr_decay_style", DECAY_STYLES)
        check_int(self, "lr_warmup_iters", 0)
        f = self.lr_warmup_fraction
        if f is not None and not (isinstance(f, int | float) and 0 <= f <= 1):
            fail(self, "lr_warmup_fraction", "must be in [0, 1] or unset")
        check_int(self, "lr_decay_iters", 1, optional=True)
        check_number(self, "lr_warmup_init", 0.0)
        check_choice(self, "lr_wsd_decay_style", WSD_DECAY_STYLES)
        check_int(self, "lr_wsd_decay_iters", 1, optional=True)
        check_int(self, "lr_warmup_samples", 0)
        check_int(self, "lr_decay_samples", 1, optional=True)
        check_int(self, "lr_wsd_decay_samples", 1, optional=True)
        check_number(self, "start_weight_decay", 0.0, optional=True)
        check_number(self, "end_weight_decay", 0.0, optional=True)
        check_choice(self, "weight_decay_incr_style", WD_INCR_STYLES)
        check_int(self, "max_nan_iterations", 1)


@dataclass
class DataConfig:
    """Training data."""

    data_path: list[str] = arg([], "dataset prefixes, optionally weighted: 'A' or '0.3 A 0.7 B'",
                               nargs="*")
    split: str = arg("969,30,1", "train,valid,test proportions of the documents")
    tokenizer_type: str | None = arg(
        None, "SentencePieceTokenizer (a .model file) or HuggingFaceTokenizer (a directory with "
              "tokenizer.json) for --tokenizer-model; GPT2BPETokenizer / NullTokenizer are "
              "implied by --vocab-file / --vocab-size (default: from --tokenizer-model)",
        choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                 "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer"])
    tokenizer_model: str | None = arg(None, "sentencepiece .model file, or a Hugging Face "
                                            "tokenizer directory (tokenizer.json)")
    vocab_file: str | None = arg(None, "GPT-2 BPE vocab.json (with --merge-file; data "
                                       "preprocessed with Megatron-LM's GPT2BPETokenizer)")
    merge_file: str | None = arg(None, "GPT-2 BPE merges.txt (with --vocab-file)")
    mock_data: bool = arg(False, "Megatron-LM's mock dataset (documents 1, 2, 3, ..., eod) instead "
                                 "of --data-path")
    reset_position_ids: bool = arg(False, "positions restart at 0 after each end-of-document "
                                          "token (models.documents)")
    reset_attention_mask: bool = arg(False, "attention stays within each document of a sample "
                                            "(block-causal)")
    eod_mask_loss: bool = arg(False, "no loss where the input is the end-of-document token")
    data_cache_path: str | None = arg(None,
                                      "where sample indices are cached (default: beside the data)")
    seed: int = arg(1234, "random seed for init, dropout and data shuffling")
    mid_level_dataset_surplus: float = arg(
        0.005, "extra fraction of samples built per dataset of a weighted --data-path blend")

    def __post_init__(self) -> None:
        from data.split import unquote_split

        check_number(self, "mid_level_dataset_surplus", 0.0)
        if isinstance(self.split, str):  # one spelling in messages, checkpoints, resume checks
            self.split = unquote_split(self.split)


@dataclass
class EvalConfig:
    """Evaluation."""

    eval_interval: int | None = arg(None, "evaluate on the validation split every N steps "
                                          "(default: only at the end of training)")
    eval_iters: int = arg(100, "global batches per evaluation (0: none)")

    def __post_init__(self) -> None:
        check_int(self, "eval_interval", 1, optional=True)
        check_int(self, "eval_iters", 0)


@dataclass
class CheckpointConfig:
    """Checkpoints and graceful stops."""

    save: str | None = arg(None, "directory to save checkpoints to (also where SIGTERM and the "
                                 "time limit save)")
    load: str | None = arg(None, "directory to resume from (its latest complete checkpoint; none "
                                 "there: start fresh)")
    save_interval: int | None = arg(None, "save every N iterations (default: only at the end and "
                                          "on a stop)")
    save_keep_last: int | None = arg(None, "keep only the newest K checkpoints (default: all)")
    async_save: bool = arg(False, "save in the background: each rank copies its shard to host "
                                  "memory (pinned on GPU) and a thread writes it while training "
                                  "goes on; published once every rank has written")
    ckpt_format: str = arg("safetensors", "checkpoint format to save in (Megatron-LM's flag): "
                                          "safetensors, this trainer's (one file per rank, read on "
                                          "any grid); Megatron-LM's torch_dist, torch, torch_dcp "
                                          "and fsdp_dtensor are refused. --load reads the format "
                                          "its metadata.json names")
    overwrite_save: bool = arg(False, "save into a --save that holds checkpoints this run does "
                                      "not resume (no --load of it, or --finetune): they are "
                                      "replaced iteration by iteration and the pointer moves "
                                      "to this run's (ours; otherwise refused)")
    no_load_optim: bool = arg(False, "load weights but not the optimizer state / loss scaler")
    no_load_rng: bool = arg(False, "do not restore the RNG states")
    finetune: bool = arg(False, "load weights only and start from iteration 0 (new optimizer, "
                                "schedule, data order)")
    init_from_hf: str | None = arg(None, "start from a local Hugging Face directory's weights "
                                   "(GPT-2, Llama, Qwen2, Qwen3; sharded or not), as --finetune "
                                   "does (iteration 0, new optimizer); a checkpoint under --load "
                                   "wins when there is one")
    exit_duration_in_mins: float | None = arg(
        None, "stop (and save, with --save) at the first iteration past this many minutes from "
              "process start")
    exit_interval: int | None = arg(
        None, "exit (saving first, with --save) after the iteration that is a multiple of N, "
              "as Megatron-LM's --exit-interval")
    override_opt_param_scheduler: bool = arg(
        False, "on --load, follow this run's LR/weight-decay schedule flags where they differ "
               "from the checkpoint's (otherwise refused, as Megatron-LM)",
        aliases={"--override-opt_param-scheduler": True})
    use_checkpoint_opt_param_scheduler: bool = arg(
        False, "on --load, continue the checkpoint's LR/weight-decay schedule where this run's "
               "flags differ (otherwise refused, as Megatron-LM)",
        aliases={"--use-checkpoint-opt_param-scheduler": True})

    def __post_init__(self) -> None:
        check_int(self, "save_interval", 1, optional=True)
        check_int(self, "save_keep_last", 1, optional=True)
        check_number(self, "exit_duration_in_mins", 0.0, strict=True, optional=True)
        check_int(self, "exit_interval", 1, optional=True)


@dataclass
class PretrainConfig:
    """Everything one pretraining job needs, one section per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    grid: GridConfig = field(default_factory=GridConfig)
    dry_run: DryRunConfig = field(default_factory=DryRunConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    activation: ActivationConfig = field(default_factory=ActivationConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)

    def to_dict(self) -> dict:
        """Nested plain dict (for printing, wandb and checkpoints)."""
        return dataclasses.asdict(self)

    @classmethod
    def sections(cls) -> dict[str, type]:
        """``{section name: section dataclass}`` in declaration order."""
        return {f.name: f.default_factory for f in dataclasses.fields(cls)}

    @classmethod
    def flat_fields(cls):
        """``(section, field)`` for every leaf field."""
        for s, kind in cls.sections().items():
            for f in dataclasses.fields(kind):
                yield s, f
