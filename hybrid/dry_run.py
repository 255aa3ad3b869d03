"""A dry run: one rank of an N-rank job on this machine, with no devices and no data.

``python -m hybrid.pretrain [job flags] --dry-run-world-size N [--dry-run-rank r]`` joins a
*fake* process group of N ranks (torch's ``fake`` backend: collectives return at once) and runs
under a ``FakeTensorMode`` (tensors carry shapes and dtypes but no storage), so a 400-rank 100B
job is built on a laptop in about a minute. Everything else is the real code path:
:func:`hybrid.parallelize.parallelize` constructs the model, the TP plan, activation
checkpointing and the ZeRO engine unit by unit, and :func:`hybrid.training.train_step` runs one
optimizer step (forward, backward, reduction, clipping, AdamW, parameter refresh). A fake tensor
has no values, so the step's few host reads (the loss and the grad norm, via
:func:`hybrid.zero.grad_norm.host_values`) read zeros: a finite loss and no overflow, i.e. the
normal path.

Bytes are measured, not computed: torch's memory tracker
(``torch.distributed._tools.mem_tracker.MemTracker``) follows every storage the code allocates
(including stage 3's gathers and releases), giving the construction peak and the step peak; the
engine's buffers give the bytes per kind. The planner's figures for the same configuration
(``python -m hybrid.plan --accounting engine``, :func:`hybrid.planner.plan.evaluate`) are
printed beside them. The fake backend ignores the device: everything is counted as memory of
one device, and host-offloaded checkpoints (``--checkpoint-in-cpu``, the arena) are reported on
their own line and left out of the device total.
"""

from __future__ import annotations

import time

import torch

from hybrid.planner.check import STATE_KEYS

GIB = 2**30


def _total(snapshot: dict) -> int:
    """Tracked bytes on every device but ``meta`` (the model's shapes before construction)."""
    return sum(d.get("Total", 0) for dev, d in snapshot.items() if torch.device(dev).type != "meta")


def _engine_tensors(engine) -> list[torch.Tensor]:
    """Every long-lived tensor the engine allocated (for the step's tracker)."""
    out = [engine.master, engine.exp_avg, engine.exp_avg_sq, engine.reducer.buffer]
    out += [engine.param_flat] if engine.param_flat is not None else [engine.param_shard]
    if engine.stage == 3:
        out += [engine.unit_bufs[u.index] for u in engine.layout.units if u.persistent]
    out += [t for pair in engine.reducer.staging for t in pair]
    if engine._ag_staging is not None:
        out.append(engine._ag_staging)
    return out


def _host_checkpoint_bytes(engine) -> int:
    """Bytes of the host-memory checkpoint arena (``--checkpoint-in-cpu``), 0 without one."""
    for block in getattr(engine.model, "layers", []):
        store = getattr(block.__dict__.get("forward"), "store", None)
        if store is not None and store.in_cpu and store.arena is not None:
            return store.arena.nbytes
    return 0


def planner_figures(cfg, derived) -> dict:
    """The planner's per-rank bytes for the job (``accounting='engine'``)."""
    from hybrid.planner.plan import Cluster, Training, evaluate

    a, z = cfg.activation, cfg.zero
    sp = "+sp" if cfg.grid.sequence_parallel and derived.tp > 1 else ""
    if a.checkpoint_activations:
        activation = ("full" + sp + "+cpu" if sp and a.checkpoint_in_cpu else "full" + sp if sp else
                      "full+pa+cpu" if a.checkpoint_in_cpu else "full+pa" if a.partition_activations else "full")
    elif a.selective_recompute:
        activation = "sp+selective" if sp else "selective"
    else:
        activation = "sp" if sp else "none"
    training = Training(
        seq_length=cfg.model.seq_length, micro_batch_size=cfg.training.micro_batch_size,
        global_batch_size=derived.global_batch_size, precision=z.precision, accounting="engine",
        param_persistence_threshold=z.param_persistence_threshold if z.stage == 3 else 0,
        reduce_bucket_elements=z.reduce_bucket_size, allgather_bucket_elements=z.allgather_bucket_size,
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by, overlap_comm=z.overlap_comm,
        grad_reduce=z.grad_reduce)
    cluster = Cluster(num_gpus=derived.world_size, gpus_per_node=derived.tp, reserved_bytes=0)
    c = evaluate(derived.gpt, cluster, training, derived.tp, z.stage, activation)
    out = {k: c.model_states[k] for k in STATE_KEYS}
    out.update(states=c.model_states["total"], buffers=c.buffers, activations=c.activations["gpu"],
               host_checkpoints=c.activations["cpu"], total=c.total_bytes)
    return out


