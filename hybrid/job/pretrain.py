"""The GPT pretraining job as the entry point ``hybrid.pretrain`` (which also starts the dry run)
calls it, in two phases: :func:`start`: parse -> validate -> start-up notes
(:mod:`hybrid.job.startup_notes`), all before any process group, or launch torchrun;
:func:`train`: the run (:mod:`hybrid.job.run`: grid -> ``parallelize`` (TP plan -> activation
checkpointing -> ZeRO) -> data -> train -> test evaluation -> close) with its outcome as the exit
status, the process group torn down (:mod:`hybrid.job.teardown`). Flags: ``--help``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from hybrid.job.preemption import process_start

process_start()  # --exit-duration-in-mins counts from here at the latest (before torch loads)


from hybrid.job.cli import parse_config  # noqa: E402
from hybrid.job.config_checks import ConfigError, Job, validate  # noqa: E402
from hybrid.job.run import run  # noqa: E402
from hybrid.job.startup_notes import print_notes  # noqa: E402
from hybrid.job.teardown import torn_down  # noqa: E402

if TYPE_CHECKING:
    from hybrid.config import PretrainConfig


def _checked_job(argv: list[str] | None):
    """Parse and validate the flags, then the checks and notes that come before any process
    group (rank 0 only, :func:`hybrid.job.startup_notes.print_notes`): wandb's names, the
    ignored Megatron-LM flags, the default ZeRO stage, a --split without validation data,
    --init-from-hf's dropout. Returns ``(cfg, job)``; raises :class:`ConfigError` for a bad
    flag."""
    ignored, hf_flags, given = [], [], set()  # parse_config fills them
    cfg = parse_config(argv, ignored, hf_flags, given)
    job = validate(cfg, world_size=cfg.dry_run.dry_run_world_size)
    if os.environ.get("RANK", "0") != "0":
        return cfg, job
    print_notes(cfg, job, ignored, hf_flags, given)
    return cfg, job


def start(argv: list[str] | None = None) -> tuple[PretrainConfig, Job] | int:
    """Before any process group: parse and check the flags (:func:`_checked_job`), or hand a
    ``--nproc-per-node N`` command to torchrun (:mod:`hybrid.job.launch`). Returns ``(cfg,
    job)`` for the entry point (:mod:`hybrid.pretrain`) to train or dry-run, or the exit status:
    torchrun's, or 2 for a bad flag (one line on stderr, from local rank 0 only)."""
    import warnings

    # a user's warning is a line of its own, not a source file and line of this package
    warnings.formatwarning = lambda msg, cat, *_, **__: f"{cat.__name__}: {msg}\n"
    argv = sys.argv[1:] if argv is None else argv
    try:
        from hybrid.job import launch

        if launch.wanted(argv):  # --nproc-per-node N
            return launch.launch(argv)
        return _checked_job(argv)
    except ConfigError as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node, not once per rank
            print(f"hybrid-pretrain: error: {e}", file=sys.stderr)
        else:  # torchrun stops the whole node when the first worker exits: rank 0 reports first
            time.sleep(3)
        return 2


def train(job: Job) -> int:
    """Train a validated job (:func:`hybrid.job.run.run`) and tear the process group down;
    returns the exit status: 0; 2 when another job holds ``--save`` (refused, not failed); 1 when
    ``--max-nan-iterations`` consecutive NaN/inf losses stopped training or a save failed."""
    import torch.distributed as dist

    from hybrid.checkpoint.agree import SaveFailedError
    from hybrid.checkpoint.lock import SaveDirectoryInUseError
    from hybrid.training import TooManyNaNIterations

    with torn_down():
        try:
            run(job)["engine"].close()
        # every rank sees the same mean loss, the same account of a failed save or a lock
        except (TooManyNaNIterations, SaveFailedError, SaveDirectoryInUseError) as e:
            if dist.get_rank() == 0:
                print(f"hybrid-pretrain: error: {e}", file=sys.stderr, flush=True)
            return 2 if isinstance(e, SaveDirectoryInUseError) else 1  # refused, not failed
        if dist.get_world_size() > 1:
            dist.barrier()  # no rank tears down while a peer still communicates
    return 0
