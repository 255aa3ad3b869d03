"""The peers' common workload for ``scripts/bench_zero.py``: one GPT, one data stream, one
optimizer and one way of timing and reporting, shared by every peer and by our own launches.

- Model: pre-LayerNorm GPT with separate q/k/v/output projections (so DTensor's column/row
  styles can shard each), causal ``F.scaled_dot_product_attention``, a GeLU MLP of width 4h, an
  untied output head, no dropout; weights drawn with ``torch.manual_seed(1234)`` on every rank
  before any wrapping, so every peer starts from the same weights.
- Data: batch ``(step, dp_rank)`` is a pure function of the seed: a 32-token Zipf motif
  repeated along the sequence with 10% of the tokens redrawn, target = next token. Peers of the
  same data-parallel size therefore see the same data and report the same losses.
- Optimizer: ``torch.optim.AdamW(lr 1e-3, betas (0.9, 0.95), weight_decay 0.1, eps 1e-8)``, no
  schedule, no clipping, fp32.
- Timing: wall time of each step on rank 0, forward through the optimizer step; the first
  ``warmup`` steps are not timed. One ``RESULT {json}`` line per launch (:func:`report`).

Sizes (layers, hidden, heads, vocabulary, sequence, micro-batch): ``tiny`` (4, 256, 4, 4096,
256, 4), ``medium`` (8, 512, 8, 4096, 256, 4), ``test`` (2, 32, 2, 128, 16, 2) for the smoke test.
Env: PEER_SIZE (default tiny), PEER_STEPS, PEER_WARMUP, PEER_T0 (the launcher's start time, s).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

T_PROC_START = float(os.environ.get("PEER_T0", time.time()))
"""Start of the launch (the launcher's clock when it exported PEER_T0), for ``init_s``."""

SIZES = {
    "tiny": (4, 256, 4, 4096, 256, 4),
    "medium": (8, 512, 8, 4096, 256, 4),
    "test": (2, 32, 2, 128, 16, 2),
}


@dataclass(frozen=True)
class Cfg:
    """Model and batch shape: ``layers``, width ``hidden``, ``heads``, vocabulary ``vocab``,
    sequence ``seq`` (tokens) and micro-batch ``mbs`` (sequences per data-parallel rank)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    mbs: int


def cfg_from_env() -> tuple[str, Cfg]:
    """``(size name, Cfg)`` from PEER_SIZE; ValueError names the valid sizes."""
    size = os.environ.get("PEER_SIZE", "tiny")
    if size not in SIZES:
        raise ValueError(f"PEER_SIZE={size!r}; valid: {', '.join(SIZES)}")
    return size, Cfg(*SIZES[size])


def steps_from_env() -> tuple[int, int]:
    """``(steps, warm-up steps)`` from PEER_STEPS (default 23) and PEER_WARMUP (default 3)."""
    return int(os.environ.get("PEER_STEPS", "23")), int(os.environ.get("PEER_WARMUP", "3"))


class SelfAttention(nn.Module):
    """Causal attention ``[b, s, h] -> [b, s, h]``; infers its head count from ``wq``'s output
    (a tensor-parallel rank holds ``heads / tp`` of them)."""

    def __init__(self, c: Cfg):
        super().__init__()
        self.head_dim = c.hidden // c.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.hidden, c.hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """``fc2(gelu(fc1(x)))``, width 4h."""

    def __init__(self, c: Cfg):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden, 4 * c.hidden)
        self.fc2 = nn.Linear(4 * c.hidden, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``."""

    def __init__(self, c: Cfg):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.hidden), nn.LayerNorm(c.hidden)
        self.attn, self.mlp = SelfAttention(c), FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PeerGPT(nn.Module):
    """Token ids ``[b, s]`` -> logits ``[b, s, vocab]``; ``blocks`` is what the peers wrap."""

    def __init__(self, c: Cfg):
        super().__init__()
        self.tok, self.pos = nn.Embedding(c.vocab, c.hidden), nn.Embedding(c.seq, c.hidden)
        self.blocks = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(c: Cfg, seed: int = 1234) -> PeerGPT:
    """The same weights on every rank and in every peer."""
    torch.manual_seed(seed)
    return PeerGPT(c)


