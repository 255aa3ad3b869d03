"""World functions for the sequence-parallel and selective-recompute tests (spawned ranks).

Every run uses the same weights (seed 1234) and micro-batches as the single-process reference
``models.gpt.GPT``, computed inside each rank; results travel back as small numbers.

The same-masks rule for dropout 0.1: with sequence parallelism every dropout draws from the TP
rank's own stream (each rank holds other data), so the masks cannot equal the single-process
ones drawn from one generator. The reference instead replays the masks the parallel run drew
(gathered over the TP group: the residual/embedding masks along the sequence, the attention
masks along the heads), and must then give the same losses and gradients. Attention draws its
mask inside the fused kernel; it is redrawn from the TP stream's state at that call.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid.activation.apply import ActivationConfig, apply_activation_checkpointing
from hybrid.activation.saved_bytes import measure_saved_bytes
from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.layers import TPRegionDropout
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.tp_plan import parallelize_gpt, tp_ledger
from hybrid.parallel.tp_spec import get_tp_spec
from models.blocks import set_attention_kernel
from models.gpt import GPT, GPTConfig
from tests.activation_worlds import _run, micro_batches
from tests.tiny import build_parallel

CFG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1001,
           max_position_embeddings=32, label_smoothing=0.1)
B, S = 2, 16
KERNELS = {0: "auto", 3: "fused"}
"""Attention kernel per ZeRO stage in :func:`parity`: CPU's own (explicit with dropout) and the
fused one GPUs take by default (SDPA drawing the attention mask from the TP stream)."""
FULL = dict(checkpoint_activations=True)
VARIANTS: dict[str, tuple[bool, dict | None]] = {
    "tp": (False, None),
    "sp": (True, None),
    "sp_full": (True, FULL),
    "sp_full_pa": (True, dict(FULL, partition_activations=True)),
    "sp_full_pa_cpu_arena": (True, dict(FULL, partition_activations=True, checkpoint_in_cpu=True,
                                        contiguous_checkpointing=True)),
    "sp_selective": (True, dict(recompute_granularity="selective")),
    "tp_selective": (False, dict(recompute_granularity="selective")),
}


def gpt_config(dropout: float) -> GPTConfig:
    return GPTConfig(**dict(CFG, hidden_dropout=dropout, attention_dropout=dropout))


def build(grid: ProcessGrid, dropout: float, sp: bool, ac: dict | None, dtype=torch.float32,
          stage: int = 0):
    """The TP(+SP) GPT and its checkpointing handle; at ``stage=3`` the ZeRO-3 engine from
    :func:`tests.tiny.build_parallel` (small buckets, no persistence) in place of the model."""
    if stage == 3:
        from hybrid.zero.config import OptimizerConfig, ZeroConfig

        engine = build_parallel(
            grid, dict(CFG, hidden_dropout=dropout, attention_dropout=dropout),
            zero=ZeroConfig(stage=3, reduce_bucket_size=4096,
                                                                 allgather_bucket_size=4096,
                            param_persistence_threshold=0),
            optimizer=OptimizerConfig(lr=1e-3),
            activation=None if ac is None else ActivationConfig(**ac),
            tracker=RNGTracker(seed=77, tp_rank=grid.tp_rank), seed=1234, sequence_parallel=sp)
        return engine, engine.activation_checkpointing
    torch.manual_seed(1234)
    model = GPT(gpt_config(dropout))
    tracker = RNGTracker(seed=77, tp_rank=grid.tp_rank)
    parallelize_gpt(model, grid.tp_group, tracker=tracker, sequence_parallel=sp)
    model.to(dtype)
    handle = None if ac is None else apply_activation_checkpointing(model, grid,
                                                                    ActivationConfig(**ac), tracker)
    return model, handle


class _Replay(nn.Module):
    """Dropout that applies recorded keep-masks in order (``x * keep / (1 - p)``, as ATen)."""

    def __init__(self, p: float, masks: list[torch.Tensor]):
        super().__init__()
        self.p, self.masks = p, list(masks)

    def forward(self, x):
        return x * (self.masks.pop(0).to(x.dtype) / (1 - self.p))


def _record_masks(model, tp: int) -> dict[str, list]:
    masks: dict[str, list] = {}
    for name, m in model.named_modules():
        if isinstance(m, TPRegionDropout):
            masks[name] = []
            if name.endswith("attn.attn_dropout"):  # the fused kernel's masks
                m.rng_scope = _drawn_mask_recorder(m, masks[name], tp)
            m.register_forward_hook(lambda mod, inp, out, key=name: masks[key].append(out != 0))
    return masks


def _drawn_mask_recorder(module: TPRegionDropout, masks: list, tp: int):
    """Attention draws its mask inside SDPA, within ``module.rng_scope()``: record the TP
    stream's state there and redraw the same mask from it (CPU: one Bernoulli(1 - p) per
    element of the ``[b, heads/t, s, s]`` probabilities, as ``nn.Dropout`` on them would)."""
    real = module.rng_scope
    shape = (B, CFG["num_attention_heads"] // tp, S, S)

    @contextlib.contextmanager
    def scope():
        with real():
            gen = torch.Generator().set_state(torch.get_rng_state())
            masks.append(torch.empty(shape).bernoulli_(1 - module.p, generator=gen).bool())
            yield
    return scope


def _gather_dim1(t: torch.Tensor, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def reference(dropout: float, batches, masks: dict[str, list] | None = None):
    """Single-process losses and full gradients (masks replayed when given)."""
    torch.manual_seed(1234)
    model = GPT(gpt_config(dropout))
    for name, ms in (masks or {}).items():
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, _Replay(dropout, ms))
    losses, grads = _run(model, 0, batches)
    return losses, grads


def _diff_to_reference(model, grads: dict, ref: dict) -> float:
    specs = {n: get_tp_spec(p) for n, p in model.named_parameters()}
    return max((grads[n].float() - specs[n].shard(ref[n]).float()).abs().max().item() for n in ref)


def parity(grid: ProcessGrid) -> dict:
    """Max |loss| and |grad| differences against the single-process GPT, per variant (the
    attention kernel per :data:`KERNELS`)."""
    out = {}
    batches = micro_batches(2)
    ref0 = reference(0.0, batches)
    for stage in (0, 3):
        for dropout in (0.0, 0.1):
            base, drop_fraction, streams_differ = None, None, None
            for name, (sp, ac) in VARIANTS.items():
                built, handle = build(grid, dropout, sp, ac, stage=stage)
                model = built.model if stage == 3 else built
                set_attention_kernel(model, KERNELS[stage])
                masks = _record_masks(model, grid.tp_size) if name == "sp" and dropout else None
                losses, grads = _run(built, stage, batches)
                if dropout == 0:
                    ref_losses, ref = ref0
                    gd = _diff_to_reference(model, grads, ref)
                elif name == "sp":
                    full = {k: [_gather_dim1(m, grid.tp_group) for m in v]
                            for k, v in masks.items()}
                    # residual dropout draws from the TP stream: the ranks' slices get other masks
                    n = grid.tp_size
                    first = full["layers.0.drop1"][0].chunk(n, dim=1)
                    streams_differ = all(not torch.equal(first[0], c) for c in first[1:])
                    ref_losses, ref = reference(dropout, batches, full)
                    gd = _diff_to_reference(model, grads, ref)
                    base = (losses, grads)
                    # residual / embedding masks (attention outputs are also 0 above the diagonal)
                    kept = torch.cat([m.flatten().float() for k, v in masks.items()
                                      if "attn" not in k for m in v])
                    drop_fraction = 1 - kept.mean().item()
                elif sp:  # same TP streams as "sp": recompute must replay its masks exactly
                    ref_losses = base[0]
                    gd = max((grads[k] - base[1][k]).abs().max().item() for k in grads)
                else:
                    continue
                out[(stage, dropout, name)] = dict(
                    loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
                    grad_diff=gd, stats=None if handle is None else dict(vars(handle.stats)),
                    partitioned=None if handle is None else handle.partitioned,
                    drop_fraction=drop_fraction if name == "sp" else None,
                    streams_differ=streams_differ if name == "sp" else None)
    return out


def ledger(grid: ProcessGrid) -> dict:
    """TP collective bytes of one micro-batch (forward + backward), with and without SP."""
    out = {}
    (x, y), = micro_batches(1)
    for name in ("tp", "sp"):
        model, _ = build(grid, 0.1, name == "sp", None)
        torch.manual_seed(99)
        model(x, y).mean().backward()
        led = tp_ledger(model)
        out[name] = dict(bytes=dict(led.bytes), calls=dict(led.calls))
    return out


def saved_bytes(grid: ProcessGrid) -> dict:
    """Saved-for-backward bytes of one micro-batch (bf16, dropout 0.1), per variant."""
    out = {}
    (x, y), = micro_batches(1)
    for name, (sp, ac) in dict(VARIANTS, tp_full=(False, FULL)).items():
        if "pa" in name:
            continue
        model, handle = build(grid, 0.1, sp, ac, dtype=torch.bfloat16)
        torch.manual_seed(99)

        def step(model=model):
            model(x, y).float().mean().backward()

        out[name] = measure_saved_bytes(step, model, handle)
    return out


def seq_not_divisible(grid: ProcessGrid) -> str:
    model, _ = build(grid, 0.0, True, None)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 1001, (1, 7), generator=g)
    try:
        model(x, x)
    except ValueError as e:
        return str(e)
    return ""


def seqpar_world(rank: int, world: int, tps: list[int], checks: list[str]) -> dict:
    """The named checks for each tp in ``tps`` in one spawned world."""
    fns = dict(parity=parity, ledger=ledger, saved_bytes=saved_bytes,
               seq_not_divisible=seq_not_divisible)
    out = {}
    for tp in tps:
        grid = ProcessGrid(tp=tp)
        out[tp] = {name: fns[name](grid) for name in checks if not (name == "parity" and tp == 1)}
    return out
