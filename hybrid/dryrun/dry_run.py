"""A dry run: one rank of an N-rank job on this machine, with no devices and no data.

``python -m hybrid.pretrain [job flags] --dry-run-world-size N [--dry-run-rank r]`` joins a
*fake* process group of N ranks (torch's ``fake`` backend: collectives return at once) and runs
under a ``FakeTensorMode`` (tensors carry shapes and dtypes but no storage), so a 400-rank 100B
job is built on a laptop in about a minute. Everything else is the real code path:
:func:`hybrid.parallelize.parallelize` constructs the model, the TP plan, activation
checkpointing and the ZeRO engine unit by unit, and :func:`hybrid.training.train_step` runs one
optimizer step (forward, backward, reduction, clipping, AdamW, parameter refresh). The step runs
one micro-batch by default (``--dry-run-micro-batches N`` runs N): once the gradient and
communication buffers exist, every micro-batch allocates and frees the same activations, so the
peak of one is the peak of all, and a 100B rank's step costs minutes per micro-batch on a CPU.
Each phase (build, every forward and backward, the optimizer step, the save's staging) is
reported with its time as it ends. A fake tensor
has no values, so the step's few host reads (the loss and the grad norm, via
:func:`hybrid.zero.grad_norm.host_values`) read zeros: a finite loss and no overflow, i.e. the
normal path.

Bytes are measured, not computed: :class:`hybrid.dryrun.storage_meter.StorageMeter` (the
counting rule of torch's ``MemTracker`` at O(1) per op) follows every storage the code allocates
(including stage 3's gathers and releases), giving the construction peak and the step peak; the
engine's buffers give the bytes per kind. The planner's figures for the same configuration
(``python -m hybrid.plan --accounting engine``, :func:`hybrid.planner.plan.evaluate`) are
printed beside them. The fake backend ignores the device: everything is counted as memory of
one device, and host-offloaded checkpoints (``--checkpoint-in-cpu``, the arena) are reported on
their own line and left out of the device total, as are the optimizer states of
``--optimizer-cpu-offload`` (host master, moments and gradient copy; on fake CUDA the meter then
counts device storages only, so the host step's temporaries stay out too). The report
(:mod:`hybrid.dryrun.report`) is in GiB and ends with the verdict for ``--device`` /
``--gpu-memory-gib`` with ``--reserved-gib`` held back, the planner's rule.
"""

from __future__ import annotations

import time

import torch

from hybrid.dryrun.check import STATE_KEYS
from hybrid.dryrun.phases import PhaseClock
from hybrid.dryrun.storage_meter import StorageMeter

GIB = 2**30


def _engine_tensors(engine) -> list[torch.Tensor]:
    """Every long-lived tensor the engine allocated (for the step's tracker)."""
    return engine.held_tensors()


def _host_checkpoint_bytes(engine) -> int:
    """Bytes of the host-memory checkpoints (``--checkpoint-in-cpu``): the arena, or the host
    buffers the offload pool holds after the step (one micro-batch's); 0 without either."""
    for block in getattr(engine.model, "layers", []):
        store = getattr(block.__dict__.get("forward"), "store", None)
        if store is not None and store.in_cpu:
            pool = [] if store.offload is None else store.offload.pool.values()
            pooled = sum(b.numel() * b.element_size() for bufs in pool for b in bufs)
            return (store.arena.nbytes if store.arena is not None else 0) + pooled
    return 0


def _save_staging_peak(engine, grid, fmt, device_only: bool = False) -> int:
    """Bytes alive at the peak of staging this rank's checkpoint part in ``fmt`` (the job's
    ``--ckpt-format``): the same entries (RNG states aside) and the same staging
    (:func:`hybrid.checkpoint.stream.staged`) as ``save_checkpoint``, with the file write left
    out (a fake tensor has no bytes). Counted on top of the engine's tensors (``device_only``:
    device storages only, as the step's meter)."""
    from hybrid.checkpoint.stream import staged

    meter = StorageMeter(device_only)
    meter.track(*_engine_tensors(engine))
    with meter:
        for t in staged(fmt.part(engine, grid, {}).entries):
            del t
    return meter.peak


def activation_mode(cfg) -> str:
    """The planner's activation mode (``hybrid.planner.memory.ACTIVATION_OPTIONS``) of a
    :class:`hybrid.config.PretrainConfig`."""
    a = cfg.activation
    sp = "+sp" if cfg.grid.sequence_parallel_active else ""
    if a.checkpoint_activations:
        return ("full" + sp + "+cpu" if sp and a.checkpoint_in_cpu else "full" + sp if sp else
                "full+pa+cpu" if a.checkpoint_in_cpu else "full+pa" if a.partition_activations
                else "full")
    if a.selective_recompute:
        return "sp+selective" if sp else "selective"
    return "sp" if sp else "none"


