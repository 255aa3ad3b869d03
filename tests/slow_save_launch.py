"""The pretraining launcher with checkpoint saves slowed by ``SLOW_SAVE_S`` seconds (tests only):
``python -m tests.slow_save_launch --nproc-per-node N [flags]`` validates and starts torchrun as
``hybrid-pretrain --nproc-per-node N`` does (:func:`hybrid.job.launch.launch`), with this module
as the workers' program, so that a save outlasts torchrun's shutdown timeout."""

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from hybrid.job.preemption import catch_stops_early  # noqa: E402


def main() -> None:
    catch_stops_early()
    from hybrid.job import launch
    from hybrid.job.teardown import exit_now
    from hybrid.pretrain import pretrain as pretrain_main

    argv = sys.argv[1:]
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # the launcher
        exit_now(launch.launch(argv, module="tests.slow_save_launch"))
    import hybrid.checkpoint.shards as shards

    save = shards.save_checkpoint

    def slow_save(*args, **kwargs):
        time.sleep(float(os.environ.get("SLOW_SAVE_S", "0")))
        return save(*args, **kwargs)

    shards.save_checkpoint = slow_save  # Checkpointer.save imports it at each call
    exit_now(pretrain_main(argv))


if __name__ == "__main__":
    main()