def batch(c: Cfg, step: int, dp_rank: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, each ``[mbs, seq]`` int64, for ``(step, dp_rank)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + dp_rank)
    weights = 1.0 / torch.arange(1, c.vocab + 1, dtype=torch.float64)  # Zipf

    def draw(n: int) -> torch.Tensor:
        return torch.multinomial(weights, n, replacement=True, generator=g)

    motif = draw(c.mbs * 32).view(c.mbs, 32)
    tokens = motif.repeat(1, c.seq // 32 + 2)[:, :c.seq + 1]
    noisy = torch.rand(tokens.shape, generator=g) < 0.1
    tokens = torch.where(noisy, draw(tokens.numel()).view(tokens.shape), tokens)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32 over all ``b * s`` tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def init_dist() -> tuple[int, int]:
    """A gloo group from torchrun's environment (kept if one exists); ``(rank, world)``."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def tensor_bytes(objs, skip: frozenset = frozenset()) -> int:
    """Bytes of the distinct storages of the tensors reachable from ``objs``: modules'
    parameters (a DTensor's local shard), their ``.grad`` and DeepSpeed ``ds_tensor``, optimizer
    states, and tensors in the attributes of torch/DeepSpeed objects (6 levels; attribute names
    in ``skip`` are not followed)."""
    storages: dict[tuple[int, int], int] = {}
    seen: set[int] = set()
    stack = [(o, 0) for o in objs]
    while stack:
        o, depth = stack.pop()
        if o is None or depth > 6 or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            t = o.to_local() if hasattr(o, "to_local") else o
            if t.device.type != "meta" and t.untyped_storage().nbytes():
                st = t.untyped_storage()
                storages[(st.data_ptr(), st.nbytes())] = st.nbytes()
            stack += [(getattr(o, a, None), depth + 1) for a in ("grad", "ds_tensor")
                      if isinstance(o, nn.Parameter)]
        elif isinstance(o, dict):
            stack += [(v, depth + 1) for v in o.values()]
        elif isinstance(o, (list, tuple, set)):
            stack += [(v, depth + 1) for v in o]
        elif isinstance(o, nn.Module):
            stack += [(t, depth + 1) for t in [*o.parameters(), *o.buffers()]]
        elif isinstance(o, torch.optim.Optimizer):
            stack += [(o.state, depth + 1), ([g["params"] for g in o.param_groups], depth + 1)]
        elif type(o).__module__.split(".")[0] in ("deepspeed", "torch") and hasattr(o, "__dict__"):
            stack += [(v, depth + 1) for k, v in vars(o).items()
                      if k not in ("module", "_modules") and k not in skip]
    return sum(storages.values())


def train(step_fn, c: Cfg, dp_rank: int) -> tuple[list[float], list[float]]:
    """Run ``step_fn(x, y, step) -> loss`` (forward, backward and optimizer step; a peer
    measures its state bytes inside it at the last step, while gradients and optimizer states
    are all live) for PEER_STEPS steps on this rank's batches. Returns ``(times, losses)``:
    seconds per step and this rank's losses."""
    steps, _ = steps_from_env()
    times, losses = [], []
    for step in range(steps):
        x, y = batch(c, step, dp_rank)
        t0 = time.perf_counter()
        loss = step_fn(x, y, step)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times, losses


def world_mean(values: list[float], group=None) -> list[float]:
    """Element-wise mean of a list of floats over ``group`` (the reported loss per step)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


def _gather_max(value: float) -> list[float]:
    t = torch.tensor([float(value)], dtype=torch.float64)
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [float(p.item()) for p in parts]


def report(name: str, rank: int, world: int, dp: int, c: Cfg, times: list[float], warmup: int,
           losses: list[float], t_init: float, state_bytes: int | None = None,
           extra: dict | None = None) -> dict | None:
    """Gather every rank's peak RSS and state bytes; rank 0 prints ``RESULT {json}`` and
    returns the dict (others None). ``ms_step_median``: median of the timed steps (ms);
    ``tokens_per_s``: ``dp * mbs * seq`` / that median."""
    rss = _gather_max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)  # KiB -> MiB
    state = _gather_max(state_bytes or 0)
    if rank != 0:
        return None
    timed = times[warmup:] or times
    med = statistics.median(timed)
    out = {
        "peer": name, "world": world, "dp": dp, "size": os.environ.get("PEER_SIZE", "tiny"),
        "cfg": asdict(c), "steps": len(times), "timed_steps": len(timed),
        "ms_step_median": round(med * 1e3, 1), "ms_step_min": round(min(timed) * 1e3, 1),
        "tokens_per_s": round(dp * c.mbs * c.seq / med, 1),
        "peak_rss_mib_per_rank": [round(x, 1) for x in rss],
        "state_mib_per_rank": ([round(x / 2**20, 2) for x in state]
                               if state_bytes is not None else None),
        "loss_first": round(losses[0], 5), "loss_final": round(losses[-1], 5),
        "init_s": round(t_init, 2), "losses": [round(x, 5) for x in losses],
        "ms_steps_rank0": [round(t * 1e3, 1) for t in times],
    }
    out.update(extra or {})
    print("RESULT " + json.dumps(out), flush=True)
    return out
