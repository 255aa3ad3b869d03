"""GPU memory of activation checkpointing: P_a vs not, and the arena vs not (ZeRO-R, GPU).

Prints, per option, on tensor-parallel rank 0 of a tp = 2 world:

- peak allocated bytes over a few micro-batches (P_a should save about
  ``L * B * s*b*h * (1 - 1/t)`` bytes of checkpoints against plain checkpointing);
- reserved minus allocated at the peak (``max_memory_reserved - max_memory_allocated``), the
  allocator's fragmentation that the contiguous arena (M_D) is meant to reduce;
- the saved-for-backward split of one micro-batch
  (:func:`hybrid.activation.apply.measure_saved_bytes`).

World: with two or more GPUs, two ranks with NCCL (one GPU each). With one GPU, two ranks share
it over gloo: NCCL refuses two ranks on one device, and gloo has no all-gather for CUDA tensors,
so this script (never ``hybrid/``) stages each collective through host memory. The CUDA
caching allocator is per process, so each rank's peak is its own either way. Staging copies
are host tensors apart from transient device copies, which do not move the peaks compared here.

Usage (environment variables are the defaults; flags override)::

    python scripts/gpu_activation_memory.py [--num-layers 24 --hidden-size 1024 --heads 16
        --seq-length 1024 --micro-batch-size 16 --micro-batches 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.activation.apply import ActivationConfig, apply_activation_checkpointing  # noqa: E402
from hybrid.parallel.grid import ProcessGrid  # noqa: E402
from hybrid.parallel.rng import RNGTracker  # noqa: E402
from hybrid.parallel.spawn import spawn_world  # noqa: E402
from hybrid.parallel.tp_plan import parallelize_gpt  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402

ON = dict(checkpoint_activations=True)
OPTIONS = {
    "no checkpointing": None,
    "checkpoint": ON,
    "checkpoint + arena": dict(ON, contiguous_checkpointing=True),
    "Pa": dict(ON, partition_activations=True),
    "Pa + arena": dict(ON, partition_activations=True, contiguous_checkpointing=True),
    "Pa + cpu": dict(ON, partition_activations=True, checkpoint_in_cpu=True),
}


def _host_staged(fn, n_tensors):
    """Run collective ``fn`` on host copies of its first ``n_tensors`` CUDA tensors."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        tensors = args[:n_tensors]
        if not any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
            return fn(*args, **kwargs)
        host = [t.cpu() for t in tensors]
        out = fn(*host, *args[n_tensors:], **kwargs)
        for t, h in zip(tensors, host, strict=True):
            t.copy_(h)
        return out
    return wrapped


def _stage_gloo_through_host() -> None:
    dist.all_reduce = _host_staged(dist.all_reduce, 1)
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, _host_staged(getattr(dist, name), 2))


def measure(rank: int, world: int, args: dict) -> dict:
    """Run every option of :data:`OPTIONS` on this rank; returns figures in bytes."""
    cuda = args["device"] == "cuda"  # False in the CPU smoke test: no memory figures
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if cuda and dist.get_backend() == "gloo":
        _stage_gloo_through_host()
    grid = ProcessGrid(tp=world, device=device)
    cfg = GPTConfig(num_layers=args["num_layers"], hidden_size=args["hidden_size"],
                    num_attention_heads=args["heads"], vocab_size=args["vocab_size"],
                    max_position_embeddings=args["seq_length"], hidden_dropout=0.1,
                    attention_dropout=0.1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args["micro_batch_size"], args["seq_length"] + 1),
                           generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = {}
    for name, ac in OPTIONS.items():
        with torch.device("meta"):
            model = GPT(cfg)
        tracker = RNGTracker(seed=1, tp_rank=grid.tp_rank, device=device)
        parallelize_gpt(model, grid.tp_group, tracker=tracker, seed=1)
        model.to(device=device, dtype=torch.bfloat16 if cuda else torch.float32)
        handle = None if ac is None else apply_activation_checkpointing(
            model, grid, ActivationConfig(**ac), tracker)
        torch.manual_seed(2)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        for _ in range(args["micro_batches"]):
            model(x, y).mean().backward()
        peak_alloc = peak_reserved = 0
        if cuda:
            torch.cuda.synchronize()
            peak_alloc = torch.cuda.max_memory_allocated(device)
            peak_reserved = torch.cuda.max_memory_reserved(device)
        # per-parameter gradient norms (float64): every option must give the same gradients
        grads = [p.grad.double().norm().item() for p in model.parameters()]
        saved = None
        if handle is not None:
            saved = handle.measure(lambda m=model: m(x, y).mean().backward())
        out[name] = dict(peak_allocated=peak_alloc, activations_peak=peak_alloc - base,
                         reserved_minus_allocated=peak_reserved - peak_alloc, saved=saved,
                         grad_norms=grads,
                         arena_bytes=0 if handle is None or handle.arena is None
                         else handle.arena.nbytes)
        del model, handle
    sbh = args["seq_length"] * args["micro_batch_size"] * args["hidden_size"]
    out["_expected_pa_saving"] = cfg.num_layers * (2 if cuda else 4) * sbh * (1 - 1 / world)
    return out


