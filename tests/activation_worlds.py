"""World functions for the activation-checkpointing tests (run inside spawned ranks; importable).

Every check compares a run with an :class:`ActivationConfig` against the same run without
checkpointing on the same ranks (same weights, seeds and micro-batches), so results stay small
(differences and counters) when they travel back to the test process.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import Counter

import torch
import torch.distributed as dist

from hybrid.activation.apply import ActivationConfig, apply_activation_checkpointing
from hybrid.activation.recompute import CHECKPOINT_TAG, ActivationStore
from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.tp_plan import parallelize_gpt
from models.blocks import set_attention_kernel
from models.gpt import GPT, GPTConfig
from tests.fake_stage3 import FakeStage3
from tests.tiny import build_parallel, make_batch, tiny_config

CFG = tiny_config(num_layers=3, ffn_hidden_size=None, label_smoothing=0.1)
"""The tiny GPT with 3 blocks (so "the first 2 blocks" is a real subset), MLP width 4h, label
smoothing; dropout is set per check."""
B, S = 2, 16

ON = dict(checkpoint_activations=True)
BLOCK = dict(ON, recompute_granularity="full", recompute_method="block")  # + the first N blocks
VARIANTS: dict[str, dict] = {
    "checkpoint": ON,
    "pa": dict(ON, partition_activations=True),
    "pa_cpu": dict(ON, partition_activations=True, checkpoint_in_cpu=True),
    "arena": dict(ON, contiguous_checkpointing=True),
    "pa_arena": dict(ON, partition_activations=True, contiguous_checkpointing=True),
    "pa_cpu_arena": dict(ON, partition_activations=True, checkpoint_in_cpu=True,
                         contiguous_checkpointing=True),
    "first_2_blocks": dict(BLOCK, recompute_num_layers=2, partition_activations=True,
                           contiguous_checkpointing=True),
}
ALL_ON = VARIANTS["pa_cpu_arena"]
DROPOUTS = (0.0, 0.1)
KERNELS = {0: "auto", 3: "fused"}
"""Attention kernel per ZeRO stage in :func:`parity`: CPU's own (explicit with dropout) and the
fused one GPUs take by default (SDPA drawing the attention mask from the TP stream, which
recompute must replay)."""


def zero_stages() -> list[int]:
    """ZeRO stages the parity checks run under: 0 (plain TP, ``p.grad`` on each rank) and 3
    (the ZeroEngine, parameters gathered per block, gradients reduce-scattered over dp)."""
    return [0, 3]


def micro_batches(n: int = 2, vocab: int = 1001):
    """``n`` random micro-batches ``(x, y)`` of ``[B, S]``: one :func:`tests.tiny.make_batch`,
    cut."""
    x, y = make_batch(5, n * B, S, vocab)
    return [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(n)]


def build(grid: ProcessGrid, dropout: float, ac: dict | None, dtype=torch.float32, stage: int = 0,
          **cfg_kw):
    """A TP GPT (same weights on every call), its tracker and the checkpointing handle.

    ``stage=3`` returns the :func:`tests.tiny.build_parallel` engine (TP plan -> checkpointing ->
    ZeRO-3 with small buckets and no persistence, so every block really is gathered and
    released) in place of the model."""
    if stage == 3:
        from hybrid.zero.config import OptimizerConfig, ZeroConfig

        tracker = RNGTracker(seed=77, tp_rank=grid.tp_rank)
        engine = build_parallel(
            grid, dict(CFG, hidden_dropout=dropout, attention_dropout=dropout, **cfg_kw),
            zero=ZeroConfig(stage=3, reduce_bucket_size=4096, allgather_bucket_size=4096,
                            param_persistence_threshold=0),
            optimizer=OptimizerConfig(lr=1e-3),
            activation=None if ac is None else ActivationConfig(**ac), tracker=tracker)
        return engine, tracker, engine.activation_checkpointing
    torch.manual_seed(1234)
    model = GPT(GPTConfig(**dict(CFG, hidden_dropout=dropout, attention_dropout=dropout, **cfg_kw)))
    tracker = RNGTracker(seed=77, tp_rank=grid.tp_rank)
    parallelize_gpt(model, grid.tp_group, tracker=tracker)
    model.to(dtype)
    handle = None if ac is None else apply_activation_checkpointing(model, grid,
                                                                    ActivationConfig(**ac), tracker)
    return model, tracker, handle


def _run(model, stage: int, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Forward + backward over ``batches`` (gradient accumulation); losses and local grads.
    ``model`` is the engine at stage 3 (:func:`build`)."""
    torch.manual_seed(99)  # the default generator: identical on all TP ranks
    if stage == 3:
        engine = model
        losses = []
        for i, (x, y) in enumerate(batches):
            loss = engine.model(x, y).mean()
            engine.backward(loss / len(batches), is_last_micro_batch=i == len(batches) - 1)
            losses.append(loss.item())
        grads = {n: g * len(batches) for n, g in engine.gradients_by_name().items()}
        return losses, grads
    losses = []
    for x, y in batches:
        loss = model(x, y).mean()
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def parity(grid: ProcessGrid) -> dict:
    """Max |grad - grad without checkpointing| for every variant, dropout and ZeRO stage (the
    attention kernel per :data:`KERNELS`)."""
    out = {}
    batches = micro_batches()
    for stage in zero_stages():
        for p in DROPOUTS:
            model, _, _ = build(grid, p, None, stage=stage)
            set_attention_kernel(model if stage == 0 else model.model, KERNELS[stage])
            names = [n for n, _ in (model if stage == 0 else model.model).named_parameters()]
            ref_losses, ref = _run(model, stage, batches)
            for name, ac in VARIANTS.items():
                model, _, handle = build(grid, p, ac, stage=stage)
                set_attention_kernel(model if stage == 0 else model.model, KERNELS[stage])
                losses, grads = _run(model, stage, batches)
                out[(stage, p, name)] = dict(
                    grad_diff=_max_diff(grads, ref),
                    loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
                    names_same=[n for n, _ in (model if stage == 0
                                               else model.model).named_parameters()] == names,
                    stats=dict(vars(handle.stats)), partitioned=handle.partitioned,
                )
    return out


