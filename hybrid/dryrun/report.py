"""The dry run's report: measured vs planned bytes per kind, in GiB, and the verdict.

:func:`format_report` turns the dict of :func:`hybrid.dryrun.dry_run.dry_run` into the table
``hybrid.pretrain --dry-run-world-size N`` prints, and ends it with the answer to "does it fit":
the measured step peak plus the reserve against one GPU's memory, the rule of ``hybrid.plan``
(:func:`hybrid.devices.fit_verdict`), for ``--device`` (a planner preset, default
A100-80GB) or ``--gpu-memory-gib``, with ``--reserved-gib`` (default 1 GiB) held back.
Memory is in GiB (2^30 bytes) throughout, as in the planner.
"""

from __future__ import annotations

from hybrid.devices import (
    DEFAULT_DEVICE,
    DEFAULT_RESERVED_GIB,
    GIB,
    device_memory_gib,
    fit_verdict,
    gib_text,
)

_ROWS = [(lambda r: f"compute params ({r['precision']})", "params"),
         (lambda r: f"gradients ({r.get('grad_dtype', 'fp32')})", "grads"),
         (lambda r: "fp32 master", "master"),
         (lambda r: "Adam moments", "optimizer"), (lambda r: "model states", "states"),
         (lambda r: "buffers (+ stage-3 gathered units)", "buffers"),
         (lambda r: "activations + temporaries (peak)", "activations"),
         (lambda r: "host checkpoints (not in total)", "host_checkpoints"),
         (lambda r: "host optimizer (not in total)", "host_states"),
         (lambda r: "total at the step peak", "total")]


def _transfers(r: dict) -> list[str]:
    """The step's host<->device copies and host reads, counted, with their source lines."""
    from hybrid.dryrun.fake_cuda import summarize

    lines = [f"one step on {r['device']}: {len(r['copies'])} host<->device copies, "
             f"{len(r['reads'])} host reads"]
    lines += [f"  copy {x}" for x in summarize(r["copies"])]
    lines += [f"  read {x}" for x in summarize(r["reads"])]
    return lines


def verdict_lines(r: dict, device: str | None = None, memory_gib: float | None = None,
                  reserved_gib: float = DEFAULT_RESERVED_GIB) -> list[str]:
    """The verdict for the measured step peak ``r['measured']['total']`` (bytes) and the
    planner's for its total, on ``device`` (a :mod:`hybrid.devices` preset; None: the
    default) or ``memory_gib`` GiB, each with ``reserved_gib`` GiB held back.

    Raises:
        ValueError: an unknown device without ``memory_gib``, or a reserve that leaves nothing.
    """
    memory = device_memory_gib(device, memory_gib, reserved_gib)
    name = (f"{gib_text(memory_gib)} GiB GPU" if memory_gib is not None
            else device or DEFAULT_DEVICE)
    fits, text = fit_verdict(r["measured"]["total"], memory, reserved_gib)
    p_fits, p_text = fit_verdict(r["planned"]["total"], memory, reserved_gib,
                                 "planned total")
    agree = "agrees" if fits == p_fits else "DISAGREES"
    lines = [f"verdict on {name} (--device / --gpu-memory-gib, --reserved-gib): rank "
             f"{r['rank']} {text}",
             f"  planner ({agree}): {p_text}"]
    lines += [f"  ({x})" for x in code_path_notes(r)]
    return lines


def code_path_notes(r: dict) -> list[str]:
    """Where the dry run's code paths hold other bytes than a GPU's would, for ``r`` (its
    ``device``, ``dropout`` and ``sdpa``, the attention core without dropout)."""
    if r["device"].startswith("cpu") and r.get("dropout"):
        return ["the CPU's code paths: torch's CPU dropout keeps its mask in the activation "
                "dtype, 2 bytes per element in bf16, where a GPU's keeps 1; --dry-run-device "
                "cuda takes the GPU's"]
    if r["device"].startswith("cuda") and r.get("sdpa"):
        return ["fake CUDA on a CPU-only torch: scaled_dot_product_attention has no flash "
                "kernel there and keeps the whole score matrix, where a GPU keeps the output "
                "and the log-sum-exp; --dry-run-device cpu takes a flash kernel (the CPU's)"]
    return []


