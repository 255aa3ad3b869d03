"""Cross-field validation of a :class:`hybrid.config.PretrainConfig` into a :class:`Job`: the
config together with the values derived from it and the world.

Runs in every process before any process group starts, from the config and the launcher's
environment alone (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), so a bad setting fails fast on every
rank with the same message and no worker waits in a collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from data.checks import NO_DATA, check_data
from hybrid.batch_rampup import BatchRampup
from hybrid.config import PretrainConfig
from hybrid.config_fields import ConfigError, fail
from hybrid.job.preflight import check_index_caches, check_paths
from hybrid.job.schedule_setup import batch_rampup, schedule_settings, training_iterations
from hybrid.model_flags import resolve_model
from hybrid.parallel.grid import validate_grid
from hybrid.parallel.tp_split import tp_split_refusal
from hybrid.parallel.vocab import pad_vocab_size
from hybrid.tensorboard_log import tensorboard_missing
from hybrid.zero.topology import NODE_SIZE_ENV, NodeTopology, local_world_size
from models.config import GPTConfig


@dataclass(frozen=True)
class Job:
    """A validated run: its config and the values derived from it and the world (printed at
    start). Made once, by :func:`validate`; everything after validation takes this one object.

    Attributes:
        cfg: the parsed configuration, every cross-section check passed.
        gpt: the model's :class:`GPTConfig` (real, unpadded vocabulary).
        world_size, tp, dp: grid sizes.
        global_batch_size: samples per optimizer step.
        grad_accum_steps: micro-batches per rank per step
            (``global = micro x accumulation x dp``).
        tokens_per_step: ``global_batch_size * seq_length``.
        padded_vocab_size: embedding rows after padding for this tp.
        schedule: the LR and weight-decay schedule's settings, lengths in samples
            (:func:`hybrid.job.schedule_setup.schedule_settings`).
        rampup: the global-batch rampup (``--rampup-batch-size``), None without.
    """

    cfg: PretrainConfig
    gpt: GPTConfig
    world_size: int
    tp: int
    dp: int
    global_batch_size: int
    grad_accum_steps: int
    tokens_per_step: int
    padded_vocab_size: int
    schedule: dict
    rampup: BatchRampup | None = None

    def summary(self) -> str:
        """One line: grid, batch arithmetic, tokens per step, vocabulary, parameters, schedule."""
        micro = self.global_batch_size // (self.grad_accum_steps * self.dp)
        return (f"world {self.world_size} = tp {self.tp} x dp {self.dp} | global batch "
                f"{self.global_batch_size} = micro batch {micro} x accumulation "
                f"{self.grad_accum_steps} x dp {self.dp} | tokens per step "
                f"{self.tokens_per_step:,} | vocab {self.gpt.vocab_size} padded to "
                f"{self.padded_vocab_size} | parameters {self.gpt.num_parameters():,} | LR "
                f"{self.schedule['lr_decay_style']} warmup {self.warmup_iters:g} decay "
                f"{self.schedule['lr_decay_steps'] // self.global_batch_size} iterations")

    @property
    def warmup_iters(self) -> float:
        """The LR warmup in iterations (a fraction with ``--lr-warmup-fraction``)."""
        return self.schedule["lr_warmup_steps"] / self.global_batch_size


def _world_from_env() -> tuple[int, int | None]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return world, int(local) if local else None




def _vocab_size(cfg: PretrainConfig) -> int:
    d, m = cfg.data, cfg.model
    if d.mock_data and d.data_path:  # before the vocabulary: the conflict is the first thing to fix
        raise ConfigError(f"--mock-data and --data-path {' '.join(map(str, d.data_path))} both "
                          "name the training data: drop --mock-data to train on the files, or "
                          "--data-path for synthetic tokens")
    if d.vocab_file or d.merge_file:
        return _gpt2_bpe_vocab_size(cfg)
    if d.tokenizer_model:
        return _tokenizer_vocab_size(cfg)
    if m.vocab_size is None:
        if d.mock_data:
            raise ConfigError("--mock-data without --tokenizer-model needs --vocab-size")
        if not d.data_path:
            raise ConfigError(NO_DATA)
        raise ConfigError("--tokenizer-model (or --vocab-file and --merge-file) is required "
                          "with --data-path (or give --mock-data --vocab-size N)")
    return m.vocab_size


def _tokenizer_vocab_size(cfg: PretrainConfig) -> int:
    """The model's vocabulary for ``--tokenizer-model`` (``--tokenizer-type``): the tokenizer's,
    or a larger ``--vocab-size`` for a Hugging Face tokenizer (Qwen's models have 151936 rows
    for 151665 tokens)."""
    d, m = cfg.data, cfg.model
    if d.tokenizer_type in ("GPT2BPETokenizer", "NullTokenizer"):
        raise ConfigError(f"--tokenizer-type {d.tokenizer_type} takes no --tokenizer-model "
                          "(GPT2BPETokenizer: --vocab-file and --merge-file; NullTokenizer: "
                          "--vocab-size)")
    if not Path(d.tokenizer_model).exists():
        raise ConfigError(f"--tokenizer-model {d.tokenizer_model}: file not found")
    from data.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(d.tokenizer_model, d.tokenizer_type)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer-model {d.tokenizer_model}: {e}") from None
    vocab = tok.vocab_size
    if m.vocab_size is not None and (m.vocab_size < vocab if tok.kind == "HuggingFaceTokenizer"
                                     else m.vocab_size != vocab):
        raise ConfigError(f"--vocab-size {m.vocab_size} does not match the tokenizer's "
                          f"vocabulary of {vocab} ({d.tokenizer_model})"
                          + (": it may be larger, never smaller"
                             if tok.kind == "HuggingFaceTokenizer" else ""))
    return m.vocab_size or vocab


def validate(cfg: PretrainConfig, world_size: int | None = None,
             local_world_size: int | None = None) -> Job:
    """Check ``cfg``'s sections against each other, the files they name and the world; return
    the :class:`Job`. (Each section already checked its own fields when it was built.)

    Args:
        cfg: the parsed configuration.
        world_size, local_world_size: default to torchrun's ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``.

    Raises:
        ConfigError: the first problem found, with the offending values in the message.
    """
    world, dp = _check_world(cfg, world_size, local_world_size)
    vocab = _vocab_size(cfg)
    gpt = resolve_model(cfg.model, vocab)
    _check_model_split(cfg, gpt)
    t, m, tp = cfg.training, cfg.model, cfg.grid.tensor_model_parallel_size
    gbs = t.global_batch_size or t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
                          f"{t.micro_batch_size} x data-parallel size {dp} = "
                          f"{t.micro_batch_size * dp}")
    cfg = replace(cfg, training=replace(t, train_iters=training_iterations(cfg, gbs)))
    schedule = schedule_settings(cfg, gbs)
    rampup = batch_rampup(cfg, gbs)
    if rampup is not None and (bad := [b for b in rampup.sizes if b % (t.micro_batch_size * dp)]):
        raise ConfigError(f"--rampup-batch-size: global batch {bad[0]} of the rampup is not "
                          f"divisible by --micro-batch-size {t.micro_batch_size} x data-parallel "
                          f"size {dp} = {t.micro_batch_size * dp}")
    recomputed = cfg.activation.first_blocks
    if recomputed is not None and recomputed > gpt.num_layers:
        raise ConfigError(f"--recompute-num-layers {recomputed} exceeds the model's --num-layers "
                          f"{gpt.num_layers}")
    _check_data(cfg, vocab)
    if cfg.logging.tensorboard_dir and (why := tensorboard_missing()):
        raise ConfigError(why)
    lg = cfg.logging
    if lg.profile and (bad := [r for r in lg.profile_ranks if not 0 <= r < world]):
        raise ConfigError(f"--profile-ranks {' '.join(map(str, bad))}: not a global rank of this "
                          f"world of {world} (0 to {world - 1})")
    _check_checkpoint(cfg, gpt, schedule)
    if cfg.dry_run.dry_run_world_size is None:  # a dry run writes none of them
        check_paths(cfg)
    job = Job(
        cfg=cfg, gpt=gpt, world_size=world, tp=tp, dp=dp, global_batch_size=gbs,
        grad_accum_steps=gbs // (t.micro_batch_size * dp), tokens_per_step=gbs * m.seq_length,
        padded_vocab_size=pad_vocab_size(vocab, tp, m.make_vocab_size_divisible_by),
        schedule=schedule, rampup=rampup,
    )
    if cfg.dry_run.dry_run_world_size is None:
        check_index_caches(job)  # a read-only one must hold every index the job needs
    return job


def _gpt2_bpe_vocab_size(cfg: PretrainConfig) -> int:
    """``--vocab-file`` / ``--merge-file``'s vocabulary size, checked against the other flags."""
    from data.gpt2_bpe import gpt2_bpe_vocab_size

    d, m = cfg.data, cfg.model
    if not (d.vocab_file and d.merge_file) or d.tokenizer_model:
        raise ConfigError("a GPT-2 BPE tokenizer needs both --vocab-file and --merge-file, and "
                          "no --tokenizer-model")
    try:
        vocab = gpt2_bpe_vocab_size(d.vocab_file, d.merge_file)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.vocab_size is not None and m.vocab_size != vocab:
        raise ConfigError(f"--vocab-size {m.vocab_size} does not match the vocabulary of "
                          f"{vocab} of --vocab-file {d.vocab_file}")
    return vocab


