"""World functions for ``tests/test_tp_comm_overlap.py`` (spawned ranks; importable).

``--tp-comm-overlap`` (:mod:`hybrid.parallel.linear.collective_matmul`) against the plain
sequence-parallel run it replaces: same weights, batches and TP dropout streams (the rings draw
no random numbers), trained through :func:`hybrid.parallelize.parallelize` and the ZeRO engine;
and the collectives a block's forward waits on with nothing computed meanwhile.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid.activation.config import ActivationConfig
from hybrid.parallel.grid import ProcessGrid
from hybrid.parallel.linear.collective_matmul import gather_linear, linear_scatter
from hybrid.parallel.linear.functions import sequence_parallel_linear
from hybrid.parallel.ops import reduce_scatter_sequence
from hybrid.parallel.tp_plan import parallelize_gpt
from hybrid.zero.config import OptimizerConfig, ZeroConfig
from models.gpt import GPT, GPTConfig
from tests.tiny import build_parallel, make_batch, tiny_config

GPT_KW = tiny_config(ffn_hidden_size=128)  # tp 4 divides the MLP width
LLAMA_KW = dict(GPT_KW, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96,
                position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                add_bias_linear=False, untie_embeddings_and_output_weights=True)
MODELS = {"gpt": GPT_KW, "llama": LLAMA_KW}
B, S, STEPS = 2, 16, 2
OPT = dict(lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
           clip_grad=1.0)


def _train(grid: ProcessGrid, kw: dict, dropout: float, overlap: bool, full: bool,
           stage: int = 1) -> dict:
    """``STEPS`` AdamW steps of ZeRO-``stage`` (dp = world / tp), one micro-batch of ``[B, S]``
    per data-parallel rank; the dp-mean losses and the full parameters at the end."""
    kw = dict(kw, hidden_dropout=dropout, attention_dropout=dropout)
    zero = ZeroConfig(stage=stage, param_persistence_threshold=0)
    engine = build_parallel(grid, kw, zero=zero, optimizer=OptimizerConfig(**OPT),
                            activation=ActivationConfig(checkpoint_activations=True) if full
                            else None, sequence_parallel=True, tp_comm_overlap=overlap)
    torch.manual_seed(99)
    losses = []
    for step in range(STEPS):
        x, y = make_batch(100 * step + grid.dp_rank, B, S, kw["vocab_size"])
        loss = engine.model(x, y).mean()
        engine.backward(loss, is_last_micro_batch=True)
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t, group=grid.dp_group)
        losses.append(t.item() / grid.dp_size)
        engine.step(OPT["lr"])
    return dict(losses=losses, params=engine.model_state_dict_full())


def parity(grid: ProcessGrid) -> dict:
    """``{(model, dropout, full recompute): (max |loss diff|, max |param diff| after the last
    step)}`` of the overlapped run against the plain SP run."""
    out = {}
    cases = [(m, d, False) for m in MODELS for d in (0.0, 0.1)] + [("gpt", 0.1, True)]
    for name, dropout, full in cases:
        a, b = (_train(grid, MODELS[name], dropout, o, full) for o in (False, True))
        loss = max(abs(u - v) for u, v in zip(a["losses"], b["losses"], strict=True))
        param = max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])
        out[(name, dropout, full)] = (loss, param)
    return out


class _Log(TorchDispatchMode):
    """Appends ``"gemm"`` to ``events`` for every matrix multiply dispatched."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm"):
            self.events.append("gemm")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _collectives(events: list, group):
    """Every collective and P2P transfer over ``group`` appends ``("start", i)`` when launched and
    ``("wait", i)`` when waited (a blocking call: both at once)."""
    names = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor", "all_reduce", "isend", "irecv")
    counter = iter(range(1 << 30))

    def wrap(real):
        def spy(*args, **kwargs):
            if kwargs.get("group") is not group:
                return real(*args, **kwargs)
            i = next(counter)
            events.append(("start", i))
            work = real(*args, **kwargs)
            if work is None or not kwargs.get("async_op", real.__name__ in ("isend", "irecv")):
                events.append(("wait", i))
                return work
            waited = work.wait

            class Work:
                def wait(self, *a):
                    events.append(("wait", i))
                    return waited(*a)

            return Work()
        return spy

    with contextlib.ExitStack() as stack:
        for n in names:
            if hasattr(dist, n):
                stack.enter_context(mock.patch.object(dist, n, wrap(getattr(dist, n))))
        yield