def dry_run(cfg, derived, rank: int = 0) -> dict:
    """Build rank ``rank`` of ``derived.world_size`` ranks and run one step; returns the
    measured and planned bytes (see the module docstring). Initialises the default process
    group with the fake backend (destroy it before starting a real one in the same process).

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``.
    """
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.rng import RNGTracker
    from hybrid.parallelize import meta_gpt, parallelize
    from hybrid.training import train_step

    world = derived.world_size
    if not 0 <= rank < world:
        raise ValueError(f"--dry-run-rank {rank} must be in [0, {world})")
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    grid = ProcessGrid(tp=derived.tp, device=torch.device("cpu"))
    tracker = RNGTracker(cfg.data.seed, grid.tp_rank, grid.device)
    # real inputs (the CPU RNG state an activation checkpoint saves) are converted as they come
    with FakeTensorMode(allow_non_fake_inputs=True):
        with MemTracker() as build:
            engine = parallelize(meta_gpt(derived.gpt), grid, cfg, tracker)
        construction_peak = _total(build.get_tracker_snapshot("peak"))
        built_s = time.perf_counter() - t0
        held = engine.memory_bytes()
        step = MemTracker()
        step.track_external(*_engine_tensors(engine))
        start = _total(step.get_tracker_snapshot("current"))
        with step:
            tokens = torch.randint(0, derived.gpt.vocab_size,
                                   (cfg.training.micro_batch_size, cfg.model.seq_length + 1))
            train_step(engine, [tokens], cfg.optimizer.lr, grid)
        step_peak = _total(step.get_tracker_snapshot("peak"))
    host = _host_checkpoint_bytes(engine)
    gathered = engine.memory_bytes()["gathered_peak"]
    measured = {k: held[k] for k in STATE_KEYS}
    measured.update(states=sum(held[k] for k in STATE_KEYS), buffers=held["buffers"] + gathered,
                    activations=step_peak - start - gathered - host, host_checkpoints=host,
                    total=step_peak - host, construction_peak=construction_peak,
                    gathered_peak=gathered, tracked_after_build=start)
    return dict(rank=rank, world=world, tp=grid.tp_size, dp=grid.dp_size, tp_rank=grid.tp_rank,
                dp_rank=grid.dp_rank, stage=engine.stage, precision=engine.config.precision,
                local_params=engine.layout.numel, optimizer_steps=engine.optimizer_steps,
                largest_param=max(sl.numel for sl in engine.layout.slots), measured=measured,
                bound=start + 4 * max(u.padded for u in engine.layout.units),
                planned=planner_figures(cfg, derived), build_s=built_s,
                wall_s=time.perf_counter() - t0)


def format_report(r: dict) -> str:
    """A table of measured vs planned bytes per kind (GiB), with the relative differences."""
    m, p = r["measured"], r["planned"]
    rows = [("16-bit/compute params", "params"), ("gradients (fp32)", "grads"),
            ("fp32 master", "master"), ("Adam moments", "optimizer"), ("model states", "states"),
            ("buffers (+ stage-3 gathered units)", "buffers"), ("activations + temporaries (peak)", "activations"),
            ("host checkpoints (not in total)", "host_checkpoints"), ("total at the step peak", "total")]
    lines = [f"dry run: rank {r['rank']} of {r['world']} (tp {r['tp']} x dp {r['dp']}, tp_rank "
             f"{r['tp_rank']}, dp_rank {r['dp_rank']}), ZeRO-{r['stage']} {r['precision']}, "
             f"{r['local_params'] / 1e9:.3f}e9 local parameters; built in {r['build_s']:.0f} s, "
             f"{r['wall_s']:.0f} s with the step",
             f"{'bytes per rank':<34}{'measured GiB':>14}{'planner GiB':>14}{'diff':>9}"]
    for label, k in rows:
        diff = f"{(m[k] - p[k]) / p[k]:+.1%}" if p[k] else "-"
        lines.append(f"{label:<34}{m[k] / GIB:>14.3f}{p[k] / GIB:>14.3f}{diff:>9}")
    lines.append(f"{'construction peak':<34}{m['construction_peak'] / GIB:>14.3f}{'':>14}"
                 f"  (steady state + one unit in fp32: {r['bound'] / GIB:.3f})")
    lines.append(f"{'tracked after construction':<34}{m['tracked_after_build'] / GIB:>14.3f}"
                 f"  (= model states + buffers {(m['states'] + m['buffers'] - m['gathered_peak']) / GIB:.3f})")
    return "\n".join(lines)
