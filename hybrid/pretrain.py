"""``torchrun -m hybrid.pretrain`` / ``python -m hybrid.pretrain`` / ``hybrid-pretrain``: the
pretraining job (see :mod:`hybrid.job.pretrain`); with ``--nproc-per-node N`` the launcher that
validates the flags and then starts torchrun (:mod:`hybrid.job.launch`); with
``--dry-run-world-size N`` the dry run of one rank on fake tensors (:mod:`hybrid.dryrun`).

The entry point is where the job and the dry run meet: the dry run builds on the job, so the
job never starts it (it stands on the floor below)."""

import os

# before torch loads (hybrid.job.pretrain imports it): later, the default no longer applies
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hybrid.job.preemption import catch_stops_early  # noqa: E402

if __name__ == "__main__":  # before torch loads: a stop during the imports is kept too
    catch_stops_early()

from hybrid.job.pretrain import start, train  # noqa: E402
from hybrid.job.teardown import exit_now  # noqa: E402


def pretrain(argv: list[str] | None = None) -> int:
    """Parse and check ``argv`` (default: the command line's), then launch torchrun
    (``--nproc-per-node N``), dry-run one rank (``--dry-run-world-size N``,
    :func:`hybrid.dryrun.report.dry_run_job`) or train (:func:`hybrid.job.pretrain.train`).
    Returns the exit status (2: a bad flag, or refused before training; see ``train``)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    started = start(argv)
    if isinstance(started, int):  # launched, or refused
        return started
    cfg, job = started
    if cfg.dry_run.dry_run_world_size:
        from hybrid.dryrun.report import dry_run_job

        return dry_run_job(job, argv)
    return train(job)


def main(argv: list[str] | None = None) -> int:
    """The entry point: SIGTERM / SIGINT stop the job gracefully from here on
    (:mod:`hybrid.job.preemption`); then :func:`pretrain`. Returns the exit status."""
    catch_stops_early()
    return pretrain(argv)


if __name__ == "__main__":
    exit_now(main())
