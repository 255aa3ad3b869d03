"""``hybrid.plan --verify``: the dry run of the planner's best layout, for rank 0, side by side.

:func:`verify_plan` is the step the entry point ``hybrid.plan`` gives the planner's command line.
:func:`pretrain_argv` writes the ``hybrid.pretrain`` flags of a planned layout (the model, the
batch, the precision, tp, the ZeRO stage and buckets, the activation mode, the device) with
``--mock-data --dry-run-world-size N --dry-run-rank 0``; :func:`verify` runs that dry run
(:mod:`hybrid.dryrun.dry_run`) in a fresh interpreter (the fake process group is the default
group) on the device whose code paths hold what a GPU holds (:func:`_command`), streams its
phase lines and report, and returns both totals. ``python -m hybrid.dryrun.verify
PRETRAIN_FLAGS`` is that interpreter: it prints the phase lines and one ``RESULT {json}`` line.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from hybrid.config import GridConfig, ModelConfig
from hybrid.field_flags import field_argv, key_of, section_argv
from hybrid.model_flags import PLAN_MODEL_FIELDS
from hybrid.planner.cli_args import zero_config
from hybrid.planner.inputs import layout_zero

# The activation modes of the planner (hybrid.planner.memory.ACTIVATION_OPTIONS) as flags.
ACTIVATION_FLAGS = {
    "none": [], "full": ["--checkpoint-activations"],
    "full+pa": ["--checkpoint-activations", "--partition-activations"],
    "full+pa+cpu": ["--checkpoint-activations", "--partition-activations",
                    "--checkpoint-in-cpu"],
    "selective": ["--recompute-granularity", "selective"],
    "sp": ["--sequence-parallel"],
    "sp+selective": ["--sequence-parallel", "--recompute-granularity", "selective"],
    "full+sp": ["--sequence-parallel", "--checkpoint-activations"],
    "full+sp+cpu": ["--sequence-parallel", "--checkpoint-activations", "--partition-activations",
                    "--checkpoint-in-cpu"],
}


def pretrain_argv(args, model, chosen, global_batch: int) -> list[str]:
    """The ``hybrid.pretrain`` flags of the dry run of ``chosen`` (a
    :class:`hybrid.planner.plan.Candidate`) for the planner's parsed ``args`` and its model
    (a :class:`models.config.GPTConfig`, for the vocabulary), rank 0 of
    ``args.num_gpus``; ``global_batch`` in samples. The model flags pass through as the planner
    read them (the same fields, :data:`hybrid.model_flags.PLAN_MODEL_FIELDS`); the micro-batch is
    ``chosen``'s (the planner's search); the ZeRO flags are those of the layout's ZeroConfig
    (:func:`hybrid.planner.inputs.layout_zero`: ZeRO++ and offload only where its stage takes
    them); ``--tp-comm-overlap`` only where sequence parallelism takes effect."""
    out = ["--preset", args.model] if args.model else []
    for f in dataclasses.fields(ModelConfig):
        if f.name in PLAN_MODEL_FIELDS and f.name not in ("preset", "vocab_size"):
            out += field_argv(f, getattr(args, key_of(f)))
    out += ["--make-vocab-size-divisible-by", str(args.make_vocab_size_divisible_by)]
    b = getattr(chosen, "micro_batch_size", None) or (args.micro_batch_size or [None])[0]
    out += ["--micro-batch-size", str(b)] if b else []  # the planner's pick (searched or given)
    out += ["--vocab-size", str(model.vocab_size), "--global-batch-size", str(global_batch),
            "--tensor-model-parallel-size", str(chosen.tp)]
    zero = layout_zero(zero_config(args), chosen.stage, getattr(chosen, "offload_fraction", 0.0))
    out += section_argv(zero, always=("stage",))
    out += ACTIVATION_FLAGS[chosen.activation]
    grid = GridConfig(tensor_model_parallel_size=chosen.tp,
                      sequence_parallel="sp" in chosen.activation.split("+"))
    if args.tp_comm_overlap and grid.sequence_parallel_active:
        out.append("--tp-comm-overlap")  # where it takes effect (pretrain refuses it elsewhere)
    out += ["--device", args.device] if args.device else []
    out += ["--gpu-memory-gib", str(args.gpu_memory_gb)] if args.gpu_memory_gb else []
    out += ["--reserved-gib", str(args.reserved_gb), "--mock-data",
            "--dry-run-world-size", str(args.num_gpus), "--dry-run-rank", "0"]
    return out


def verify(argv: list[str], say=print, gpu_paths: bool = True) -> dict:
    """Run the dry run of ``argv`` (from :func:`pretrain_argv`) in a fresh interpreter, on fake
    CUDA devices when ``gpu_paths`` (the model has attention dropout, see :func:`_command`);
    each of its lines goes to ``say`` as it comes; returns its result (:func:`main`'s
    ``RESULT``).

    Raises:
        RuntimeError: the dry run failed (its last output lines in the message).
    """
    cmd, env = _command(argv, say, gpu_paths)
    device = ["--dry-run-device", "cuda"] if env is not None else []
    say("dry run: python -m hybrid.pretrain " + " ".join([*argv, *device]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    result, tail = None, []
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        else:
            say(line)
            tail = (tail + [line])[-20:]
    if proc.wait() != 0 or result is None:
        raise RuntimeError("the dry run of the best layout failed:\n" + "\n".join(tail))
    return result


def _command(argv: list[str], say, gpu_paths: bool) -> tuple[list[str], dict | None]:
    """The dry run's interpreter. With attention dropout (``gpu_paths``; the dry run measures
    the explicit attention core, :func:`hybrid.dryrun.dry_run.measured_attention_path`) on fake
    CUDA devices (``--dry-run-device cuda``) where the small C++ extension builds:
    CUDA's fused dropout keeps a 1-byte mask per element, torch's CPU dropout a mask in the
    activation dtype (2 bytes in bf16: 4.5 GiB more per rank at 175B). Without it, on the CPU
    device: the attention core is ``scaled_dot_product_attention``, a flash kernel on the CPU
    (output and log-sum-exp kept, as on a GPU) but the math path under fake CUDA on a CPU-only
    torch (the whole score matrix: 161 GiB instead of 24 for Llama-3-8B at s = 8192)."""
    from hybrid.dryrun import fake_cuda

    if not gpu_paths:
        return [sys.executable, "-m", "hybrid.dryrun.verify", *argv], None
    try:
        return fake_cuda.preloaded_command("from hybrid.dryrun.verify import main\n",
                                           [*argv, "--dry-run-device", "cuda"])
    except RuntimeError as e:
        say(f"note: the dry run takes the CPU's code paths ({str(e).splitlines()[0]}); its "
            "dropout masks take 2 bytes per element where a GPU's take 1")
        return [sys.executable, "-m", "hybrid.dryrun.verify", *argv], None


def verify_plan(args, model, training, cluster, chosen) -> tuple[dict, list[str]] | None:
    """``hybrid.plan --verify`` (the step :func:`hybrid.planner.cli.main` is given): the dry
    run of ``chosen`` (a :class:`hybrid.planner.plan.Candidate`) for rank 0 of the planner's
    parsed ``args``, ``model``, ``training`` and ``cluster``, its lines streamed (to stderr
    under ``--json``). Returns ``(result, comparison lines)`` (:func:`verify`,
    :func:`comparison_lines`); None when nothing fits.

    Raises:
        RuntimeError: the dry run failed (:func:`verify`).
    """
    if chosen is None:
        return None
    gbs = training.global_batch_size or training.micro_batch_size * cluster.num_gpus
    argv = pretrain_argv(args, model, chosen, gbs)  # chosen.micro_batch_size: the searched b
    out = sys.stderr if args.json else sys.stdout
    print("verify: the dry run of the best layout, rank 0", file=out, flush=True)
    result = verify(argv, lambda line: print("  " + line, file=out, flush=True),
                    gpu_paths=args.attention_dropout > 0)
    return result, comparison_lines(result, chosen.total_bytes, chosen.fits)


def comparison_lines(result: dict, planned_total: float, planned_fits: bool) -> list[str]:
    """Both totals side by side (GiB, the reserve included) and both verdicts."""
    from hybrid.devices import gib_text

    gib = 2**30
    reserve = result["reserved_gib"]
    measured = result["measured_total"] / gib + reserve
    planned = planned_total / gib
    diff = (planned - measured) / measured
    verdicts = ("fits" if planned_fits else "does not fit",
                "fits" if result["fits"] else "does not fit")
    same = "the same verdict" if planned_fits == result["fits"] else "DIFFERENT verdicts"
    return [f"verify (rank 0, GiB, reserve {gib_text(reserve)} included): planner {planned:.2f} "
            f"({verdicts[0]}), dry run {measured:.2f} ({verdicts[1]}) of "
            f"{result['memory_gib']:.2f}; planner {diff:+.1%} vs the dry run, {same}",
            f"  (the dry run measured the attention core: {result.get('attention')})"]


def main(argv: list[str] | None = None) -> int:
    """The dry run's interpreter: phase lines, the report, then ``RESULT {json}`` with the
    measured and planned totals (bytes) and the verdict."""
    from hybrid.devices import GIB, device_memory_gib, fit_verdict
    from hybrid.dryrun.dry_run import dry_run
    from hybrid.dryrun.report import format_report
    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import validate

    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    g = cfg.dry_run
    r = dry_run(validate(cfg, world_size=g.dry_run_world_size), g.dry_run_rank,
                progress=lambda line: print(line, flush=True))
    memory = device_memory_gib(g.device, g.gpu_memory_gib, g.reserved_gib)
    print(format_report(r, g.device, g.gpu_memory_gib, g.reserved_gib), flush=True)
    fits = fit_verdict(r["measured"]["total"], memory, g.reserved_gib)[0]
    print("RESULT " + json.dumps(dict(
        measured_total=r["measured"]["total"], planned_total=r["planned"]["total"], fits=fits,
        memory_gib=memory, reserved_gib=g.reserved_gib, wall_s=r["wall_s"],
        attention=r.get("attention"),
        step_peak_gib=r["measured"]["total"] / GIB)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
