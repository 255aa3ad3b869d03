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

Bytes are measured, not computed: :class:`StorageMeter` (the counting rule of torch's
``MemTracker`` at O(1) per op) follows every storage the code allocates (including stage 3's
gathers and releases), giving the construction peak and the step peak; the
engine's buffers give the bytes per kind. The planner's figures for the same configuration
(``python -m hybrid.plan --accounting engine``, :func:`hybrid.planner.plan.evaluate`) are
printed beside them. The fake backend ignores the device: everything is counted as memory of
one device, and host-offloaded checkpoints (``--checkpoint-in-cpu``, the arena) are reported on
their own line and left out of the device total.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybrid.planner.check import STATE_KEYS

GIB = 2**30


class StorageMeter(TorchDispatchMode):
    """Bytes of the tensor storages that are alive, and their peak, at O(1) cost per op.

    Every output of every op dispatched while the meter is active (and every tensor passed to
    :meth:`track`) has its storage recorded with a weak reference: the bytes are added when the
    storage is first seen and removed when it is freed; ``UntypedStorage.resize_`` (stage 3's
    release and re-gather of a unit) is followed too. Meta tensors (the model's shapes before
    construction) are not counted. Same counting rule as torch's
    ``torch.distributed._tools.mem_tracker.MemTracker`` (no CUDA rounding: the dry run has no
    device), without its per-module snapshots, whose cost grows with ops x modules and makes a
    125-layer step take tens of minutes.

    Attributes:
        current: bytes alive now (int).
        peak: the largest ``current`` seen since construction or :meth:`reset_peak` (int).
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, nbytes]
        self._orig_resize = None

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors allocated before the meter was entered."""
        for t in tensors:
            self._see(t)

    def reset_peak(self) -> None:
        """Start a new peak at the bytes alive now."""
        self.peak = self.current

    def _see(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        entry = self._live.get(id(st))
        if entry is None:
            key = id(st)
            self._live[key] = [weakref.ref(st, lambda _, k=key: self._freed(k)), 0]
            entry = self._live[key]
        self._resized(entry, st.nbytes())

    def _resized(self, entry: list, nbytes: int) -> None:
        self.current += nbytes - entry[1]
        entry[1] = nbytes
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def __enter__(self):
        self._orig_resize = orig = torch.UntypedStorage.resize_
        meter = self

        def resize_(st, size):
            out = orig(st, size)
            entry = meter._live.get(id(st))
            if entry is not None:
                meter._resized(entry, st.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            self._see(t)
        return out


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


def _save_staging_peak(engine, grid) -> int:
    """Bytes alive at the peak of staging this rank's checkpoint shard: the same entries and
    the same staging (:func:`hybrid.checkpoint.stream.staged`) as ``save_checkpoint``, with the
    file write left out (a fake tensor has no bytes). Counted on top of the engine's tensors."""
    from hybrid.checkpoint.shards import shard_entries
    from hybrid.checkpoint.stream import staged
    from hybrid.zero import state

    meter = StorageMeter()
    meter.track(*_engine_tensors(engine))
    with meter:
        entries, _ = shard_entries(state.owned_state(engine), grid.tp_rank)
        for t in staged(entries):
            del t
    return meter.peak


def planner_figures(job) -> dict:
    """The planner's per-rank bytes for the job (a :class:`hybrid.job.config_checks.Job`;
    ``accounting='engine'``)."""
    from hybrid.planner.plan import Cluster, Training, evaluate

    cfg = job.cfg
    a, z = cfg.activation, cfg.zero
    sp = "+sp" if cfg.grid.sequence_parallel_active else ""
    if a.checkpoint_activations:
        activation = ("full" + sp + "+cpu" if sp and a.checkpoint_in_cpu else "full" + sp if sp else
                      "full+pa+cpu" if a.checkpoint_in_cpu else "full+pa" if a.partition_activations
                      else "full")
    elif a.selective_recompute:
        activation = "sp+selective" if sp else "selective"
    else:
        activation = "sp" if sp else "none"
    training = Training(
        seq_length=cfg.model.seq_length, micro_batch_size=cfg.training.micro_batch_size,
        global_batch_size=job.global_batch_size, precision=z.precision, accounting="engine",
        param_persistence_threshold=z.plan.persistence_threshold,
        reduce_bucket_elements=z.reduce_bucket_size,
        allgather_bucket_elements=z.allgather_bucket_size,
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        overlap_comm=z.overlap_comm, grad_reduce=z.grad_reduce,
        dropout=job.gpt.hidden_dropout > 0 or job.gpt.attention_dropout > 0)
    cluster = Cluster(num_gpus=job.world_size, gpus_per_node=job.tp, reserved_bytes=0)
    c = evaluate(job.gpt, cluster, training, job.tp, z.stage, activation)
    out = {k: c.model_states[k] for k in STATE_KEYS}
    out.update(states=c.model_states["total"], buffers=c.buffers,
               activations=c.activations["gpu"] + c.temporaries["total"],
               kept_activations=c.activations["gpu"], temporaries=c.temporaries["total"],
               host_checkpoints=c.activations["cpu"], total=c.total_bytes)
    return out


def dry_run(job, rank: int = 0) -> dict:
    """Build rank ``rank`` of ``job.world_size`` ranks of ``job`` (a
    :class:`hybrid.job.config_checks.Job`) and run one step; returns the measured and planned
    bytes (see the module docstring), and with ``--dry-run-device cuda`` the step's host<->device
    copies and host reads. Initialises the default process group with the fake backend (destroy
    it before starting a real one in the same process).

    ``--dry-run-device cuda`` (``job.cfg.grid.dry_run_device``): the rank's tensors are fake
    ``cuda:(rank % 8)`` tensors (8 GPUs per node); run it through
    :func:`hybrid.job.fake_cuda.run_preloaded` (``hybrid.pretrain`` does).

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``.
        RuntimeError: ``--dry-run-device cuda`` in an interpreter without the fake CUDA library.
    """
    import contextlib

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybrid.job import fake_cuda
    from hybrid.parallel.grid import ProcessGrid

    cfg, world = job.cfg, job.world_size
    if not 0 <= rank < world:
        raise ValueError(f"--dry-run-rank {rank} must be in [0, {world})")
    cuda = cfg.grid.dry_run_device == "cuda"
    if cuda and not fake_cuda.loaded():
        raise RuntimeError("--dry-run-device cuda runs in an interpreter that loaded the fake "
                           "CUDA library first (hybrid.job.fake_cuda.run_preloaded)")
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    with fake_cuda.stubs() if cuda else contextlib.nullcontext():
        device = torch.device("cuda", rank % 8) if cuda else torch.device("cpu")
        out = _build_and_step(job, ProcessGrid(tp=job.tp, device=device), t0)
    out.update(rank=rank, world=world, device=str(device), wall_s=time.perf_counter() - t0)
    return out


def _build_and_step(job, grid, t0: float) -> dict:
    """The dry run on ``grid`` under a fake-tensor mode: build, one step, the measured bytes."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    from hybrid import training
    from hybrid.checkpoint.async_save import host_snapshot_bytes
    from hybrid.job.fake_cuda import transfer_log
    from hybrid.parallel.rng import RNGTracker
    from hybrid.parallelize import meta_gpt, parallelize
    from hybrid.zero import grad_norm

    cfg = job.cfg
    tracker = RNGTracker(cfg.data.seed, grid.tp_rank, grid.device)
    log, host_values = transfer_log(), grad_norm.host_values

    def read(values):
        log.note_read("host_values")
        return host_values(values)

    # real inputs (the CPU RNG state an activation checkpoint saves) are converted as they come
    with FakeTensorMode(allow_non_fake_inputs=True):
        with StorageMeter() as build:
            engine = parallelize(meta_gpt(job.gpt), grid, cfg, tracker)
        built_s = time.perf_counter() - t0
        held = engine.memory_bytes()
        step = StorageMeter()
        step.track(*_engine_tensors(engine))
        start = step.current
        with step, log, mock.patch.object(training, "host_values", read), \
                mock.patch.object(grad_norm, "host_values", read):
            tokens = torch.randint(0, job.gpt.vocab_size,
                                   (cfg.training.micro_batch_size, cfg.model.seq_length + 1))
            training.train_step(engine, [tokens], cfg.optimizer.lr, grid)
        save_peak = _save_staging_peak(engine, grid)
    snapshot = host_snapshot_bytes(engine, grid) if cfg.checkpoint.async_save else 0
    host = _host_checkpoint_bytes(engine)
    gathered = engine.memory_bytes()["gathered_peak"]
    measured = {k: held[k] for k in STATE_KEYS}
    measured.update(states=sum(held[k] for k in STATE_KEYS), buffers=held["buffers"] + gathered,
                    activations=step.peak - start - gathered - host, host_checkpoints=host,
                    total=step.peak - host, construction_peak=build.peak,
                    save_peak=save_peak, gathered_peak=gathered, tracked_after_build=start,
                    async_save_snapshot=snapshot)
    return dict(tp=grid.tp_size, dp=grid.dp_size, tp_rank=grid.tp_rank,
                dp_rank=grid.dp_rank, stage=engine.stage, precision=engine.config.precision,
                local_params=engine.layout.numel, optimizer_steps=engine.optimizer_steps,
                largest_param=max(sl.numel for sl in engine.layout.slots), measured=measured,
                bound=start + 4 * max(u.padded for u in engine.layout.units),
                save_bound=start + 12 * max(u.padded for u in engine.layout.units),
                planned=planner_figures(job), build_s=built_s, copies=log.copies,
                reads=log.reads)


def _transfers(r: dict) -> list[str]:
    """The step's host<->device copies and host reads, counted, with their source lines."""
    from hybrid.job.fake_cuda import summarize

    lines = [f"one step on {r['device']}: {len(r['copies'])} host<->device copies, "
             f"{len(r['reads'])} host reads"]
    lines += [f"  copy {x}" for x in summarize(r["copies"])]
    lines += [f"  read {x}" for x in summarize(r["reads"])]
    return lines


def format_report(r: dict) -> str:
    """A table of measured vs planned bytes per kind (GiB, or MiB when the total is below 1 GiB),
    with the relative differences."""
    m, p = r["measured"], r["planned"]
    unit, name = (GIB, "GiB") if max(m["total"], p["total"]) >= GIB else (2**20, "MiB")
    n = r["local_params"]
    count = f"{n / 1e9:.3f}e9" if n >= 1e9 else f"{n / 1e6:.3f}e6" if n >= 1e6 else f"{n:,}"
    rows = [(f"compute params ({r['precision']})", "params"), ("gradients (fp32)", "grads"),
            ("fp32 master", "master"), ("Adam moments", "optimizer"), ("model states", "states"),
            ("buffers (+ stage-3 gathered units)", "buffers"),
            ("activations + temporaries (peak)", "activations"),
            ("host checkpoints (not in total)", "host_checkpoints"),
            ("total at the step peak", "total")]
    lines = [f"dry run: rank {r['rank']} of {r['world']} (tp {r['tp']} x dp {r['dp']}, tp_rank "
             f"{r['tp_rank']}, dp_rank {r['dp_rank']}), ZeRO-{r['stage']} {r['precision']}, "
             f"{count} local parameters; built in {r['build_s']:.0f} s, "
             f"{r['wall_s']:.0f} s with the step",
             f"{'bytes per rank':<34}{'measured ' + name:>14}{'planner ' + name:>14}{'diff':>9}"]
    for label, k in rows:
        diff = f"{(m[k] - p[k]) / p[k]:+.1%}" if p[k] else "-"
        lines.append(f"{label:<34}{m[k] / unit:>14.3f}{p[k] / unit:>14.3f}{diff:>9}")
        if k == "activations" and "temporaries" in p:
            lines += [f"{'  kept for backward':<34}{'':>14}{p['kept_activations'] / unit:>14.3f}",
                      f"{'  temporaries':<34}{'':>14}{p['temporaries'] / unit:>14.3f}"]
    lines.append(f"{'construction peak':<34}{m['construction_peak'] / unit:>14.3f}{'':>14}"
                 f"  (bound: steady state + one unit in fp32 = {r['bound'] / unit:.3f}; units are "
                 "filled before the gradient and staging buffers exist, so it may equal the steady "
                 "state)")
    lines.append(f"{'checkpoint-save peak':<34}{m['save_peak'] / unit:>14.3f}{'':>14}"
                 f"  (bound: steady state + one unit's fp32 states = "
                 f"{r['save_bound'] / unit:.3f}; a rank's fragments are written from the states "
                 "themselves)")
    if m.get("async_save_snapshot"):  # host memory, kept between saves
        lines.append(f"{'--async-save host snapshot':<34}{m['async_save_snapshot'] / unit:>14.3f}"
                     "  (host memory, pinned on GPU; not in total)")
    lines.append(f"{'tracked after construction':<34}{m['tracked_after_build'] / unit:>14.3f}"
                 f"  (= model states {m['states'] / unit:.3f} + communication buffers "
                 f"{(m['buffers'] - m['gathered_peak']) / unit:.3f}; stage 3's gathered units "
                 "come and go in the step)")
    lines += _transfers(r)
    lines.append(f"{name} = 2^{30 if unit == GIB else 20} bytes. The planner's activations are "
                 "what backward keeps (arXiv 2205.05198 §4) plus the step's temporaries "
                 "(hybrid.planner.temporaries: the loss's logits and their fp32 copies, a unit's "
                 "gradients in the compute dtype before their reduction, sequence parallelism's "
                 "gathered inputs).")
    return "\n".join(lines)
