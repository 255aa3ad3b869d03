"""World functions for ``tests/test_tp_overlap.py`` (spawned ranks; importable).

The column-parallel linear's overlapped input-gradient all-reduce and the per-block sums of
replicated parameters' gradients, checked against the per-parameter / copy-then-linear path
they replace (bit for bit) and against the single-process model (fp32).
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.linear.modules import ColumnParallelLinear
from hybrid.parallel.ops import copy_to_tp
from hybrid.parallel.rng import RNGTracker
from hybrid.parallel.tp_plan import parallelize_gpt, tp_ledger
from hybrid.parallel.tp_weights import gather_full_state_dict
from models.gpt import GPT, GPTConfig

GPT_CFG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=101,
               max_position_embeddings=16)
LLAMA_CFG = dict(GPT_CFG, num_query_groups=2, ffn_hidden_size=48,
                 position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                 add_bias_linear=False, untie_embeddings_and_output_weights=True)
B, S = 2, 8


class _Order(TorchDispatchMode):
    """Records GEMMs (with their output shape) and c10d all-reduces, in dispatch order."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm"):
            self.events.append(("mm", tuple(out.shape)))
        elif name.startswith("allreduce"):
            self.events.append(("all_reduce",))
        return out


@contextlib.contextmanager
def _record_waits(events: list):
    """``dist.all_reduce`` whose async work records ``("wait",)`` when waited."""
    real = dist.all_reduce

    def spy(*args, **kwargs):
        work = real(*args, **kwargs)
        if work is None:
            return None
        waited = work.wait

        class Work:
            def wait(self, *a):
                events.append(("wait",))
                return waited(*a)

        return Work()

    with mock.patch.object(dist, "all_reduce", spy):
        yield