def _check_world(cfg: PretrainConfig, world_size: int | None,
                 local_world_size: int | None) -> tuple[int, int]:
    """``(world size, data-parallel size)``: the dry run's ranks, or the launcher's world, split
    into the grid."""
    g = cfg.dry_run
    if g.dry_run_world_size is not None and g.dry_run_world_size < 1:
        raise ConfigError(f"--dry-run-world-size {g.dry_run_world_size} must be a positive number "
                          "of ranks")
    if g.dry_run_world_size is None and g.dry_run_rank:
        raise ConfigError(f"--dry-run-rank {g.dry_run_rank} needs --dry-run-world-size N (the job "
                          "to dry-run)")
    env_world, env_local = _world_from_env()
    world = world_size or env_world
    local = local_world_size if local_world_size is not None else env_local
    tp = cfg.grid.tensor_model_parallel_size
    try:
        shape = validate_grid(world, tp, local)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_hpz(cfg, world, local)
    if g.dry_run_world_size is not None and not 0 <= g.dry_run_rank < g.dry_run_world_size:
        raise ConfigError(f"--dry-run-rank {g.dry_run_rank} must be in [0, --dry-run-world-size "
                          f"{g.dry_run_world_size})")
    return world, shape.dp


def _check_hpz(cfg: PretrainConfig, world: int, local: int | None) -> None:
    """``--zero-hpz-partition-size`` divides the data-parallel ranks of a node (tp < the
    processes per node; nodes from ``HYBRID_LOCAL_WORLD_SIZE`` or ``LOCAL_WORLD_SIZE``), and
    ``--zero-quantized-gradients`` has nodes that fit the world (its hierarchical all-to-all)."""
    if cfg.zero.hpz_partition_size <= 1 and not cfg.zero.quantized_gradients:
        return
    try:
        node = local_world_size(world) if os.environ.get(NODE_SIZE_ENV) or local is None else local
        topo = NodeTopology(world, cfg.grid.tensor_model_parallel_size, min(node, world))
        if cfg.zero.hpz_partition_size > 1:
            topo.check_intra_size(cfg.zero.hpz_partition_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_model_split(cfg: PretrainConfig, gpt: GPTConfig) -> None:
    """The model splits over ``tp`` (heads, FFN, and the sequence under SP) and its position
    table holds ``--seq-length``."""
    tp, seq = cfg.grid.tensor_model_parallel_size, cfg.model.seq_length
    refusal = tp_split_refusal(gpt, tp, sequence_length=seq if cfg.grid.sequence_parallel
                               else None)
    if refusal is not None:
        raise ConfigError(refusal.flag_message())
    if seq > gpt.max_position_embeddings:
        raise ConfigError(f"--seq-length {seq} must be in [1, --max-position-embeddings "
                          f"{gpt.max_position_embeddings}]")


def _check_checkpoint(cfg: PretrainConfig, gpt: GPTConfig, schedule: dict) -> None:
    """The checkpoint flags agree with each other, and what ``--load`` / ``--init-from-hf`` name
    fits this run."""
    c = cfg.checkpoint
    _check_ckpt_format(c)
    if c.save_interval is not None and not c.save:
        raise ConfigError(f"--save-interval {c.save_interval} needs --save DIR")
    if c.async_save and not c.save:  # accepted silently, it did nothing
        raise ConfigError("--async-save needs --save DIR (where it writes in the background)")
    if c.finetune and not c.load:
        raise ConfigError("--finetune needs --load DIR (the checkpoint to start from)")
    if c.init_from_hf:
        _check_init_from_hf(c, gpt)
    if c.load and Path(c.load).exists() and not Path(c.load).is_dir():
        raise ConfigError(f"--load {c.load} is not a directory")
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt-param-scheduler and --use-checkpoint-opt_param-scheduler "
                          "are mutually exclusive: take the LR schedule from this run's flags or "
                          "from the checkpoint")
    _check_resume(cfg, gpt, schedule)


