"""The Python steps of ``scripts/gpu_check.sh`` (one GPU; ``--cpu`` rehearses them on CPU).

Subcommands (each prints its figures and exits non-zero when its check fails):

- ``parity``: the same GPT trained a few ZeRO steps on CPU and on the GPU, one rank each, at
  ``--seq-length`` x ``--micro-batch-size`` tokens per micro-batch (2,048 by default), stages 0
  and 3, fp32 and bf16, dropout off. fp32 (TF32 off): losses within 1e-4 and the first step's
  grad norm within 1e-4 relative (cuBLAS and the CPU sum in other orders; measured differences
  are ~1e-6). bf16: within 2e-2 relative (8-bit mantissas, other kernels).
- ``attention``: the fused ``F.scaled_dot_product_attention`` against the explicit softmax path
  ``models.blocks.Attention.core`` takes with attention dropout on CPU (on GPU dropout now runs
  inside the fused kernel; ``kernel = "explicit"`` still selects it): outputs and input
  gradients (bf16 on GPU), forward+backward time and peak memory of each.
- ``pretrain-summary``: the last record of a ``hybrid.pretrain`` metrics file (tokens/s,
  TFLOP/s, MFU, peak allocated and reserved memory) beside the dry run's prediction read from
  its report, and the attention core each took: the dry run's from its report, the run's from
  its device and dropout (:func:`run_attention_core`, the rule of ``models.blocks.Attention``)
  with the attention kernels its profile recorded; the step fails when they differ.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


CASES = [(precision, stage) for precision in ("fp32", "bf16") for stage in (0, 3)]


def _train_all(rank: int, world: int, device: str, a: dict, times: int = 1) -> dict | list:
    """Spawned one-rank world: every case of :data:`CASES` on ``device``; ``times`` > 1 (the
    CPU rehearsal, whose two sides both run on CPU): a list of that many such results, from one
    process start instead of one each."""
    runs = [{case: _train(device, *case, a) for case in CASES} for _ in range(times)]
    return runs[0] if times == 1 else runs


def _train(device: str, precision: str, stage: int, a: dict) -> dict:
    """``a["steps"]`` ZeRO steps of a seeded GPT on fixed batches (2 micro-batches each)."""
    import torch

    from hybrid.config import DataConfig, PretrainConfig
    from hybrid.parallel.grid import ProcessGrid
    from hybrid.parallelize import meta_gpt, parallelize
    from hybrid.training import train_step
    from hybrid.zero.config import OptimizerConfig, ZeroConfig
    from models.gpt import GPTConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(a["threads"])
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    grid = ProcessGrid(tp=1, device=dev)
    cfg = GPTConfig(num_layers=a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
                    vocab_size=a["vocab"], max_position_embeddings=a["seq_length"],
                    hidden_dropout=0.0, attention_dropout=0.0)
    engine = parallelize(meta_gpt(cfg), grid, PretrainConfig(
        zero=ZeroConfig(stage=stage, precision=precision, param_persistence_threshold=0),
        optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0), data=DataConfig(seed=1234)))
    g = torch.Generator().manual_seed(5)
    losses, norms = [], []
    for _ in range(a["steps"]):
        batches = [torch.randint(0, a["vocab"], (a["micro_batch_size"], a["seq_length"] + 1),
                                 generator=g) for _ in range(2)]
        r = train_step(engine, batches, 1e-3, grid)
        losses.append(r.loss)
        norms.append(r.grad_norm)
    return dict(losses=losses, norms=norms, device=str(engine.states.master.device))


def parity(a: dict) -> bool:
    """Every case of :data:`CASES` on CPU and on the GPU (``a["cpu"]``: CPU twice); True when
    the losses and first grad norms agree within the module docstring's tolerances."""
    from hybrid.parallel.spawn import spawn_world

    t0 = time.time()
    if a["cpu"]:
        refs, gots = spawn_world(1, _train_all, "cpu", a, 2, timeout_s=600)[0]
    else:
        refs = spawn_world(1, _train_all, "cpu", a, timeout_s=600)[0]
        gots = spawn_world(1, _train_all, "cuda", a, timeout_s=600, backend="nccl")[0]
    print(f"parity: {a['micro_batch_size']} x {a['seq_length']} tokens per micro-batch, "
          f"{a['steps']} steps of 2 micro-batches [{time.time() - t0:.0f} s]")
    ok = True
    for (precision, stage), got in gots.items():
        ref, tol = refs[precision, stage], 1e-4 if precision == "fp32" else 2e-2
        rel = lambda x, y: abs(x - y) / max(abs(y), 1e-12)  # noqa: E731
        dl = max(rel(x, y) for x, y in zip(got["losses"], ref["losses"], strict=True))
        dn = rel(got["norms"][0], ref["norms"][0])
        good = dl <= tol and dn <= tol and all(map(math.isfinite, got["losses"]))
        ok &= good
        print(f"parity {precision} stage {stage} on {got['device']}: losses {got['losses']} "
              f"vs cpu {ref['losses']}; max rel loss diff {dl:.2e}, first grad-norm rel diff "
              f"{dn:.2e} (tolerance {tol:g}) {'OK' if good else 'FAIL'}", flush=True)
    return ok