def report(res: dict) -> str:
    mib = 2.0**20
    lines = [f"{'option':<20} {'peak alloc MiB':>15} {'reserved-alloc MiB':>19} "
             f"{'ckpt MiB':>9} {'host MiB':>9} {'other MiB':>10} {'arena MiB':>10}"]
    for name, r in res.items():
        if name.startswith("_"):
            continue
        s = r["saved"] or dict(checkpoints=0, checkpoints_host=0, other=0)
        lines.append(f"{name:<20} {r['peak_allocated'] / mib:>15.1f} "
                     f"{r['reserved_minus_allocated'] / mib:>19.1f} {s['checkpoints'] / mib:>9.1f} "
                     f"{s['checkpoints_host'] / mib:>9.1f} {s['other'] / mib:>10.1f} "
                     f"{r['arena_bytes'] / mib:>10.1f}")
    saving = res["checkpoint"]["peak_allocated"] - res["Pa"]["peak_allocated"]
    lines.append(f"Pa saves {saving / mib:.1f} MiB of peak allocated; expected about "
                 f"{res['_expected_pa_saving'] / mib:.1f} MiB (L * 2 * sbh * (1 - 1/t), bf16)")
    return "\n".join(lines)


def run(num_layers=24, hidden_size=1024, heads=16, seq_length=1024, micro_batch_size=16,
        micro_batches=3, tp=2, vocab_size=50257, device: str | None = None) -> dict:
    """Spawn the tp-rank world and return rank 0's figures.

    ``device``: "cuda" or "cpu" (None: CUDA when available). CUDA runs NCCL when there is one
    GPU per rank, else gloo with host-staged collectives; CPU runs gloo.

    Raises:
        ValueError: ``heads`` is not divisible by ``tp``, or ``device`` is not cuda / cpu.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"gpu_activation_memory: device {device!r}; valid: 'cuda', 'cpu'")
    if heads % tp:
        raise ValueError(f"gpu_activation_memory: {heads} attention heads do not split over tp "
                         f"{tp}; use a tp that divides {heads}")
    args = dict(num_layers=num_layers, hidden_size=hidden_size, heads=heads, seq_length=seq_length,
                micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                vocab_size=vocab_size, device=device)
    nccl = device == "cuda" and torch.cuda.device_count() >= tp
    return spawn_world(tp, measure, args, timeout_s=300, backend="nccl" if nccl else "gloo")[0]


def grads_agree(res: dict, rel: float) -> list[str]:
    """The options whose per-parameter gradient norms differ from "no checkpointing"'s by more
    than ``rel`` (relative); empty when every option gives the same gradients."""
    ref = res["no checkpointing"]["grad_norms"]
    return [name for name in OPTIONS if any(
        abs(x - y) > rel * max(abs(y), 1e-30) for x, y in zip(res[name]["grad_norms"], ref,
                                                                 strict=True))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    env = os.environ.get
    p.add_argument("--num-layers", type=int, default=int(env("NUM_LAYERS", 24)))
    p.add_argument("--hidden-size", type=int, default=int(env("HIDDEN_SIZE", 1024)))
    p.add_argument("--heads", type=int, default=int(env("HEADS", 16)))
    p.add_argument("--seq-length", type=int, default=int(env("SEQ_LENGTH", 1024)))
    p.add_argument("--micro-batch-size", type=int, default=int(env("MICRO_BATCH_SIZE", 16)))
    p.add_argument("--micro-batches", type=int, default=int(env("MICRO_BATCHES", 3)))
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a rehearsal without memory figures")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_activation_memory: needs a CUDA device")
    res = run(a.num_layers, a.hidden_size, a.heads, a.seq_length, a.micro_batch_size,
              a.micro_batches, vocab_size=a.vocab_size, device=a.device)
    print(report(res))
    # dropout 0.1: every option replays the same masks; bf16 on GPU, fp32 (exact) on CPU
    bad = grads_agree(res, 1e-2 if a.device == "cuda" else 0.0)
    print(f"gradients of every option equal to no checkpointing's (dropout 0.1): "
          f"{'OK' if not bad else 'FAIL: ' + ', '.join(bad)}")
    return 1 if bad else 0

if __name__ == "__main__":
    raise SystemExit(main())