def overlap_order(grid: ProcessGrid) -> list:
    """Backward events of a column-parallel linear (in 6, out 16 over tp 2, 10 tokens): the
    input-gradient GEMM ``[10, 6]``, the all-reduce, the weight-gradient GEMM ``[8, 6]``,
    the wait."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(6, 16, grid.tp_group)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(2, 5, 6, requires_grad=True)
    y = layer(x)
    events: list = []
    with _record_waits(events), _Order(events):
        y.backward(torch.ones_like(y))
    return events


def _linear_grads(grid, new: bool, autocast: bool, bias: bool) -> list[torch.Tensor]:
    torch.manual_seed(1)
    layer = ColumnParallelLinear(24, 16, grid.tp_group, bias=bias)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(3, 5, 24, requires_grad=True)
    g = torch.randn(3, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if new:
            y = layer(x)
        else:  # the path it replaces: "f" as its own node before the linear
            y = F.linear(copy_to_tp(x, grid.tp_group), layer.weight, layer.bias)
    y.backward(g.to(y.dtype))
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def overlap_bitwise(grid: ProcessGrid) -> dict:
    """``{(autocast, bias): every output and gradient equal bit for bit}``."""
    out = {}
    for autocast in (False, True):
        for bias in (False, True):
            a, b = (_linear_grads(grid, new, autocast, bias) for new in (True, False))
            out[(autocast, bias)] = all(torch.equal(u, v) and u.dtype == v.dtype
                                        for u, v in zip(a, b, strict=True))
    return out


def no_input_grad(grid: ProcessGrid) -> tuple[int, bool]:
    """An input that needs no gradient: ``(all-reduces in backward, weight gradient equal to
    the copy-then-linear path's)``; neither path sums anything then."""
    from hybrid.parallel.ops import TPLedger

    torch.manual_seed(2)
    ledger = TPLedger()
    layer = ColumnParallelLinear(6, 16, grid.tp_group, ledger=ledger)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(2, 5, 6)
    layer(x).sum().backward()
    new = layer.weight.grad.clone()
    layer.weight.grad = None
    F.linear(copy_to_tp(x, grid.tp_group), layer.weight, layer.bias).sum().backward()
    return ledger.calls.get("all_reduce", 0), torch.equal(new, layer.weight.grad)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, vocab, (B, S + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _grads(model, grid, x, y, tp: bool) -> tuple[float, dict]:
    loss = model(x, y).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if tp:
        grads = gather_full_state_dict(model, grid.tp_group, grads)
    return loss.item(), grads


def parity(grid: ProcessGrid) -> dict:
    """``{(model, sp): (loss diff, max grad diff)}`` of the tp model against the single
    process on the same weights (fp32, dropout 0)."""
    out = {}
    for name, cfg in (("gpt", GPT_CFG), ("llama", dict(LLAMA_CFG, qk_layernorm=True))):
        torch.manual_seed(1234)
        ref = GPT(GPTConfig(**dict(cfg, hidden_dropout=0.0, attention_dropout=0.0)))
        x, y = _batch(cfg["vocab_size"])
        ref_loss, ref_grads = _grads(ref, grid, x, y, False)
        for sp in (False, True):
            tp = parallelize_gpt(copy.deepcopy(ref), grid.tp_group, sequence_parallel=sp)
            tp.zero_grad(set_to_none=True)
            loss, grads = _grads(tp, grid, x, y, True)
            out[(name, sp)] = (abs(loss - ref_loss),
                               max((grads[k] - ref_grads[k]).abs().max().item()
                                   for k in ref_grads))
    return out


def _coalesce_run(grid, cfg: dict, sp: bool, grouped: bool, dropout: float):
    torch.manual_seed(1234)
    model = GPT(GPTConfig(**dict(cfg, hidden_dropout=dropout, attention_dropout=dropout)))
    parallelize_gpt(model, grid.tp_group, tracker=RNGTracker(seed=77, tp_rank=grid.tp_rank),
                    sequence_parallel=sp)
    if not grouped:  # the per-parameter path this replaces
        for m in model.modules():
            if hasattr(m, "grad_group"):
                m.grad_group = None
    ledger = tp_ledger(model)
    x, y = _batch(cfg["vocab_size"])
    torch.manual_seed(99)
    loss = model(x, y).mean()
    ledger.reset()
    loss.backward()
    return (ledger.calls.get("grad_all_reduce", 0), ledger.bytes.get("grad_all_reduce", 0.0),
            [p.grad for p in model.parameters()])


def coalesce(grid: ProcessGrid) -> dict:
    """``{(model, sp, dropout): (calls grouped, calls per parameter, bytes equal, grads
    bit-equal)}`` for one backward."""
    out = {}
    for name, cfg in (("gpt", GPT_CFG), ("llama_qk", dict(LLAMA_CFG, qk_layernorm=True))):
        for sp in (True, False):
            for dropout in (0.0, 0.1):
                calls, nbytes, grads = _coalesce_run(grid, cfg, sp, True, dropout)
                calls0, nbytes0, grads0 = _coalesce_run(grid, cfg, sp, False, dropout)
                same = all(torch.equal(a, b) for a, b in zip(grads, grads0, strict=True))
                out[(name, sp, dropout)] = (calls, calls0, nbytes == nbytes0, same)
    return out


def _swiglu_run(grid, sp: bool, shared: bool, dropout: float):
    torch.manual_seed(1234)
    model = GPT(GPTConfig(**dict(LLAMA_CFG, hidden_dropout=dropout, attention_dropout=dropout)))
    parallelize_gpt(model, grid.tp_group, tracker=RNGTracker(seed=77, tp_rank=grid.tp_rank),
                    sequence_parallel=sp)
    ledger = tp_ledger(model)
    x, y = _batch(LLAMA_CFG["vocab_size"])
    torch.manual_seed(99)
    with contextlib.ExitStack() as stack:
        if not shared:  # the two-linear path this replaces
            stack.enter_context(mock.patch.object(ColumnParallelLinear, "forward_pair",
                                                  lambda self, other, x, skip_bias=False: None))
        loss = model(x, y).mean()
        loss.backward()
    return loss, dict(ledger.calls), [p.grad for p in model.parameters()]


def shared_input(grid: ProcessGrid) -> dict:
    """``{(sp, dropout): (loss bit-equal, calls shared, calls two-linear, max grad diff)}`` of
    a Llama (SwiGLU) step with gate and up sharing their input collectives, and without."""
    out = {}
    for sp in (True, False):
        for dropout in (0.0, 0.1):
            loss, calls, grads = _swiglu_run(grid, sp, True, dropout)
            loss0, calls0, grads0 = _swiglu_run(grid, sp, False, dropout)
            diff = max((a - b).abs().max().item() for a, b in zip(grads, grads0, strict=True))
            out[(sp, dropout)] = (torch.equal(loss, loss0), calls, calls0, diff)
    return out


def tp_overlap_world(rank: int, world: int, checks: list[str]) -> dict:
    """The named checks at tp = ``world`` in one spawned world."""
    fns = dict(order=overlap_order, bitwise=overlap_bitwise, parity=parity, coalesce=coalesce,
               no_input_grad=no_input_grad, shared_input=shared_input)
    grid = ProcessGrid(tp=world)
    return {name: fns[name](grid) for name in checks}