def format_report(r: dict, device: str | None = None, memory_gib: float | None = None,
                  reserved_gib: float = DEFAULT_RESERVED_GIB) -> str:
    """A table of measured vs planned bytes per kind in GiB, with the relative differences,
    then the verdict (:func:`verdict_lines`) for ``device`` / ``memory_gib`` / ``reserved_gib``.
    """
    m, p = r["measured"], r["planned"]
    digits = 3 if max(m["total"], p["total"]) >= GIB else 6

    def gib(x: float, width: int = 14) -> str:
        return f"{x / GIB:>{width}.{digits}f}"

    n = r["local_params"]
    count = f"{n / 1e9:.3f}e9" if n >= 1e9 else f"{n / 1e6:.3f}e6" if n >= 1e6 else f"{n:,}"
    lines = [f"dry run: rank {r['rank']} of {r['world']} (tp {r['tp']} x dp {r['dp']}, tp_rank "
             f"{r['tp_rank']}, dp_rank {r['dp_rank']}), ZeRO-{r['stage']} {r['precision']}, "
             f"{count} local parameters; built in {r['build_s']:.0f} s, "
             f"{r['wall_s']:.0f} s with the step",
             f"{'GiB (2^30 bytes) per rank':<34}{'measured':>14}{'planner':>14}{'diff':>9}"]
    for label, k in _ROWS:
        if k == "host_states" and not m.get(k):
            continue  # no --optimizer-cpu-offload
        p.setdefault(k, 0)  # a planner without the offload column
        diff = f"{(m[k] - p[k]) / p[k]:+.1%}" if p[k] else "-"
        lines.append(f"{label(r):<34}{gib(m[k])}{gib(p[k])}{diff:>9}")
        if k == "activations" and "temporaries" in p:
            lines += [f"{'  kept for backward':<34}{'':>14}{gib(p['kept_activations'])}",
                      f"{'  temporaries':<34}{'':>14}{gib(p['temporaries'])}"]
    lines.append(f"{'construction peak':<34}{gib(m['construction_peak'])}{'':>14}"
                 f"  (bound: steady state + one unit in fp32 = {gib(r['bound'], 0)}; units are "
                 "filled before the gradient and staging buffers exist, so it may equal the steady "
                 "state)")
    lines.append(f"{'checkpoint-save peak':<34}{gib(m['save_peak'])}{'':>14}"
                 f"  (bound: steady state + one unit's fp32 states = "
                 f"{gib(r['save_bound'], 0)}; a rank's fragments are written from the states "
                 "themselves)")
    if m.get("async_save_snapshot"):  # host memory, kept between saves
        lines.append(f"{'--async-save host snapshot':<34}{gib(m['async_save_snapshot'])}"
                     "  (host memory, pinned on GPU; not in total)")
    lines.append(f"{'tracked after construction':<34}{gib(m['tracked_after_build'])}"
                 f"  (= model states {gib(m['states'], 0)} + communication buffers "
                 f"{gib(m['buffers'] - m['gathered_peak'], 0)}; stage 3's gathered units "
                 "come and go in the step)")
    lines += _transfers(r)
    if r.get("attention"):
        lines.append(f"attention core measured: {r['attention']}")
    lines.append("The planner's activations are what backward keeps (arXiv 2205.05198 §4) plus the "
                 "step's temporaries (hybrid.planner.temporaries: the loss's logits and their fp32 "
                 "copies, a unit's gradients in the compute dtype before their reduction, sequence "
                 "parallelism's gathered inputs).")
    lines += verdict_lines(r, device, memory_gib, reserved_gib)
    return "\n".join(lines)


def micro_batch_note(n: int, of: int) -> str:
    """Why the dry run's step runs ``n`` of the job's ``of`` micro-batches per step."""
    return (f"dry run: the step runs {n} of the job's {of} micro-batch(es) per rank "
            "(--dry-run-micro-batches, default 1): once the buffers exist each micro-batch "
            "allocates and frees the same activations, so the memory peak of one is the peak "
            "of all")


def run_and_report(job, title: str) -> int:
    """``hybrid.pretrain --dry-run-world-size N``: print ``title``, the micro-batch note, one
    line per phase as it ends, then the report and its verdict for the job's ``--device`` /
    ``--gpu-memory-gib`` / ``--reserved-gib``. Returns 0 (the exit status): a layout that does
    not fit is an answer, not an error; a stop (SIGTERM, Ctrl-C) ends it at the next phase
    boundary with one line, exit status 0, as training stops."""
    from hybrid.dryrun.dry_run import dry_run
    from hybrid.dryrun.phases import DryRunStopped

    g = job.cfg.dry_run

    def say(line: str) -> None:
        print(line, flush=True)

    say(title + " | memory in GiB (2^30 bytes)")
    say(micro_batch_note(g.dry_run_micro_batches, job.grad_accum_steps))
    try:
        r = dry_run(job, g.dry_run_rank, progress=say)
    except DryRunStopped as stopped:
        say(stopped.line())
        return 0
    say(format_report(r, g.device, g.gpu_memory_gib, g.reserved_gib))
    return 0


def dry_run_job(job, argv: list[str]) -> int:
    """``hybrid.pretrain --dry-run-world-size N``'s run of a validated ``job`` (a
    :class:`hybrid.job.config_checks.Job`, parsed from ``argv``): :func:`run_and_report`, the
    fake process group torn down after it; with ``--dry-run-device cuda`` in an interpreter that
    has not loaded the fake CUDA library, the same ``argv`` in a fresh one that has
    (:func:`hybrid.dryrun.fake_cuda.run_preloaded`, which runs :func:`main`). Returns the exit
    status."""
    from hybrid.dryrun import fake_cuda
    from hybrid.job.startup_notes import header
    from hybrid.job.teardown import torn_down

    if job.cfg.dry_run.dry_run_device == "cuda" and not fake_cuda.loaded():
        return fake_cuda.run_preloaded(argv)
    with torn_down():
        return run_and_report(job, f"hybrid-zero dry run | {header(job)}")


def main(argv: list[str]) -> int:
    """The dry run of ``hybrid.pretrain`` flags ``argv`` (with ``--dry-run-world-size N``), as
    ``hybrid.pretrain`` runs it: the flags parsed and checked as for training
    (:func:`hybrid.job.pretrain.start`: one line and status 2 for a bad one), then
    :func:`dry_run_job`. The program of the interpreter that loaded the fake CUDA library."""
    from hybrid.job.pretrain import start

    started = start(argv)
    return started if isinstance(started, int) else dry_run_job(started[1], argv)
