"""The host AdamW of ZeRO-Offload against this machine's memory bandwidth (the planner's model).

``hybrid.planner.offload`` times the offloaded optimizer as bandwidth bound: bytes touched per
element / (host DRAM bandwidth x ``--host-efficiency``). This measures, on this machine's CPU,
torch's AdamW step over ``--elements`` fp32 parameters in each of its implementations (fused,
foreach, for-loop) against a STREAM-style triad (``c = a + 2 b``, 12 B per element) on the same
threads, and prints each one's achieved GB/s (AdamW counted at 28 B per element: read and
write the parameter and both moments, read the gradient) and its share of the triad's.

    python scripts/bench_host_adam.py                       # 20M elements, 1 thread
    python scripts/bench_host_adam.py --elements 50000000 --threads 2

Env: none. Best of ``--repeats`` timed steps after one warm-up.
"""

from __future__ import annotations

import argparse
import time

import torch


def best_seconds(fn, repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=20_000_000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n = args.elements
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    triad = 12 * n / best_seconds(lambda: torch.add(a, b, alpha=2.0, out=c), args.repeats) / 1e9
    print(f"{n:,} fp32 elements, {args.threads} thread(s): triad {triad:.2f} GB/s")
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    for name, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True}),
                     ("for-loop", {"foreach": False})):
        opt = torch.optim.AdamW([param], lr=1e-3, **kw)
        s = best_seconds(opt.step, args.repeats)
        gbs = 28 * n / s / 1e9
        print(f"AdamW {name:<8} {s:8.4f} s/step  {gbs:6.2f} GB/s  {gbs / triad:5.0%} of the triad")


if __name__ == "__main__":
    main()