@contextlib.contextmanager
def count_collectives():
    """Count calls of torch.distributed collectives made through the module's attributes
    (nested calls, e.g. a deprecated alias calling its replacement, count once)."""
    counts: Counter = Counter()
    depth = [0]
    saved = {}
    names = {"all_reduce": "all_reduce", "all_gather": "all_gather",
             "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather"}
    for name, kind in names.items():
        if not hasattr(dist, name):
            continue
        saved[name] = orig = getattr(dist, name)

        def wrapped(*a, _orig=orig, _kind=kind, **k):
            if depth[0] == 0:
                counts[_kind] += 1
            depth[0] += 1
            try:
                return _orig(*a, **k)
            finally:
                depth[0] -= 1
        setattr(dist, name, wrapped)
    try:
        yield counts
    finally:
        for name, orig in saved.items():
            setattr(dist, name, orig)


def collectives(grid: ProcessGrid) -> dict:
    """Collectives in forward and in backward of one micro-batch, per option."""
    out = {}
    (x, y), = micro_batches(1)
    for name, ac in (("none", None), ("checkpoint", ON), ("pa", VARIANTS["pa"]),
                     ("pa_cpu_arena", ALL_ON), ("first_2_blocks", VARIANTS["first_2_blocks"])):
        model, _, handle = build(grid, 0.1, ac)
        torch.manual_seed(99)
        with count_collectives() as fwd:
            loss = model(x, y).mean()
        with count_collectives() as bwd:
            loss.backward()
        out[name] = dict(fwd=dict(fwd), bwd=dict(bwd),
                         stats=None if handle is None else dict(vars(handle.stats)))
    return out


def saved_bytes(grid: ProcessGrid) -> dict:
    """Saved-for-backward bytes of one micro-batch (forward + backward), fp32 and bf16."""
    out = {}
    (x, y), = micro_batches(1)
    for dtype in (torch.float32, torch.bfloat16):
        for name, ac in (("none", None), ("checkpoint", ON), ("pa", VARIANTS["pa"]),
                         ("pa_cpu", VARIANTS["pa_cpu"]), ("pa_arena", VARIANTS["pa_arena"])):
            model, _, handle = build(grid, 0.1, ac, dtype=dtype)
            torch.manual_seed(99)

            def step(model=model):
                model(x, y).float().mean().backward()

            if handle is None:
                from hybrid.activation.saved_bytes import measure_saved_bytes
                res = measure_saved_bytes(step, model)
            else:
                res = handle.measure(step)
            out[(str(dtype).removeprefix("torch."), name)] = res
    return out


def _checkpoint_tensors(fn) -> list[torch.Tensor]:
    got = []

    def pack(t):
        if getattr(t, CHECKPOINT_TAG, None) is not None:
            got.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return got


def arena(grid: ProcessGrid) -> dict:
    """Checkpoints are views of one buffer; it is allocated once over several micro-batches."""
    out = {}
    for name in ("arena", "pa_arena", "pa_cpu_arena"):
        model, _, handle = build(grid, 0.1, VARIANTS[name])
        torch.manual_seed(99)
        per_mb = []
        for x, y in micro_batches(3):
            loss_box = []

            def forward(x=x, y=y, box=loss_box, model=model):
                box.append(model(x, y).mean())

            ckpts = _checkpoint_tensors(forward)
            buf = handle.arena.buffer
            live_after_forward = handle.arena.live_slots()
            loss_box[0].backward()
            per_mb.append(dict(
                n=len(ckpts),
                all_in_arena=all(handle.arena.owns(t) for t in ckpts),
                offsets=sorted(t.storage_offset() for t in ckpts),
                numel=[t.numel() for t in ckpts],
                buffer_ptr=buf.data_ptr(), buffer_numel=buf.numel(),
                buffer_device=str(buf.device),
                live_after_forward=live_after_forward,
                live_after_backward=handle.arena.live_slots(),
            ))
        out[name] = dict(per_mb=per_mb, allocations=handle.arena.allocations,
                         stats=dict(vars(handle.stats)))
    return out