def exposed_waits(events: list) -> tuple[int, int]:
    """``(transfers, blocking)``: the collectives launched, and those whose wait came with no
    GEMM since their launch (nothing computed while they moved: on the critical path)."""
    started, blocking, total = {}, 0, 0
    gemms = 0
    for e in events:
        if e == "gemm":
            gemms += 1
        elif e[0] == "start":
            started[e[1]], total = gemms, total + 1
        elif started.pop(e[1]) == gemms:
            blocking += 1
    return total, blocking


def blocking(grid: ProcessGrid) -> dict:
    """``{(model, overlap): (transfers, blocking)}`` of block 0's forward and of its backward
    (dropout 0, one micro-batch)."""
    out = {}
    for name, kw in MODELS.items():
        for overlap in (False, True):
            torch.manual_seed(1234)
            model = parallelize_gpt(GPT(GPTConfig(**kw)), grid.tp_group, sequence_parallel=True,
                                    tp_comm_overlap=overlap)
            block = model.layers[0]
            x = torch.randn(B, S // grid.tp_size, kw["hidden_size"], requires_grad=True)
            fwd, bwd = [], []
            with _collectives(fwd, grid.tp_group), _Log(fwd):
                y = block(x)
            with _collectives(bwd, grid.tp_group), _Log(bwd):
                y.backward(torch.ones_like(y))
            out[(name, overlap)] = (exposed_waits(fwd), exposed_waits(bwd))
    return out


def layer_autocast(grid: ProcessGrid) -> dict:
    """Under bf16 autocast, the pipelined column- and row-parallel GEMMs against the plain ones
    (micro-batch 3, both token orders): ``{(layer, token_wise): (max |diff| / max |plain| of the
    output, the input gradient, the weight gradient; dtypes equal)}``."""
    t, out = grid.tp_size, {}
    g = torch.Generator().manual_seed(grid.tp_rank)
    for token_wise in (False, True):
        for layer in ("column", "row"):
            shape = (3, S // t, 24) if layer == "column" else (3, S, 24)
            x0 = torch.randn(shape, generator=torch.Generator().manual_seed(grid.tp_rank))
            w0 = torch.randn(16, 24, generator=g)
            res = []
            for new in (False, True):
                x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    if layer == "column":
                        fn = gather_linear if new else sequence_parallel_linear
                        y = fn(x, w, None, grid.tp_group, None, token_wise)
                    elif new:
                        y = linear_scatter(x, w, grid.tp_group, None, token_wise)
                    else:
                        y = reduce_scatter_sequence(torch.nn.functional.linear(x, w),
                                                    grid.tp_group, None, token_wise)
                y.float().square().sum().backward()
                res.append((y.detach(), x.grad, w.grad))
            (a, b) = res
            out[(layer, token_wise)] = (
                *((u.float() - v.float()).abs().max().item() / v.float().abs().max().item()
                  for u, v in zip(b, a, strict=True)),
                all(u.dtype == v.dtype for u, v in zip(a, b, strict=True)))
    return out


def refusal(grid: ProcessGrid) -> str:
    """The message of ``parallelize_gpt`` asked for the overlap without sequence parallelism."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**GPT_KW))
    try:
        parallelize_gpt(model, grid.tp_group, tp_comm_overlap=True)
    except ValueError as e:
        return str(e)
    return ""


def comm_overlap_world(rank: int, world: int, tps: list[int], checks: list[str]) -> dict:
    """The named checks for each tp in ``tps`` in one spawned world."""
    fns = dict(parity=parity, blocking=blocking, layer_autocast=layer_autocast, refusal=refusal)
    out = {}
    for tp in tps:
        grid = ProcessGrid(tp=tp)
        out[tp] = {name: fns[name](grid) for name in checks}
    return out
