"""``torchrun -m hybrid.pretrain`` / ``python -m hybrid.pretrain`` / ``hybrid-pretrain``: the
pretraining job (see :mod:`hybrid.job.pretrain`); with ``--nproc-per-node N`` the launcher that
validates the flags and then starts torchrun (:mod:`hybrid.job.launch`)."""

import os

# before torch loads (hybrid.job.pretrain imports it): later, the default no longer applies
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hybrid.job.preemption import catch_stops_early  # noqa: E402

if __name__ == "__main__":  # before torch loads: a stop during the imports is kept too
    catch_stops_early()

from hybrid.job.pretrain import exit_now  # noqa: E402
from hybrid.job.pretrain import main as _main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The entry point: SIGTERM / SIGINT stop the job gracefully from here on
    (:mod:`hybrid.job.preemption`); returns the exit status."""
    catch_stops_early()
    return _main(argv)


if __name__ == "__main__":
    exit_now(main())