def _check_ckpt_format(c) -> None:
    """``--ckpt-format`` names an implemented format (Megatron-LM's are refused by name, in one
    line naming those implemented: a format asked for is never silently replaced)."""
    from hybrid.checkpoint.registry import UnknownFormatError, format_named

    try:
        format_named(c.ckpt_format)
    except UnknownFormatError as e:
        fail(c, "ckpt_format", str(e))


def _check_resume(cfg: PretrainConfig, gpt: GPTConfig, schedule: dict) -> None:
    from hybrid.checkpoint.directory import IncompleteCheckpointError
    from hybrid.job.resume_checks import (
        ResumeMismatch,
        check_resume,
        check_save_dir,
        checkpoint_metadata,
    )

    try:
        meta = checkpoint_metadata(cfg.checkpoint.load)
        if meta is not None:
            check_resume(cfg, gpt, meta, schedule)
        if cfg.dry_run.dry_run_world_size is None:  # a dry run saves nothing
            check_save_dir(cfg)
    except FileNotFoundError as e:  # the pointer names no directory
        raise ConfigError(f"--load {cfg.checkpoint.load}: {e}") from None
    except (ResumeMismatch, IncompleteCheckpointError) as e:
        raise ConfigError(str(e)) from None


def _check_data(cfg: PretrainConfig, vocab: int) -> None:
    """The data flags name data that trains this model (:func:`data.checks.check_data`)."""
    d = cfg.data
    source = ("--tokenizer-model " + d.tokenizer_model if d.tokenizer_model
              else "--vocab-file " + d.vocab_file if d.vocab_file else "--vocab-size")
    try:
        check_data(d.split, d.data_path, d.mock_data, cfg.eval.eval_iters, vocab, source)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_init_from_hf(c, gpt: GPTConfig) -> None:
    """``--init-from-hf DIR``: a GPT-2 / Llama / Qwen2 / Qwen3 directory whose config.json
    describes this run's model."""
    if c.finetune:
        raise ConfigError("--init-from-hf and --finetune both name the starting weights: give one")
    from hybrid.hf.weights import HFWeights

    try:  # config.json, then the weight files' headers: names and shapes
        HFWeights(c.init_from_hf, gpt, where=f"--init-from-hf {c.init_from_hf}")
    except (FileNotFoundError, ValueError) as e:
        flag = "" if str(e).startswith("--init-from-hf") else "--init-from-hf "
        raise ConfigError(flag + str(e)) from None
