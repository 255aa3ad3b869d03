"""Step time on CPU with a checkpoint every 5 iterations: no save, a synchronous save, and
``--async-save``.

Not a test. One spawned world (1 rank by default, gloo, one thread) runs ``hybrid.pretrain``'s
``run`` for each setting in turn, ``--repeats`` times interleaved; the step time of an
iteration is the wall time between the ends of consecutive iterations' ``after_iteration``
hooks, so it holds the training step and whatever the save makes it wait for (the whole save,
or the snapshot and the publication). The first ``--warmup`` iterations are left out. Prints
each run, the median over the repeats of each setting's mean step time and its ratio to no
save, and the median of the ratios within a repeat (robust to a load that drifts)::

    python scripts/bench_async_save.py
    python scripts/bench_async_save.py --hidden-size 768 --num-layers 8 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("PYTHONPATH") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SETTINGS = {"no save": [], "sync save every 5": ["--save-interval", "5"],
            "--async-save every 5": ["--save-interval", "5", "--async-save"]}


def step_times(rank: int, world: int, argvs: list[list[str]], warmup: int) -> list[float]:
    """Each argv's mean step time (s) after ``warmup`` iterations (run in a spawned world)."""
    import hybrid.job.checkpointing as checkpointing
    from tests.pretrain_worlds import run_configs

    ends: list[float] = []
    hook = checkpointing.Checkpointer.after_iteration

    def timed(self, state):
        stop = hook(self, state)
        ends.append(time.perf_counter())
        return stop

    checkpointing.Checkpointer.after_iteration = timed
    out = []
    for argv in argvs:
        ends.clear()
        run_configs(rank, world, [argv])
        gaps = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:], strict=False)]
        out.append(sum(gaps) / len(gaps))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--train-iters", type=int, default=21)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--world-size", type=int, default=1)
    a = p.parse_args()
    from hybrid.parallel.spawn import spawn_world

    with tempfile.TemporaryDirectory() as tmp:
        base = ["--mock-data", "--vocab-size", str(a.vocab_size), "--num-layers",
                str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-attention-heads",
                "8", "--seq-length", str(a.seq_length), "--micro-batch-size",
                str(a.micro_batch_size), "--global-batch-size",
                str(a.micro_batch_size * a.world_size), "--train-iters", str(a.train_iters),
                "--eval-iters", "0", "--log-interval", "1000", "--lr-decay-style", "constant"]
        argvs, names = [], []
        for _ in range(a.repeats):
            for name, extra in SETTINGS.items():
                save = ["--save", f"{tmp}/{len(argvs)}"] if extra else []
                argvs.append(base + extra + save)
                names.append(name)
        times = spawn_world(a.world_size, step_times, argvs, a.warmup, timeout_s=600,
                            join_timeout_s=3600)[0]
    for n, t in zip(names, times, strict=True):
        print(f"  run: {n:<24} {1000 * t:9.1f} ms/step")
    by = {n: statistics.median(t for m, t in zip(names, times, strict=True) if m == n)
          for n in SETTINGS}
    print(f"GPT hidden {a.hidden_size} x {a.num_layers} layers, vocab {a.vocab_size}, seq "
          f"{a.seq_length}, micro batch {a.micro_batch_size}, {a.world_size} rank(s) on CPU; "
          f"{a.train_iters} iterations, first {a.warmup} left out; median of {a.repeats}")
    base_runs = [t for m, t in zip(names, times, strict=True) if m == "no save"]
    for n, t in by.items():
        runs = [t for m, t in zip(names, times, strict=True) if m == n]
        paired = statistics.median(x / b for x, b in zip(runs, base_runs, strict=True))
        print(f"  {n:<24} {1000 * t:9.1f} ms/step  x{t / by['no save']:.3f} (median of the "
              f"ratios to the no-save run of the same repeat: x{paired:.3f})")


if __name__ == "__main__":
    main()