def _explicit(q, k, v):
    """``models.blocks.Attention``'s explicit path, without the dropout (p = 0)."""
    import torch

    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


def _time_attention(fn, q, k, v, reps: int) -> dict:
    import torch

    cuda = q.is_cuda
    grads, out = None, None
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    for _ in range(reps + 1):
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        t0 = time.perf_counter()
        out = fn(qq, kk, vv)
        out.float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        grads = [t.grad for t in (qq, kk, vv)]
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else 0
    return dict(ms=1e3 * sorted(times[1:])[len(times[1:]) // 2], out=out.detach(), grads=grads,
                peak_mib=peak / 2**20)


def attention(a: dict) -> bool:
    """Fused vs explicit attention on ``a["attn_shape"]`` ``[b, heads, s, d]``: time, peak
    memory (MiB, GPU only) and relative differences of the output and input gradients; True
    when they agree (2e-2 in bf16 on GPU, 1e-5 in fp32 on CPU)."""
    import torch
    import torch.nn.functional as F

    cuda = not a["cpu"]
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    b, h, s, d = a["attn_shape"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(dev, dtype) for _ in range(3))
    fused = _time_attention(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                            q, k, v, a["reps"])
    plain = _time_attention(_explicit, q, k, v, a["reps"])
    tol = 2e-2 if cuda else 1e-5  # bf16 on GPU (other reduction orders); fp32 on CPU
    diffs = [(x.float() - y.float()).abs().max().item() / max(y.float().abs().max().item(), 1e-12)
             for x, y in zip([fused["out"], *fused["grads"]], [plain["out"], *plain["grads"]],
                             strict=True)]
    ok = max(diffs) <= tol
    print(f"attention [b={b}, heads={h}, s={s}, d={d}] {dtype} on {dev}: fused "
          f"{fused['ms']:.2f} ms peak {fused['peak_mib']:.0f} MiB | explicit {plain['ms']:.2f} "
          f"ms peak {plain['peak_mib']:.0f} MiB | explicit/fused time "
          f"{plain['ms'] / fused['ms']:.2f}x | "
          f"max rel diff out/dq/dk/dv {[f'{x:.1e}' for x in diffs]} (tolerance {tol:g}) "
          f"{'OK' if ok else 'FAIL'}", flush=True)
    return ok


def run_attention_core(device: str, attention_dropout: float) -> str:
    """The core ``models.blocks.Attention.core`` takes in training (kernel ``"auto"``), in the
    dry run report's words."""
    if attention_dropout == 0:
        return "scaled_dot_product_attention without dropout"
    if device == "cpu":
        return "explicit softmax core with dropout"
    return "fused scaled_dot_product_attention with dropout"


def _read_prediction(path: str) -> tuple[str, str]:
    """``(predicted peak, attention core measured)`` from a dry run's printed report."""
    predicted, core, scale = "-", "-", 1024.0  # GiB unless its header says MiB
    with open(path) as f:
        for line in f:
            m = re.match(r"total at the step peak\s+([\d.]+)\s+([\d.]+)", line.strip())
            # the header's unit: "memory in GiB (2^30 bytes)" (older reports: "measured GiB")
            unit = re.search(r"(?:memory in|measured) (GiB|MiB)", line)
            if unit:
                scale = 1024.0 if unit.group(1) == "GiB" else 1.0
            if m:
                predicted = (f"dry run {float(m.group(1)) * scale:.0f} MiB measured on fake "
                             f"tensors, planner {float(m.group(2)) * scale:.0f} MiB")
            c = re.match(r"attention core measured: (.+)", line.strip())
            if c:
                core = c.group(1)
    return predicted, core


def pretrain_summary(a: dict) -> bool:
    """Print the last training record of ``a["metrics"]`` beside the dry run's predicted step
    peak (``a["dry_run_report"]``) and the attention core of each; True when its loss is finite
    and both took the same core."""
    with open(a["metrics"]) as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = [r for r in records if "tokens_per_sec" in r]
    if not train:
        print(f"{a['name']} summary: no training record in {a['metrics']}: FAIL")
        return False
    r = train[-1]
    predicted, dry_core = _read_prediction(a["dry_run_report"])
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    memory = (f"peak allocated {r['memory_mb']:.0f} MiB, peak reserved "
              f"{r['memory_reserved_mb']:.0f} MiB" if "memory_reserved_mb" in r
              else f"peak RSS {r['memory_mb']:.0f} MiB (CPU)")
    print(f"{a['name']} (last log interval, iteration {r['iteration']}): "
          f"{r['tokens_per_sec']:,.0f} tokens/s, {r['tflops_per_device']:.1f} TFLOP/s per device, "
          f"MFU {mfu}, {memory} | predicted: {predicted}")
    run_core = run_attention_core(a["device"], a["attention_dropout"])
    kernels = "-"
    if a.get("profile_json") and os.path.exists(a["profile_json"]):
        with open(a["profile_json"]) as f:
            top = json.load(f)["top"].get("attention", [])
        kernels = "; ".join(name[:70] for name, _ in top) or "none recorded"
    same = run_core == dry_core
    print(f"attention core: dry run measured {dry_core}; the run took {run_core} (profiled "
          f"attention kernels: {kernels}): {'same' if same else 'DIFFERENT'}")
    return math.isfinite(r["lm_loss"]) and same


def main(argv=None) -> int:
    """Run one step (see the module docstring); 0 when its check passed, else 1."""
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("parity", "attention", "pretrain-summary"))
    p.add_argument("--cpu", action="store_true", help="rehearsal: the GPU side runs on CPU too")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--attn-shape", type=int, nargs=4, default=[4, 16, 2048, 64],
                   metavar=("B", "HEADS", "S", "D"))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--metrics", help="pretrain-summary: the metrics JSONL")
    p.add_argument("--dry-run-report", help="pretrain-summary: the dry run's printed report")
    p.add_argument("--name", default="pretrain", help="pretrain-summary: the step's name")
    p.add_argument("--profile-json", help="pretrain-summary: scripts/gpu_profile_run.py's JSON")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                   help="pretrain-summary: where the run trained")
    p.add_argument("--attention-dropout", type=float, default=0.0,
                   help="pretrain-summary: the run's --attention-dropout")
    a = vars(p.parse_args(argv))
    step = dict(parity=parity, attention=attention, **{"pretrain-summary": pretrain_summary})
    return 0 if step[a["step"]](a) else 1


if __name__ == "__main__":
    raise SystemExit(main())