def planner_figures(job) -> dict:
    """The planner's per-rank bytes for the job (a :class:`hybrid.job.config_checks.Job`;
    ``accounting='engine'``)."""
    from hybrid.planner.plan import Cluster, Training, evaluate

    cfg = job.cfg
    z, activation = cfg.zero, activation_mode(cfg)
    training = Training(
        seq_length=cfg.model.seq_length, micro_batch_size=cfg.training.micro_batch_size,
        global_batch_size=job.global_batch_size, accounting="engine", zero=z,
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        dropout=job.gpt.hidden_dropout > 0 or job.gpt.attention_dropout > 0)
    # a node of tp GPUs unless hpZ needs more (the bytes do not depend on it)
    node = job.tp * max(1, z.hpz_partition_size)
    cluster = Cluster(num_gpus=job.world_size, gpus_per_node=node, reserved_bytes=0)
    c = evaluate(job.gpt, cluster, training, job.tp, z.stage, activation,
                 offload_fraction=z.offload_fraction)
    out = {k: c.model_states[k] for k in STATE_KEYS}
    out.update(states=c.model_states["total"], buffers=c.buffers,
               activations=c.activations["gpu"] + c.temporaries["total"],
               kept_activations=c.activations["gpu"], temporaries=c.temporaries["total"],
               host_checkpoints=c.activations["cpu"], host_states=c.host_bytes["states"],
               total=c.total_bytes)
    return out


def dry_run(job, rank: int = 0, progress=None) -> dict:
    """Build rank ``rank`` of ``job.world_size`` ranks of ``job`` (a
    :class:`hybrid.job.config_checks.Job`) and run one step of ``--dry-run-micro-batches``
    micro-batches (default 1: once the buffers exist the memory peak repeats per micro-batch);
    returns the measured and planned bytes (see the module docstring), the phases' times
    (``phases``: ``[(name, s)]``), and with ``--dry-run-device cuda`` the step's host<->device
    copies and host reads. ``progress`` (a ``str -> None``, e.g. ``print``) gets one line per
    phase (build, forward, backward, step, save) as it ends. Runs in a default process group
    of the fake backend, destroyed before it returns or raises.

    ``--dry-run-device cuda`` (``job.cfg.dry_run.dry_run_device``): the rank's tensors are fake
    ``cuda:(rank % 8)`` tensors (8 GPUs per node); run it through
    :func:`hybrid.dryrun.fake_cuda.run_preloaded` (``hybrid.pretrain`` does).

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``.
        RuntimeError: ``--dry-run-device cuda`` in an interpreter without the fake CUDA library.
    """
    import contextlib

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybrid.dryrun import fake_cuda
    from hybrid.parallel.grid import ProcessGrid

    cfg, world = job.cfg, job.world_size
    if not 0 <= rank < world:
        raise ValueError(f"--dry-run-rank {rank} must be in [0, {world})")
    cuda = cfg.dry_run.dry_run_device == "cuda"
    if cuda and not fake_cuda.loaded():
        raise RuntimeError("--dry-run-device cuda runs in an interpreter that loaded the fake "
                           "CUDA library first (hybrid.dryrun.fake_cuda.run_preloaded)")
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    clock = PhaseClock(progress)
    try:
        with fake_cuda.stubs() if cuda else contextlib.nullcontext():
            device = torch.device("cuda", rank % 8) if cuda else torch.device("cpu")
            out = _build_and_step(job, ProcessGrid(tp=job.tp, device=device), t0, clock)
    finally:  # the caller's process may start a real process group next
        dist.destroy_process_group()
    out.update(rank=rank, world=world, device=str(device), wall_s=time.perf_counter() - t0,
               phases=clock.phases)
    return out


def _timed_step(job, engine, grid, clock: PhaseClock, patches: list) -> None:
    """One ``train_step`` of ``--dry-run-micro-batches`` micro-batches under ``patches`` (context
    managers), each forward, backward and the optimizer step reported to ``clock``."""
    import contextlib
    from unittest import mock

    from hybrid import training

    cfg, n = job.cfg, job.cfg.dry_run.dry_run_micro_batches
    tokens = [torch.randint(0, job.gpt.vocab_size,
                            (cfg.training.micro_batch_size, cfg.model.seq_length + 1))
              for _ in range(n)]
    timed = [
        mock.patch.object(engine.model, "forward", clock.timed(
            engine.model.forward, lambda i: f"forward (micro-batch {i}/{n})")),
        mock.patch.object(engine, "backward", clock.timed(
            engine.backward, lambda i: f"backward (micro-batch {i}/{n})")),
        mock.patch.object(engine, "step", clock.timed(
            engine.step, lambda i: "step (grad norm, clipping, AdamW, parameter refresh)"))]
    with contextlib.ExitStack() as stack:
        for p in [*patches, *timed]:
            stack.enter_context(p)
        training.train_step(engine, tokens, cfg.optimizer.lr, grid)


