"""Memory of a checkpoint save and bytes read by a load onto another grid, per rank (4 ranks).

Not a test (``tests/test_checkpoint_memory.py`` asserts the bounds with the same functions).
One spawn of 4 ranks trains one step of a GPT at tp=2 x dp=2 for each ZeRO stage and saves it,
measuring each rank's resident-set peak during ``save_checkpoint`` above its resident set just
before (Linux ``VmHWM`` after resetting it through ``/proc/self/clear_refs``; large allocations
are mmap-ed so that freed memory leaves the resident set at once). Then the stage-2 checkpoint
is loaded at tp=1 x dp=3 ZeRO-3 and tp=1 x dp=4 ZeRO-1 and re-saved; the tensor bytes each rank
read are counted by wrapping ``safetensors.safe_open`` (independent of the reader's own count)
and set against the rank's share (the unpadded fp32 states of the fragments its optimizer
updates). Runs against whatever ``hybrid`` is first on ``PYTHONPATH``, so the same command
measures another checkout (``PYTHONPATH=/path/to/other/checkout``) for a before/after table::

    python scripts/bench_checkpoint.py --out runs/bench_ckpt
    python scripts/bench_checkpoint.py --hidden-size 384 --num-layers 8

Writes ``checkpoint.md`` and ``checkpoint.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

if os.environ.get("PYTHONPATH") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 2**20
KINDS = ("master", "exp_avg", "exp_avg_sq")


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _release_freed_memory() -> None:
    """Serve every allocation above 64 KiB by mmap (M_MMAP_THRESHOLD = -3), so freeing returns
    it."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)
    except OSError:
        pass


def _reset_peak() -> int:
    """Reset ``VmHWM`` to the current resident set; returns that resident set (bytes)."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _engine(grid, model_kw: dict, stage: int, seed: int = 7):

    from hybrid.config import DataConfig, PretrainConfig
    from hybrid.parallelize import meta_gpt, parallelize
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from models.gpt import GPTConfig

    return parallelize(meta_gpt(GPTConfig(**model_kw, hidden_dropout=0.0, attention_dropout=0.0)),
                       grid, PretrainConfig(
        zero=ZeroConfig(stage=stage, reduce_bucket_size=2**20, allgather_bucket_size=2**20),
        optimizer=OptimizerConfig(lr=1e-3), data=DataConfig(seed=seed)))


def _step(engine, grid, vocab: int, seq: int = 32) -> None:
    import torch

    g = torch.Generator().manual_seed(100 + grid.dp_rank)
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=g)
    engine.backward(engine.model(tokens[:, :-1], tokens[:, 1:]).mean(), is_last_micro_batch=True)
    engine.step(1e-3)


def _unit_states(engine) -> int:
    """fp32 master + Adam bytes of the largest unit, unpartitioned (12 B per element)."""
    return 12 * max(u.padded for u in engine.layout.units)


def save_world(rank: int, world: int, root: str, model_kw: dict, stages: list[int],
               tp: int = 2) -> list[dict]:
    """Per stage: train one step, save under ``root/stage{s}``; this rank's save figures."""
    import torch

    from hybrid.checkpoint.shards import save_checkpoint
    from hybrid.parallel.grid import ProcessGrid

    _release_freed_memory()
    torch.manual_seed(0)
    grid = ProcessGrid(tp=tp)
    out = []
    for stage in stages:
        engine = _engine(grid, model_kw, stage)
        _step(engine, grid, model_kw["vocab_size"])
        engine.comm.reset()
        before = _reset_peak()
        save_checkpoint(os.path.join(root, f"stage{stage}"), 1, engine, grid, {"iteration": 1}, {})
        peak = _status("VmHWM") - before
        mem = engine.memory_bytes()
        out.append(dict(stage=stage, rank=rank, steady=before, save_peak=peak,
                        unit_states=_unit_states(engine),
                        states=sum(mem[k] for k in ("params", "grads", "master", "optimizer")),
                        all_gathered=int(engine.comm.snapshot().get("state_all_gather", 0))))
        del engine
    return out


class _Counting:
    """``safe_open`` that counts the tensor bytes it hands out (``get_tensor`` / ``get_slice``)."""

    total = 0

    def __init__(self, path, framework="pt", device="cpu"):
        from safetensors import safe_open

        self._f = safe_open(path, framework=framework, device=device)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def get_tensor(self, key):
        t = self._f.get_tensor(key)
        _Counting.total += t.numel() * t.element_size()
        return t

    def get_slice(self, key):
        sl = self._f.get_slice(key)

        class Slice:
            def __getitem__(self, idx):
                t = sl[idx]
                _Counting.total += t.numel() * t.element_size()
                return t

            def __getattr__(self, name):
                return getattr(sl, name)

        return Slice()


