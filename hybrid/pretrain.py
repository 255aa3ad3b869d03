"""GPT pretraining entry point: ``torchrun --nproc-per-node N -m hybrid.pretrain [flags]``.

parse -> validate (before any process group) -> grid -> model (TP plan -> activation
checkpointing -> ZeRO) -> data -> train -> test evaluation -> close. Flags: ``--help``.
"""

from __future__ import annotations

import os
import sys

import torch

from hybrid.cli import config_json, parse_config
from hybrid.config import PretrainConfig
from hybrid.config_checks import ConfigError, Derived, activation_config, validate


def build_model(cfg: PretrainConfig, derived: Derived, grid, tracker):
    """The tensor-parallel GPT on ``meta`` and its weight source: the ZeRO engine materialises
    it unit by unit, initialised from the seed exactly as the single-process
    ``GPT.init_weights(seed)`` would be, whatever the tp."""
    from hybrid.parallel.kernels import use_fused_kernels
    from hybrid.parallel.tp_plan import parallelize_gpt, seeded_weights
    from models.gpt import GPT

    with torch.device("meta"):
        model = GPT(derived.gpt)
    parallelize_gpt(model, grid.tp_group, tracker=tracker,
                    make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)
    use_fused_kernels(model, grid.device)
    return model, seeded_weights(derived.gpt, cfg.data.seed)


def build_datasets(cfg: PretrainConfig, derived: Derived):
    """``(train, valid, test)`` datasets sized for the run (None for an empty split)."""
    from data.split import parse_split

    gbs, seq = derived.global_batch_size, cfg.model.seq_length
    fractions = parse_split(cfg.data.split)
    eval_samples = cfg.eval.eval_iters * gbs
    counts = (cfg.optim.train_iters * gbs,
              eval_samples if fractions[1] > 0 else 0,
              eval_samples if fractions[2] > 0 else 0)
    if cfg.data.mock_data:
        from data.mock_dataset import MockGPTDataset

        return tuple(MockGPTDataset(n, seq, derived.gpt.vocab_size, cfg.data.seed + 7919 * i) if n else None
                     for i, n in enumerate(counts))
    from data.gpt_dataset import build_gpt_datasets

    return build_gpt_datasets(cfg.data.data_path, cfg.data.split, seq, cfg.data.seed, counts,
                              cache_dir=cfg.data.data_cache_path)


def _batches(dataset, consumed: int, cfg: PretrainConfig, grid):
    from data.loader import build_data_loader

    return iter(build_data_loader(dataset, consumed, cfg.optim.micro_batch_size, grid.dp_rank, grid.dp_size))


def build_engine(cfg: PretrainConfig, derived: Derived, grid, tracker):
    """Model -> TP plan -> activation checkpointing -> ZeRO, in that order (STYLE.md rule 2)."""
    from hybrid.activation.apply import apply_activation_checkpointing
    from hybrid.zero.engine import OptimizerConfig, ZeroConfig, ZeroEngine

    p, o = cfg.parallel, cfg.optim
    model, weights = build_model(cfg, derived, grid, tracker)
    act = activation_config(cfg)
    if act.checkpoint_activations:
        apply_activation_checkpointing(model, grid, act, tracker)
    return ZeroEngine(
        model, grid,
        ZeroConfig(stage=p.zero_stage, reduce_bucket_size=p.reduce_bucket_size,
                   allgather_bucket_size=p.allgather_bucket_size, overlap_comm=p.overlap_comm,
                   param_persistence_threshold=p.param_persistence_threshold,
                   precision="bf16" if o.bf16 else "fp16" if o.fp16 else "fp32",
                   loss_scale=o.loss_scale, initial_loss_scale_power=int(o.initial_loss_scale).bit_length() - 1,
                   loss_scale_window=o.loss_scale_window, hysteresis=o.hysteresis, min_loss_scale=o.min_loss_scale),
        OptimizerConfig(lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad),
        weights=weights,
    )


