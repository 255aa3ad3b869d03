"""How a job's process ends: the process group torn down around a training run or a dry run
(:func:`torn_down`), then the process ended without interpreter finalization
(:func:`exit_now`), its status handed to the launcher when one started it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys


@contextlib.contextmanager
def torn_down():
    """On leaving (returned or raised), around a training run or a dry run: destroy the process
    group if one started, then free the groups (joining gloo's threads) while Python is whole."""
    import torch.distributed as dist

    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def exit_now(status: int) -> None:
    """Flush everything and end the process without interpreter finalization.

    gloo's worker threads can outlive ``destroy_process_group`` (a process group that something
    still references is only shut down, not destroyed); interpreter finalization and C++ static
    destructors then race with them, and one rank in a few dies with ``terminate called without
    an active exception`` (SIGABRT) after a finished run. Every file, metric and wandb record is
    closed by then, so nothing is lost by skipping finalization. Under the launcher, a reported
    failure's status goes to it (:func:`hybrid.job.launch.worker_status`).
    """
    import logging

    from hybrid.job.launch import worker_status

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(worker_status(status))