def load_world(rank: int, world: int, root: str, out_root: str, model_kw: dict, stage: int,
               tp: int) -> dict:
    """Load ``root`` at (tp, this world's dp, ``stage``), re-save it under ``out_root``; this
    rank's bytes read (RNG states excluded), share and load peak."""
    import importlib

    import torch

    import hybrid.checkpoint.shards as shards
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallel.tp_spec import get_tp_spec

    _release_freed_memory()
    torch.manual_seed(0)
    grid = ProcessGrid(tp=tp)
    # other weights: the load must replace them all
    engine = _engine(grid, model_kw, stage, seed=99)
    # this and earlier versions
    for name in ("hybrid.checkpoint.shards", "hybrid.checkpoint.fragments"):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(mod, "safe_open"):
            mod.safe_open = _Counting
    before = _reset_peak()
    shards.load_checkpoint(root, engine, grid, load_rng=False)
    peak = _status("VmHWM") - before
    read = _Counting.total
    share = 0
    for _, f in engine.opt_params:
        slot = engine.layout.slots[f.slot]
        spec = get_tp_spec(engine.params[slot.index])
        real = torch.zeros(slot.shape, dtype=torch.bool)
        (real if spec.replicated else real.narrow(spec.split_dim, 0, spec.real_local_size())).fill_(
            True)
        share += int(real.reshape(-1)[f.param_start:f.param_start + f.length].sum())
    shards.save_checkpoint(out_root, 1, engine, grid, {"iteration": 1}, {})
    return dict(rank=rank, read=read, share=12 * share, unit_states=_unit_states(engine),
                load_peak=peak)


def measure(workdir: str, model_kw: dict, stages=(1, 2, 3)) -> dict:
    """Every figure of the module docstring; checkpoints are left under ``workdir``."""
    from hybrid.parallel.spawn import spawn_world

    saves = spawn_world(4, save_world, workdir, model_kw, list(stages), timeout_s=300)
    loads = {}
    for name, world, stage in (("tp1_dp3_zero3", 3, 3), ("tp1_dp4_zero1", 4, 1)):
        loads[name] = spawn_world(world, load_world, os.path.join(workdir, "stage2"),
                                  os.path.join(workdir, name), model_kw, stage, 1, timeout_s=300)
    return dict(model=model_kw, saves=[r for per_rank in saves for r in per_rank], loads=loads,
                consolidate=consolidate_peak(os.path.join(workdir, "stage2"),
                                             os.path.join(workdir, "model.safetensors")))


def consolidate_peak(root: str, output: str) -> dict:
    """Resident-set peak of ``hybrid.checkpoint.consolidate.consolidate`` in this process, against
    the largest tensor and the whole model (fp32 bytes)."""
    from hybrid.checkpoint.consolidate import consolidate

    _release_freed_memory()
    meta = json.loads((Path(root) / "iter_0000001" / "metadata.json").read_text())
    sizes = [4 * _numel(p["full_shape"]) for p in meta["params"].values()]
    before = _reset_peak()
    consolidate(root, output)
    return dict(peak=_status("VmHWM") - before, largest=max(sizes), model=sum(sizes))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def report(res: dict) -> str:
    lines = ["| save (tp2 x dp2) | rank | steady RSS MiB | save peak above steady MiB | one unit's "
             "states MiB | state all-gather MiB |", "|---|---|---|---|---|---|"]
    for r in sorted(res["saves"], key=lambda r: (r["stage"], r["rank"])):
        lines.append(f"| ZeRO-{r['stage']} | {r['rank']} | {r['steady'] / MIB:.1f} | "
                     f"{r['save_peak'] / MIB:.1f} | {r['unit_states'] / MIB:.1f} | "
                     f"{r['all_gathered'] / MIB:.1f} |")
    lines += ["", "| load tp2 x dp2 ZeRO-2 -> | rank | read MiB | share MiB | read / share | load "
                  "peak MiB |",
              "|---|---|---|---|---|---|"]
    for name, ranks in res["loads"].items():
        for r in ranks:
            lines.append(f"| {name} | {r['rank']} | {r['read'] / MIB:.2f} | {r['share'] / MIB:.2f} "
                         f"| {r['read'] / r['share']:.3f} | {r['load_peak'] / MIB:.1f} |")
    c = res["consolidate"]
    lines += ["", "consolidation of the ZeRO-2 checkpoint (one process): peak "
              f"{c['peak'] / MIB:.1f} MiB above the process before it; largest tensor "
              f"{c['largest'] / MIB:.1f} MiB, whole model {c['model'] / MIB:.1f} MiB"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--out", default="runs/bench_checkpoint")
    a = p.parse_args(argv)
    kw = dict(num_layers=a.num_layers, hidden_size=a.hidden_size,
              num_attention_heads=a.num_attention_heads, vocab_size=a.vocab_size,
              max_position_embeddings=64)
    with tempfile.TemporaryDirectory() as d:
        res = measure(d, kw)
    text = report(res)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint.md").write_text(text + "\n")
    (out / "checkpoint.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
