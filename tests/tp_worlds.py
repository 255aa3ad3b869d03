"""World functions for the tensor-parallel tests (run inside spawned ranks; importable)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.parallel.cross_entropy import vocab_parallel_cross_entropy
from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.tp_plan import parallelize_gpt
from hybrid.parallel.tp_spec import get_tp_spec
from hybrid.parallel.tp_weights import count_parameters, gather_full_state_dict
from hybrid.parallel.vocab import pad_vocab_size
from models.gpt import GPT, GPTConfig
from models.presets import get_preset
from tests.tiny import make_batch, tiny_config
from tests.tiny import reference as tiny_reference

SMALL = tiny_config(ffn_hidden_size=None, label_smoothing=0.1)
"""The tiny GPT with the default MLP width 4h (tp = 4 must divide it) and label smoothing."""


def batch(seed: int = 0, b: int = 2, s: int = 16, vocab: int = 1001):
    """Random ``(x, y)`` of ``[b, s]`` (:func:`tests.tiny.make_batch`)."""
    return make_batch(seed, b, s, vocab)


def reference(config_kw: dict, seed: int = 1234):
    """Single-process loss, gradients and weights of the plain GPT on :func:`batch`."""
    r = tiny_reference(config_kw, [batch()], seed=seed)
    return r["losses"][0], r["grads"], r["initial"]


def _tp_parity(grid: ProcessGrid, config_kw: dict, divisible_by: int = 128) -> dict:
    torch.manual_seed(1234)
    model = GPT(GPTConfig(**config_kw))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    parallelize_gpt(model, grid.tp_group, make_vocab_size_divisible_by=divisible_by)
    x, y = batch()
    loss = model(x, y).mean()
    loss.backward()
    grads = gather_full_state_dict(model, grid.tp_group,
                                   {n: p.grad for n, p in model.named_parameters()})
    weights = gather_full_state_dict(model, grid.tp_group)
    wte = model.wte
    pad_rows = wte.weight.grad[max(0, wte.vocab_size - wte.vocab_start):]
    return dict(
        loss=loss.item(), grads=grads,
        roundtrip=all(torch.equal(weights[k], full[k]) for k in full),
        pad_rows=pad_rows.shape[0], pad_grad_abs=pad_rows.abs().sum().item(),
        padded_vocab=wte.padded_vocab,
    )


def _huge_logits(grid: ProcessGrid) -> dict:
    """Vocab-parallel CE on logits x 1000 against torch's CE on the full logits."""
    v, tp = 1001, grid.tp_size
    vp = pad_vocab_size(v, tp)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(3, 5, v, generator=g) * 1000
    labels = torch.randint(0, v, (3, 5), generator=g)
    padded = torch.cat([full, torch.zeros(3, 5, vp - v, dtype=full.dtype)], dim=-1)
    per = vp // tp
    local = padded[..., grid.tp_rank * per:(grid.tp_rank + 1) * per].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, labels, grid.tp_rank * per, v, grid.tp_group, 0.1)
    loss.sum().backward(retain_graph=True)
    try:  # the backward reuses the saved softmax in place, so a second one must refuse
        loss.sum().backward()
        twice = None
    except RuntimeError as e:
        twice = str(e)
    grad = [torch.empty_like(local.grad) for _ in range(tp)]
    dist.all_gather(grad, local.grad, group=grid.tp_group)
    return dict(loss=loss.detach(), grad=torch.cat(grad, -1), full=full, labels=labels, twice=twice)


def _dropout_checks(grid: ProcessGrid) -> dict:
    cfg = dict(SMALL, hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(99)  # same default-generator state on every rank
    model = GPT(GPTConfig(**cfg))
    tracker = RNGTracker(seed=99, tp_rank=grid.tp_rank)
    parallelize_gpt(model, grid.tp_group, tracker=tracker)
    masks = {}

    def hook(name):
        def f(mod, inp, out):
            masks[name] = ((out == 0) & (inp[0] != 0)).clone()
        return f

    blk = model.layers[0]
    blk.drop1.register_forward_hook(hook("residual"))
    model.drop.register_forward_hook(hook("embedding"))
    blk.attn.attn_dropout.register_forward_hook(hook("attention"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    same_rep = same_tp = None
    for step in range(10):
        x, y = batch(seed=step)
        opt.zero_grad()
        model(x, y).mean().backward()
        opt.step()
        if step == 0:
            gathered = {}
            for k, m in masks.items():
                parts = [torch.empty_like(m, dtype=torch.uint8) for _ in range(grid.tp_size)]
                dist.all_gather(parts, m.to(torch.uint8), group=grid.tp_group)
                gathered[k] = parts
            same_rep = all(torch.equal(gathered[k][0], t) for k in ("residual", "embedding")
                           for t in gathered[k])
            same_tp = any(torch.equal(gathered["attention"][0], t)
                          for t in gathered["attention"][1:])
            dropped = masks["attention"].float().mean().item()
    rep_equal = True
    for _, p in model.named_parameters():
        if get_tp_spec(p).replicated:
            parts = [torch.empty_like(p) for _ in range(grid.tp_size)]
            dist.all_gather(parts, p.detach(), group=grid.tp_group)
            rep_equal &= all(torch.equal(parts[0], t) for t in parts)
    return dict(replicated_masks_equal=same_rep, tp_masks_any_equal=same_tp,
                attention_drop_fraction=dropped, replicated_params_equal=rep_equal)


def _param_count(grid: ProcessGrid) -> dict:
    with torch.device("meta"):
        model = GPT(get_preset("gpt2-124m", attention_dropout=0.0))
    parallelize_gpt(model, grid.tp_group)
    sharded, replicated = count_parameters(model)
    t = torch.tensor([sharded], dtype=torch.int64)
    dist.all_reduce(t, group=grid.tp_group)
    return dict(total=t.item() + replicated)


def _grid_groups(grid: ProcessGrid) -> dict:
    def members(group, n):
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(parts, torch.tensor([grid.rank]), group=group)
        return [int(p) for p in parts]

    return dict(tp=members(grid.tp_group, grid.tp_size), dp=members(grid.dp_group, grid.dp_size),
                expect_tp=grid.tp_ranks(), expect_dp=grid.dp_ranks(),
                coords=(grid.tp_rank, grid.dp_rank))


def tp_world(rank: int, world: int, tps: list[int]) -> dict:
    """All TP checks for each tp in ``tps`` in one spawned world."""
    out = {}
    for tp in tps:
        grid = ProcessGrid(tp=tp)
        out[tp] = dict(
            parity=_tp_parity(grid, SMALL),
            parity_pad5=_tp_parity(grid, SMALL, divisible_by=5),
            parity_untied=_tp_parity(grid, dict(SMALL, untie_embeddings_and_output_weights=True,
                                                label_smoothing=0.0)),
            huge=_huge_logits(grid),
            dropout=_dropout_checks(grid),
            count=_param_count(grid),
            groups=_grid_groups(grid),
        )
    return out
