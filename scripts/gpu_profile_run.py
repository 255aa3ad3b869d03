"""``hybrid.pretrain`` with one iteration of its real training loop under ``torch.profiler``
(the GPU check's ``pretrain`` and ``llama`` steps; ``scripts/gpu_check.sh``).

    torchrun --standalone --nproc-per-node 1 scripts/gpu_profile_run.py \\
        --check-profile-iteration 3 --check-profile-json prof.json <hybrid.pretrain flags>

Every flag but the two ``--check-*`` ones goes to ``hybrid.pretrain``. The profiled iteration
is the ``N``-th call of ``hybrid.training.train_step`` (pick one after the warm-up, outside
the log interval whose MFU is reported: the profiler slows the iteration it records). Rank 0
prints, and writes as JSON, the kernel time of that iteration by class (:data:`CLASSES`: GEMM,
attention, elementwise (with reductions and norms), NCCL/collectives, copies (memcpy, memset,
casts), other), the kernels per step and the largest kernels of each class. On a GPU the
kernels are the profiler's CUDA events (their device time); on CPU (the rehearsal) the ops
``scripts/count_block_ops.py`` counts (outermost ATen ops that launch work; their CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

CLASSES = ("GEMM", "attention", "elementwise", "collectives", "copies", "other")
_COLLECTIVE = ("nccl", "c10d", "gloo", "allreduce", "all_reduce", "allgather", "all_gather",
               "reduce_scatter", "reducescatter", "broadcast")
_ATTENTION = ("flash", "fmha", "attention", "sdpa", "attn")
_GEMM = ("gemm", "xmma", "cutlass", "cublas", "nvjet", "wgmma", "s16816", "aten::mm",
         "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")
_COPY = ("memcpy", "memset", "copy", "aten::to", "aten::_to_copy", "aten::clone",
         "aten::contiguous", "aten::cat", "aten::stack")


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel or CPU operator ``name`` (see :data:`CLASSES`).

    Order matters: collectives first (NCCL kernels), attention before GEMM (flash and
    cuDNN SDPA kernels use tensor-core GEMM instructions), compiled Triton kernels as
    elementwise before the copies (``triton_poi_fused__to_copy_add`` is a fused chain)."""
    n = name.lower()
    if any(k in n for k in _COLLECTIVE):
        return "collectives"
    if any(k in n for k in _ATTENTION):
        return "attention"
    if any(k in n for k in _GEMM):
        return "GEMM"
    if n.startswith("triton_") or "triton" in n:
        return "elementwise"
    if any(k in n for k in _COPY):
        return "copies"
    if any(k in n for k in ("elementwise", "vectorized", "reduce", "norm", "softmax", "kernel",
                            "aten::", "fused")):
        return "elementwise"
    return "other"


def _cpu_ops(event, out: list) -> None:
    """The ops ``scripts/count_block_ops.py`` counts under ``event`` (each outermost ATen op
    that launches work, compiled kernels), with their time including what they call."""
    from count_block_ops import COMPOSITE, METADATA

    short = event.name.split("::", 1)[-1]
    if "cpp_fused" in event.name or kernel_class(event.name) == "collectives" or (
            event.name.startswith("aten::") and short not in METADATA | COMPOSITE):
        out.append((event.name, event.cpu_time_total))
        return
    if event.name.startswith("aten::") and short in METADATA:
        return
    for child in event.cpu_children:
        _cpu_ops(child, out)


def _kernels(events, cuda: bool) -> list[tuple[str, float]]:
    """``[(name, microseconds)]`` of the recorded kernels (GPU) or dispatched ops (CPU)."""
    from torch.autograd import DeviceType

    if cuda:
        return [(e.name, e.time_range.elapsed_us()) for e in events
                if e.device_type == DeviceType.CUDA]
    out: list = []
    for e in events:
        if e.device_type == DeviceType.CPU and e.cpu_parent is None:
            _cpu_ops(e, out)
    return out


def summarize(kernels: list[tuple[str, float]], device: str) -> dict:
    """Kernel time (ms) and count by class, the total and each class's three largest kernels
    (by summed time) from ``[(name, microseconds)]``."""
    ms, count = defaultdict(float), defaultdict(int)
    by_name: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for name, us in kernels:
        c = kernel_class(name)
        ms[c] += us / 1e3
        count[c] += 1
        by_name[c][name] += us / 1e3
    top = {c: sorted(v.items(), key=lambda kv: -kv[1])[:3] for c, v in by_name.items()}
    return dict(device=device, total_ms=sum(ms.values()), kernels=len(kernels),
                ms={c: ms[c] for c in CLASSES}, count={c: count[c] for c in CLASSES}, top=top)


def report(s: dict, iteration: int) -> str:
    """The profile summary as printed lines."""
    unit = "kernels" if s["device"] == "cuda" else "CPU operators (rehearsal)"
    total = max(s["total_ms"], 1e-9)
    lines = [f"profile of iteration {iteration} ({s['device']}): {s['kernels']} {unit} per step, "
             f"{s['total_ms']:.1f} ms of kernel time; kernel time by class:"]
    for c in CLASSES:
        names = "; ".join(f"{n[:60]} {t:.1f} ms" for n, t in s["top"].get(c, []))
        lines.append(f"  {c:<12} {s['ms'][c]:9.1f} ms {100 * s['ms'][c] / total:5.1f}% "
                     f"{s['count'][c]:6d} kernels  {names}")
    return "\n".join(lines)


def _profiled(real, iteration: int, out_json: str | None):
    """``train_step`` whose ``iteration``-th call runs under the profiler (rank 0 reports)."""
    calls = [0]

    def step(engine, *args, **kwargs):
        import torch
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile

        calls[0] += 1
        if calls[0] != iteration:
            return real(engine, *args, **kwargs)
        cuda = torch.cuda.is_available()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            out = real(engine, *args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        s = summarize(_kernels(prof.events(), cuda), "cuda" if cuda else "cpu")
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(report(s, iteration), flush=True)
            if out_json:
                with open(out_json, "w") as f:
                    json.dump(dict(s, iteration=iteration), f, indent=1)
        return out

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    p.add_argument("--check-profile-iteration", type=int, required=True)
    p.add_argument("--check-profile-json")
    a, rest = p.parse_known_args(argv)
    if a.check_profile_iteration < 1:
        print(f"gpu_profile_run: --check-profile-iteration {a.check_profile_iteration}: must "
              "be >= 1", file=sys.stderr)
        return 2
    import hybrid.training as training
    from hybrid.pretrain import main as pretrain

    training.train_step = _profiled(training.train_step, a.check_profile_iteration,
                                    a.check_profile_json)
    return pretrain(rest)


if __name__ == "__main__":
    from hybrid.job.teardown import exit_now

    exit_now(main())  # as hybrid.pretrain ends (gloo threads outliving the process group)