def evaluation(grid: ProcessGrid) -> dict:
    """Forward without backward, every option on: under no_grad and with grad but no backward."""
    (x, y), = micro_batches(1)
    model, _, _ = build(grid, 0.1, None)
    model.eval()
    with torch.no_grad():
        ref = model(x, y)
    model, _, handle = build(grid, 0.1, ALL_ON)
    model.eval()
    with torch.no_grad():
        got = model(x, y)
    res = dict(no_grad_equal=torch.equal(got, ref), no_grad_checkpoints=handle.stats.checkpoints,
               arena_after_no_grad=None if handle.arena is None else handle.arena.live_slots())
    loss = model(x, y).mean()  # grad enabled, never backpropagated
    res["live_with_graph"] = handle.arena.live_slots()
    del loss
    gc.collect()
    res["live_after_drop"] = handle.arena.live_slots()
    model.train()
    torch.manual_seed(99)
    model(x, y).mean().backward()  # training still works after evaluation
    res["overflows"] = handle.stats.arena_overflows
    res["live_after_train"] = handle.arena.live_slots()
    return res


def two_forwards(grid: ProcessGrid) -> dict:
    """Two forwards before one backward: the arena overflows to own allocations, gradients hold."""
    batches = micro_batches(2)
    grads = []
    for ac in (None, ALL_ON):
        model, _, handle = build(grid, 0.1, ac)
        torch.manual_seed(99)
        loss = sum(model(x, y).mean() for x, y in batches)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return dict(grad_diff=_max_diff(grads[1], grads[0]), overflows=handle.stats.arena_overflows,
                live=handle.arena.live_slots())


def fake_stage3(grid: ProcessGrid) -> dict:
    """Recompute runs the block's pre-hooks and uses the parameters present at backward time."""
    batches = micro_batches(2)
    model, _, _ = build(grid, 0.1, None)
    _, ref = _run(model, 0, batches)
    model, _, handle = build(grid, 0.1, ALL_ON)
    fakes = [FakeStage3(b) for b in model.layers]
    _, got = _run(model, 0, batches)
    return dict(grad_diff=_max_diff(got, ref), pre_calls=[f.pre_calls for f in fakes],
                empty_at_backward=[f.empty_at_backward for f in fakes])


def partition_padding(grid: ProcessGrid) -> dict:
    """P_a of a tensor whose size is not a multiple of tp (7 elements): pad, gather, trim."""
    store = ActivationStore(grid.tp_group, partition=True, in_cpu=True, num_slots=None,
                            tracker=None)
    x = torch.arange(7, dtype=torch.float32).view(1, 7, 1) + 10 * grid.dp_rank
    stored, meta = store.save(0, x)
    back = store.load(stored, meta)
    return dict(equal=torch.equal(back, x), kept=stored.numel(), gathers=store.stats.allgathers)


def noop_log(grid: ProcessGrid) -> dict:
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("hybrid.activation.apply")
    keep, level = Keep(), log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        _, _, handle = build(grid, 0.0, VARIANTS["pa"])
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    return dict(partitioned=handle.partitioned, messages=records)


def handle_api(grid: ProcessGrid) -> dict:
    """remove() restores the plain forward; double application and a foreign tracker fail."""
    model, tracker, handle = build(grid, 0.1, ON)
    res = dict(wrapped=all("forward" in b.__dict__ for b in model.layers))
    try:
        apply_activation_checkpointing(model, grid, ActivationConfig(**ON), tracker)
        res["double_apply"] = None
    except RuntimeError as e:
        res["double_apply"] = str(e)
    handle.remove()
    res["removed"] = all("forward" not in b.__dict__ for b in model.layers)
    first = ActivationConfig(**BLOCK, recompute_num_layers=1)
    handle = apply_activation_checkpointing(model, grid, first)
    res["found_tracker"] = handle.store.tracker is tracker  # picked up from the TP dropout
    handle.remove()
    errors = {}
    for key, cfg, trk in (("foreign_tracker", ON, RNGTracker(1, grid.tp_rank)),
                          ("too_many_layers", dict(BLOCK, recompute_num_layers=L_MAX + 1), None)):
        try:
            apply_activation_checkpointing(model, grid, ActivationConfig(**cfg), trk)
        except ValueError as e:
            errors[key] = str(e)
    res["errors"] = errors
    return res


L_MAX = CFG["num_layers"]

CHECKS = dict(handle_api=handle_api, parity=parity, collectives=collectives,
              saved_bytes=saved_bytes, arena=arena, evaluation=evaluation,
              two_forwards=two_forwards, fake_stage3=fake_stage3,
              partition_padding=partition_padding, noop_log=noop_log)


def activation_world(rank: int, world: int, tps: list[int]) -> dict:
    """Every activation check for each tp in ``tps`` in one spawned world."""
    out = {}
    for tp in tps:
        grid = ProcessGrid(tp=tp)
        out[tp] = {name: fn(grid) for name, fn in CHECKS.items()}
    return out
