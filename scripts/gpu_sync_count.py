"""Host synchronisations per iteration of the real training loop (``hybrid.pretrain``).

Runs ``hybrid.job.run.run`` on one rank with the given flags (mock data, dropout and
activation checkpointing by default) and counts, per training iteration after the first:

- on CUDA, the synchronising calls ``torch.cuda.set_sync_debug_mode("warn")`` reports;
- on CPU (where nothing synchronises), the host reads in this repository's code that would:
  ``hybrid.zero.grad_norm.host_values`` and ``Tensor.item`` / ``Tensor.tolist`` calls (not
  torch.optim's reads of its step counters, which are host tensors on every device).

A training iteration needs exactly two: the data-parallel mean loss (``train_step``'s NaN check)
and the grad norm with the overflow and stop flags (``global_grad_norm_and_stop``). Anything
else (a loss read per micro-batch, an ``.item()`` per gradient, a stop-signal all-reduce read
every iteration) is a regression.

Usage::

    python scripts/gpu_sync_count.py [--device cuda|cpu] [hybrid.pretrain flags ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

EXPECTED_SYNCS = 2
"""Per training iteration: the mean-loss read and the grad-norm read."""

DEFAULT_ARGS = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
                "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
                "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3",
                "--log-interval", "3", "--eval-iters", "0", "--hidden-dropout", "0.1",
                "--attention-dropout", "0.1", "--recompute-granularity", "full",
                "--zero-stage", "3"]


def count_loop_syncs(rank: int, world: int, argv: list[str], device: str) -> list[list[str]]:
    """Run ``argv`` in this (spawned, one-rank) world; the sync events of each iteration after
    the first (``device`` "cuda": sync-debug warnings, "cpu": host reads)."""
    import torch

    import hybrid.training as training
    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import validate
    from hybrid.job.run import run
    from hybrid.zero import grad_norm

    per_iter: list[list[str]] = []
    step, depth, restore = training.train_step, [0], []

    def note(what):
        if len(per_iter) >= 2 and depth[0] == 0:
            per_iter[-1].append(what)

    def noting(fn, what):
        def wrapped(*args, **kwargs):
            caller = sys._getframe(1)
            where = os.path.relpath(caller.f_code.co_filename, REPO)
            if not where.startswith((".", "/")) and "site-packages" not in where:
                # ours; torch.optim's .item() of its host-side step counters is no device read
                note(f"{what} at {where}:{caller.f_lineno}")
            depth[0] += 1  # a read inside a counted read is the same read
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapped

    if device == "cpu":
        for owner, name in ((torch.Tensor, "item"), (torch.Tensor, "tolist"),
                            (grad_norm, "host_values")):
            restore.append((owner, name, getattr(owner, name)))
            setattr(owner, name, noting(getattr(owner, name), name))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def flush():
                for w in caught:
                    if "synchroniz" in str(w.message):
                        note(f"{w.filename}:{w.lineno}: {str(w.message)[:120]}")
                caught.clear()

            def counted_step(*args, **kwargs):
                flush()  # what the loop did since the last step belongs to that iteration
                per_iter.append([])
                if device == "cuda" and len(per_iter) == 2:  # after the warm-up iteration
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                return step(*args, **kwargs)

            training.train_step = counted_step
            run(validate(parse_config(argv)))
            flush()
    finally:
        training.train_step = step
        for owner, name, fn in restore:
            setattr(owner, name, fn)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    return per_iter[1:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available")
    args, rest = p.parse_known_args(argv)
    import torch

    from hybrid.parallel.spawn import spawn_world

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    got = spawn_world(1, count_loop_syncs, rest or DEFAULT_ARGS, device, timeout_s=300,
                      backend="nccl" if device == "cuda" else "gloo")[0]
    worst = max((len(x) for x in got), default=0)
    print(json.dumps(dict(device=device, expected=EXPECTED_SYNCS,
                          per_iteration=[len(x) for x in got], events=got[:2]), indent=1))
    ok = worst == EXPECTED_SYNCS and all(len(x) == EXPECTED_SYNCS for x in got)
    print(f"host syncs per iteration: {[len(x) for x in got]} (expected {EXPECTED_SYNCS}): "
          f"{'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