def measured_attention_path(model, attention_dropout: float) -> str:
    """Set the attention core the dry run measures on ``model`` and name it.

    With attention dropout the explicit core (:func:`models.blocks.set_attention_kernel`
    ``"explicit"``), on every device: the planner counts its ``[b, a/t, s, s]`` terms (an
    upper bound for a GPU's fused kernel, which keeps O(s) per head). The fused path is left
    out because a CPU-only torch has no flash / memory-efficient kernel with dropout, on fake
    CUDA either: its math fallback keeps the whole score matrix in fp32, a path no GPU takes
    (planner -15% vs such a dry run of GPT-3 13B at s = 2048). Without dropout every kernel is
    ``scaled_dot_product_attention`` without dropout, left as it is.
    """
    from models.blocks import set_attention_kernel

    if attention_dropout > 0:
        set_attention_kernel(model, "explicit")
        return ("explicit softmax core with dropout (the planner's upper bound for a GPU's "
                "fused kernel)")
    return "scaled_dot_product_attention without dropout"


def _measured(engine, held: dict, step: StorageMeter, start: int, device_only: bool) -> dict:
    """Bytes per kind from the engine's ``held`` (``memory_bytes()`` after construction) and
    the step's meter (``start``: its bytes before the step). Host checkpoints and an offloaded
    optimizer are host memory: subtracted from what the meter counted, unless it counted the
    device only (``device_only``)."""
    host = _host_checkpoint_bytes(engine)
    on_host = 0 if device_only else host + held["host_states"]
    gathered = engine.memory_bytes()["gathered_peak"]
    out = {k: held[k] for k in STATE_KEYS}
    out.update(states=sum(held[k] for k in STATE_KEYS), buffers=held["buffers"] + gathered,
               activations=step.peak - start - gathered - (0 if device_only else host),
               host_checkpoints=host, host_states=held["host_states"],
               total=step.peak - on_host, gathered_peak=gathered, tracked_after_build=start)
    return out


def _build_and_step(job, grid, t0: float, clock: PhaseClock) -> dict:
    """The dry run on ``grid`` under a fake-tensor mode: build, one step, the measured bytes."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    from hybrid import train_step
    from hybrid.checkpoint.async_save import host_snapshot_bytes
    from hybrid.checkpoint.registry import format_named
    from hybrid.dryrun.fake_cuda import transfer_log
    from hybrid.parallel.rng import RNGTracker
    from hybrid.parallelize import meta_gpt, parallelize
    from hybrid.zero import grad_norm

    cfg = job.cfg
    tracker = RNGTracker(cfg.data.seed, grid.tp_rank, grid.device)
    log, host_values = transfer_log(), grad_norm.host_values

    def read(values):
        log.note_read("host_values")
        return host_values(values)

    # fake CUDA with an offloaded optimizer: only device storages count (host ones separately)
    device_only = grid.device.type == "cuda" and cfg.zero.offload_fraction > 0
    # real inputs (the CPU RNG state an activation checkpoint saves) are converted as they come
    with FakeTensorMode(allow_non_fake_inputs=True):
        with StorageMeter(device_only) as build:
            engine = parallelize(meta_gpt(job.gpt), grid, cfg, tracker)
        attention = measured_attention_path(engine.model, job.gpt.attention_dropout)
        built_s = time.perf_counter() - t0
        clock.done("build (model, TP plan, checkpointing, ZeRO engine)", built_s)
        held = engine.memory_bytes()
        step = StorageMeter(device_only)
        step.track(*_engine_tensors(engine))
        start = step.current
        _timed_step(job, engine, grid, clock, [
            step, log, mock.patch.object(train_step, "host_values", read),
            mock.patch.object(grad_norm, "host_values", read)])
        t = time.perf_counter()
        fmt = format_named(cfg.checkpoint.ckpt_format)
        save_peak = _save_staging_peak(engine, grid, fmt, device_only)
        clock.done("save (staging this rank's checkpoint shard, no file written)",
                   time.perf_counter() - t, last=True)
    snapshot = host_snapshot_bytes(engine, grid, fmt) if cfg.checkpoint.async_save else 0
    measured = _measured(engine, held, step, start, device_only)
    measured.update(construction_peak=build.peak, save_peak=save_peak,
                    async_save_snapshot=snapshot)
    return dict(tp=grid.tp_size, dp=grid.dp_size, tp_rank=grid.tp_rank,
                dp_rank=grid.dp_rank, stage=engine.stage, precision=engine.config.precision,
                grad_dtype="bf16" if engine.config.grad_reduce_in_bf16 else "fp32",
                local_params=engine.layout.numel, optimizer_steps=engine.optimizer_steps,
                largest_param=max(sl.numel for sl in engine.layout.slots), measured=measured,
                bound=start + 4 * max(u.padded for u in engine.layout.units),
                save_bound=start + 12 * max(u.padded for u in engine.layout.units),
                planned=planner_figures(job), build_s=built_s, copies=log.copies,
                reads=log.reads, micro_batches=cfg.dry_run.dry_run_micro_batches,
                step_micro_batches=job.grad_accum_steps,
                dropout=job.gpt.hidden_dropout > 0 or job.gpt.attention_dropout > 0,
                sdpa=job.gpt.attention_dropout == 0, attention=attention)