def loop_settings(cfg: PretrainConfig, derived: Derived, grid):
    """The loop's counts and the FLOPs per step for TFLOP/s and MFU (2205.05198 Eq. 7)."""
    from hybrid.flops import device_peak_tflops, flops_per_iteration
    from hybrid.training import LoopSettings

    o = cfg.optim
    return LoopSettings(
        train_iters=o.train_iters, grad_accum_steps=derived.grad_accum_steps,
        global_batch_size=derived.global_batch_size, tokens_per_step=derived.tokens_per_step,
        log_interval=cfg.logging.log_interval, eval_interval=cfg.eval.eval_interval,
        eval_iters=cfg.eval.eval_iters, max_nan_iterations=o.max_nan_iterations,
        flops_per_step=flops_per_iteration(derived.gpt, derived.global_batch_size, cfg.model.seq_length),
        peak_tflops=device_peak_tflops() if grid.device.type == "cuda" else None,
    )


def run(cfg: PretrainConfig, derived: Derived) -> dict:
    """Train with an already validated config; returns ``{"history": records, "engine": engine}``."""
    from hybrid.checkpoint.policy import Checkpointer, init_from_hf, resume
    from hybrid.metrics import MetricsWriter
    from hybrid.parallel.grid import ProcessGrid, init_distributed
    from hybrid.parallel.rng import RNGTracker, seed_everything
    from hybrid.schedule import LRSchedule
    from hybrid.training import TrainState, run_eval, train

    o, lg = cfg.optim, cfg.logging
    init_distributed(timeout_s=60 * cfg.parallel.distributed_timeout_minutes)
    grid = ProcessGrid(tp=cfg.parallel.tensor_model_parallel_size)
    seed_everything(cfg.data.seed, grid.device)
    tracker = RNGTracker(cfg.data.seed, grid.tp_rank, grid.device)
    if grid.rank == 0:
        print(f"hybrid-zero pretraining | {derived.summary()}", flush=True)
        print(config_json(cfg), flush=True)
    engine = build_engine(cfg, derived, grid, tracker)
    if grid.rank == 0:
        print(engine.summary(), flush=True)
    state = TrainState()
    if cfg.checkpoint.load:
        resume(cfg, engine, grid, tracker, state)
    elif cfg.checkpoint.init_from_hf:
        init_from_hf(cfg, engine, grid)
    train_ds, valid_ds, test_ds = build_datasets(cfg, derived)
    eval_sets = {"valid": valid_ds, "test": test_ds}

    def eval_batches(split):
        ds = eval_sets[split]
        return None if ds is None else _batches(ds, 0, cfg, grid)

    settings = loop_settings(cfg, derived, grid)
    schedule = LRSchedule(o.lr, o.min_lr, derived.warmup_iters, derived.decay_iters, o.lr_decay_style)
    progress = None
    if grid.rank == 0 and sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=o.train_iters, initial=state.iteration, desc="train", unit="it", dynamic_ncols=True)
    writer = MetricsWriter(grid.rank, lg.metrics_file, cfg.to_dict(), lg.wandb_project, lg.wandb_exp_name,
                           lg.wandb_save_dir, print_fn=progress.write if progress else print)
    checkpointer = Checkpointer(cfg, derived, engine, grid, tracker, writer)
    try:
        train(engine, grid, state, settings, schedule, _batches(train_ds, state.consumed_samples, cfg, grid),
              eval_batches, writer, progress, checkpointer.after_iteration)
        checkpointer.save(state)
        if settings.eval_iters and state.iteration >= o.train_iters:
            run_eval(engine, grid, state, settings, eval_batches, writer, "valid")
            run_eval(engine, grid, state, settings, eval_batches, writer, "test")
    finally:
        if progress is not None:
            progress.close()
        writer.close()
        checkpointer.close()
    return {"history": state.history, "engine": engine}


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (2 for a configuration error)."""
    try:
        cfg = parse_config(argv)
        derived = validate(cfg, world_size=cfg.parallel.dry_run_world_size)
    except ConfigError as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node, not once per rank
            print(f"hybrid-pretrain: error: {e}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    try:
        if cfg.parallel.dry_run_world_size:
            from hybrid.dry_run import dry_run, format_report

            print(f"hybrid-zero dry run | {derived.summary()}", flush=True)
            print(format_report(dry_run(cfg, derived, cfg.parallel.dry_run_rank)), flush=True)
            return 0
        run(cfg, derived)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
